/* gpuwatch's 10 Hz tick loop in C (loaded with ctypes by gpuwatch/telemetry/ticker.py; no Python API).
 *
 * A pthread wakes at absolute deadlines (clock_nanosleep TIMER_ABSTIME, CLOCK_MONOTONIC) and per tick
 * takes the wall clock, preads the host CPU file (the fd HostSampler keeps open) and makes every NVML
 * call of the spec list with the output buffers' start-up contents (version fields, field ids) copied
 * in first. The raw outputs, return codes and timings go into one record of a ring; Python drains the
 * ring when woken (a byte on `notify_fd` every `notify_every` ticks) and decodes the records with the
 * same code as its own loop. A tick more than one interval late skips the missed deadlines (`late`);
 * a full ring overwrites its oldest record (`dropped`).
 *
 * Record layout (all offsets from the record start; Python computes the same):
 *   gw_head | int32 ret[n] | uint32 count[n] | host bytes [host_size] | outputs at spec.off
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { K_OUT, K_INT_OUT, K_INT_INT_OUT, K_COUNT_OUT };  /* NVML signature kinds */
typedef int (*f_out)(void *, void *);                    /* f(handle, out) */
typedef int (*f_int_out)(void *, int, void *);           /* f(handle, a, out) */
typedef int (*f_int_int_out)(void *, int, int, void *);  /* f(handle, a, b, out) */
typedef int (*f_count_out)(void *, unsigned *, void *);  /* f(handle, &count in/out, array) */

typedef struct {
    void *fn, *handle;     /* pynvml's function pointer, the device handle */
    int32_t kind, a, b;    /* signature kind, int arguments */
    uint32_t cap;          /* K_COUNT_OUT: array capacity, the count passed in */
    int64_t size, off;     /* output bytes, and where they go in a record */
    const void *tmpl;      /* the output buffer at start (copied in before each call) */
} gw_spec;

typedef struct {
    int64_t ts_us, mono_ns, cost_ns, cpu_ns; /* wall clock (us), tick start, the tick's wall and CPU cost */
    int32_t host_len, n;                     /* bytes read from the host file (-errno on failure), specs */
} gw_head;

typedef struct {
    gw_spec *specs; int n;
    char *tmpl;                                /* copies of the templates, at spec.off */
    int host_fd; int64_t host_off, host_size;
    int64_t interval_ns, first_ns; int notify_fd, notify_every;
    int64_t rec_size; int cap;
    char *ring, *work;                         /* cap records; the record being built */
    int64_t head, count, dropped, late;        /* head: next slot written; guarded by mu */
    pthread_mutex_t mu; pthread_t th; int stop;  /* stop: read and written with __atomic builtins */
} gw_ticker;

static int64_t now_ns(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }

static void tick(gw_ticker *t) {
    char *r = t->work;
    gw_head *h = (gw_head *)r;
    int32_t *ret = (int32_t *)(r + sizeof(gw_head));
    uint32_t *count = (uint32_t *)(ret + t->n);
    int64_t c0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
    h->mono_ns = now_ns(CLOCK_MONOTONIC);
    h->ts_us = now_ns(CLOCK_REALTIME) / 1000;
    h->n = t->n;
    if (t->host_fd >= 0) {
        ssize_t k = pread(t->host_fd, r + t->host_off, t->host_size, 0);
        h->host_len = k < 0 ? -errno : (int32_t)k;
    } else h->host_len = -EBADF;
    for (int i = 0; i < t->n; i++) {
        gw_spec *s = &t->specs[i];
        void *out = r + s->off;
        memcpy(out, t->tmpl + s->off, s->size);
        count[i] = 0;
        switch (s->kind) {
        case K_OUT: ret[i] = ((f_out)s->fn)(s->handle, out); break;
        case K_INT_OUT: ret[i] = ((f_int_out)s->fn)(s->handle, s->a, out); break;
        case K_INT_INT_OUT: ret[i] = ((f_int_int_out)s->fn)(s->handle, s->a, s->b, out); break;
        default: count[i] = s->cap; ret[i] = ((f_count_out)s->fn)(s->handle, &count[i], out); break;
        }
    }
    h->cost_ns = now_ns(CLOCK_MONOTONIC) - h->mono_ns;
    h->cpu_ns = now_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
    pthread_mutex_lock(&t->mu);  /* into the ring: the oldest record goes when it is full */
    memcpy(t->ring + (t->head % t->cap) * t->rec_size, r, t->rec_size);
    t->head++;
    if (t->count == t->cap) t->dropped++; else t->count++;
    pthread_mutex_unlock(&t->mu);
}

static int stopping(gw_ticker *t) { return __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE); }

static void *loop(void *arg) {
    gw_ticker *t = arg;  /* created with every signal blocked (gw_start): signals are Python's business */
    int64_t deadline = t->first_ns ? t->first_ns : now_ns(CLOCK_MONOTONIC);
    int since = 0;
    while (!stopping(t)) {
        struct timespec ts = { deadline / 1000000000LL, deadline % 1000000000LL };
        while (!stopping(t) && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
        if (stopping(t)) break;
        tick(t);
        if (++since >= t->notify_every) {  /* wake the Python side: records to decode */
            since = 0;
            if (write(t->notify_fd, "t", 1) < 0) { /* a full pipe: Python is behind and will drain anyway */ }
        }
        deadline += t->interval_ns;
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (now > deadline + t->interval_ns) { __atomic_add_fetch(&t->late, 1, __ATOMIC_RELAXED); deadline = now; }  /* skip missed deadlines */
    }
    return NULL;
}

/* Start the thread; its first tick at monotonic `first_ns` (0: now; a restart keeps the old deadlines).
 * The specs (and the templates they point to) are copied: the caller may free them. */
gw_ticker *gw_start(const gw_spec *specs, int n, int host_fd, int64_t host_off, int64_t host_size,
                    int64_t rec_size, int64_t interval_ns, int64_t first_ns, int cap, int notify_fd, int notify_every) {
    gw_ticker *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->specs = malloc(sizeof(gw_spec) * (n ? n : 1));
    t->tmpl = calloc(1, rec_size);
    t->ring = malloc(rec_size * cap);
    t->work = calloc(1, rec_size);
    if (!t->specs || !t->tmpl || !t->ring || !t->work) goto fail;
    memcpy(t->specs, specs, sizeof(gw_spec) * n);
    for (int i = 0; i < n; i++) memcpy(t->tmpl + specs[i].off, specs[i].tmpl, specs[i].size);
    t->n = n; t->host_fd = host_fd; t->host_off = host_off; t->host_size = host_size;
    t->rec_size = rec_size; t->interval_ns = interval_ns; t->first_ns = first_ns; t->cap = cap;
    t->notify_fd = notify_fd; t->notify_every = notify_every > 0 ? notify_every : 1;
    pthread_mutex_init(&t->mu, NULL);
    sigset_t all, old;  /* the thread inherits this mask: blocked from its first instruction */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&t->th, NULL, loop, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0) {
        pthread_setname_np(t->th, "gw-ticker");  /* top -H, bench_sampler.py threads: the C loop's own line */
        return t;
    }
    pthread_mutex_destroy(&t->mu);
fail:
    free(t->specs); free(t->tmpl); free(t->ring); free(t->work); free(t);
    return NULL;
}

/* Copy up to `max` records, oldest first, into buf; returns how many. */
int gw_drain(gw_ticker *t, char *buf, int max) {
    pthread_mutex_lock(&t->mu);
    int k = t->count < max ? (int)t->count : max;
    int64_t first = t->head - t->count;
    for (int i = 0; i < k; i++)
        memcpy(buf + i * t->rec_size, t->ring + ((first + i) % t->cap) * t->rec_size, t->rec_size);
    t->count -= k;
    pthread_mutex_unlock(&t->mu);
    return k;
}

/* late ticks and dropped records so far */
void gw_stats(gw_ticker *t, int64_t *late, int64_t *dropped) {
    pthread_mutex_lock(&t->mu);
    *late = __atomic_load_n(&t->late, __ATOMIC_RELAXED); *dropped = t->dropped;
    pthread_mutex_unlock(&t->mu);
}

/* Stop and join the thread (within one interval); the ring stays readable until gw_free. */
void gw_stop(gw_ticker *t) {
    if (!stopping(t)) { __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE); pthread_join(t->th, NULL); }
}

void gw_free(gw_ticker *t) {
    gw_stop(t);
    pthread_mutex_destroy(&t->mu);
    free(t->specs); free(t->tmpl); free(t->ring); free(t->work); free(t);
}
