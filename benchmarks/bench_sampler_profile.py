"""`benchmarks/bench_sampler.py profile` and `compare`: where a sampler tick's CPU goes inside a running
`gpuwatch record --no-model` (the child instrumented through GPUWATCH_SAMPLER_PROFILE, whose profiler is
tests/support/sampler_profile.py), and two source trees' `record` side by side. Run through
bench_sampler.py (its header lists the flags); the per-thread and CPU-frequency readings are here too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench_sampler import ROOT, cpu_seconds, gpus_flag, interval_stats
from support.fake_nvml import fake_nvml_env

__all__ = ["compare", "print_profile", "profile"]


def _thread_snap(root_pid: int) -> dict[str, dict]:
    """Per OS thread of a process tree: name, CPU seconds, context switches, the CPU it last ran on."""
    out: dict[str, dict] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for q in procs:
        who = "parent" if q.pid == root_pid else "child"
        try:
            tids = [t.id for t in q.threads()]
        except psutil.NoSuchProcess:
            continue
        for tid in tids:
            base = f"/proc/{q.pid}/task/{tid}"
            try:
                name = Path(f"{base}/comm").read_text().strip()
                st = Path(f"{base}/stat").read_text()
                f = st[st.rindex(")") + 2:].split()
                status = Path(f"{base}/status").read_text()
            except (OSError, ValueError):
                continue
            tck = os.sysconf("SC_CLK_TCK")
            sw = {k: int(v) for k, v in (ln.split(":\t") for ln in status.splitlines()
                                         if ln.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))}
            try:  # schedstat: ns on CPU (exact, unlike the tick-sampled utime/stime), ns waiting, timeslices
                ss = [int(x) for x in Path(f"{base}/schedstat").read_text().split()]
            except (OSError, ValueError):
                ss = None
            out[f"{who}:{name}:{tid}"] = {
                "pid": q.pid, "cpu_s": (int(f[11]) + int(f[12])) / tck, "on_cpu_ns": ss[0] if ss else None,
                "vol": sw.get("voluntary_ctxt_switches", 0), "invol": sw.get("nonvoluntary_ctxt_switches", 0),
                "last_cpu": int(f[36])}
    return out


def _cpu_hints(cpus: set[int] | None = None) -> dict:
    """CPU frequency and idle-state hints (cheap files only): MHz per CPU (of `cpus` and the mean of all),
    the governor, the idle driver and each idle state's cumulative usage/time (summed over CPUs)."""
    out: dict = {}
    try:
        mhz = [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines()
               if ln.startswith("cpu MHz")]
        if mhz:
            out["mhz_mean"] = round(sum(mhz) / len(mhz), 1)
            out["mhz_min"], out["mhz_max"] = round(min(mhz), 1), round(max(mhz), 1)
            if cpus:
                out["mhz_of"] = {c: mhz[c] for c in sorted(cpus) if c < len(mhz)}
    except (OSError, ValueError, IndexError):
        pass
    sysc = Path("/sys/devices/system/cpu")
    for key, f in (("governor", "cpu0/cpufreq/scaling_governor"), ("driver", "cpu0/cpufreq/scaling_driver"),
                   ("idle_driver", "cpuidle/current_driver"), ("max_freq_khz", "cpu0/cpufreq/cpuinfo_max_freq")):
        try:
            out[key] = (sysc / f).read_text().strip()
        except OSError:
            pass
    try:
        out["intel_idle_max_cstate"] = Path("/sys/module/intel_idle/parameters/max_cstate").read_text().strip()
    except OSError:
        pass
    states: dict[str, dict] = {}
    for cpu_dir in sysc.glob("cpu[0-9]*/cpuidle"):
        for sd in cpu_dir.glob("state*"):
            try:
                name = (sd / "name").read_text().strip()
                d = states.setdefault(name, {"usage": 0, "time_us": 0,
                                             "latency_us": int((sd / "latency").read_text())})
                d["usage"] += int((sd / "usage").read_text())
                d["time_us"] += int((sd / "time").read_text())
            except (OSError, ValueError):
                pass
    if states:
        out["idle_states"] = states
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _launch(cmd: list[str], env: dict) -> tuple[subprocess.Popen, int | None]:
    """`gpuwatch record` started, and the pid of its sampler child once it is there (None: it never came)."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    child = None
    t_wait = time.monotonic() + 12
    while child is None and time.monotonic() < t_wait and p.poll() is None:
        time.sleep(0.1)
        try:
            kids = psutil.Process(p.pid).children()
            child = kids[0].pid if kids else None
        except psutil.NoSuchProcess:
            break
    return p, child


def _window(p: subprocess.Popen, seconds: float) -> dict:
    """The measured window: thread snapshots and the tree's CPU at its start and end (and the middle's
    CPUs for the frequency hints), its monotonic bounds in ns and its length."""
    a = _thread_snap(p.pid)
    tree0 = cpu_seconds(psutil.Process(p.pid))
    hints0 = _cpu_hints()
    m0, t0 = time.monotonic_ns(), time.monotonic()
    time.sleep(seconds / 2)
    mid = _thread_snap(p.pid)
    ran_on = {v["last_cpu"] for k, v in mid.items() if k.startswith("child:")}
    hints_mid = _cpu_hints(ran_on)
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    b = _thread_snap(p.pid)
    try:
        tree1 = cpu_seconds(psutil.Process(p.pid))
    except psutil.NoSuchProcess:
        tree1 = float("nan")
    m1, dt = time.monotonic_ns(), time.monotonic() - t0
    hints1 = _cpu_hints({v["last_cpu"] for k, v in b.items() if k.startswith("child:")})
    return {"a": a, "b": b, "tree0": tree0, "tree1": tree1, "m0": m0, "m1": m1, "dt": dt,
            "hints": {"start": hints0, "mid": hints_mid, "end": hints1}}


def _per_thread(a: dict, b: dict, dt: float) -> dict[str, dict]:
    """Per thread: CPU % of one core (schedstat on-CPU ns where present) and wake-ups per second."""
    per: dict[str, dict] = {}
    for k, v in b.items():
        who, name, _ = k.split(":", 2)
        a0 = a.get(k)
        if a0 is None:
            continue
        cpu_ns = (v["on_cpu_ns"] - a0["on_cpu_ns"]) if v["on_cpu_ns"] is not None and a0["on_cpu_ns"] is not None \
            else 1e9 * (v["cpu_s"] - a0["cpu_s"])
        d = per.setdefault(f"{who}:{name}", {"cpu_pct": 0.0, "wakeups_per_s": 0.0, "involuntary_per_s": 0.0, "n": 0})
        d["cpu_pct"] += 100 * cpu_ns / 1e9 / dt
        d["wakeups_per_s"] += (v["vol"] - a0["vol"]) / dt
        d["involuntary_per_s"] += (v["invol"] - a0["invol"]) / dt
        d["n"] += 1
    return {k: {kk: round(vv, 3) if isinstance(vv, float) else vv for kk, vv in d.items()}
            for k, d in sorted(per.items(), key=lambda kv: -kv[1]["cpu_pct"])}


def _stats(xs_ns: list[int], per_n: int) -> dict:
    us = [x / 1000 for x in xs_ns]
    return {"n": len(us), "p50": round(_pct(us, 0.5), 1), "p99": round(_pct(us, 0.99), 1),
            "mean": round(sum(us) / max(1, len(us)), 1), "per_tick": round(sum(us) / max(1, per_n), 2)}


def _section_times(its: list) -> dict[str, dict[str, list]]:
    """Per section path of the iterations: the CPU and wall of every occurrence, each node's own time
    (itself minus its children), and the loop's time outside the tick, slow read and sleep."""
    paths: dict[str, dict[str, list]] = {}
    for _, ic, iw, secs in its:
        kids: dict[str, list[int]] = {}
        for path, (c, w) in secs.items():
            e = paths.setdefault(path, {"cpu": [], "wall": []})
            e["cpu"].append(c)
            e["wall"].append(w)
            parent = path.rpartition("/")[0]
            if parent:
                k = kids.setdefault(parent, [0, 0])
                k[0] += c
                k[1] += w
        for parent, (c, w) in kids.items():  # each node's own time: itself minus its children
            if parent in secs:
                e = paths.setdefault(parent + "/(self)", {"cpu": [], "wall": []})
                e["cpu"].append(secs[parent][0] - c)
                e["wall"].append(secs[parent][1] - w)
        top = sum(secs[p][0] for p in ("tick", "wake", "slow") if p in secs)
        e = paths.setdefault("(loop, outside tick, slow read and sleep)", {"cpu": [], "wall": []})
        e["cpu"].append(ic - top)
        e["wall"].append(iw - sum(secs[p][1] for p in ("tick", "wake", "slow") if p in secs))
        e = paths.setdefault("(iteration: tick + loop + slow + sleep + wake)", {"cpu": [], "wall": []})
        e["cpu"].append(ic)
        e["wall"].append(iw)
    return paths


def _child_profile(res: dict, raw: dict, m0: int, m1: int, dt: float) -> None:
    """The child's profile over the window into `res`: per section the per-occurrence stats, the CPU per
    tick (sum / ticks) and % of one core; the slow thread's sections; the hand-over batches."""
    res["child_meta"] = raw["meta"]
    res["calibration"] = raw["calibration"]
    its = [it for it in raw["iterations"] if m0 <= it[0] <= m1]
    n = len(its)
    res["ticks"] = n
    paths = _section_times(its)
    sections = {}
    for path in sorted(paths, key=lambda p: (p.startswith("("), p.replace("/(self)", "/~"))):
        e = paths[path]
        sections[path] = {"cpu_us": _stats(e["cpu"], n), "wall_us": _stats(e["wall"], n),
                          "pct_of_core": round(100 * sum(e["cpu"]) / 1e9 / dt, 4)}
    res["sections"] = sections
    slow = [s for s in raw["slow"] if m0 <= s[0] <= m1]
    sp: dict[str, list] = {}
    for _, secs in slow:
        for path, (c, w) in secs.items():
            sp.setdefault(path, []).append((c, w))
    res["slow_sections"] = {path: {"n": len(v), "cpu_us": _stats([c for c, _ in v], len(v)),
                                   "wall_us": _stats([w for _, w in v], len(v)),
                                   "pct_of_core": round(100 * sum(c for c, _ in v) / 1e9 / dt, 4)}
                            for path, v in sorted(sp.items())}
    res["other_sections"] = raw["other"]
    bb = raw["batch_bytes"]
    res["batch_bytes_mean"] = round(sum(bb) / len(bb)) if bb else None


def profile(seconds: float, out_json: Path | None, fake_nvml: int = 0, warmup: float = 3.0,
            max_gpus: int | None = None) -> dict:
    """`gpuwatch record --no-model` as it runs (sampler child with deliver_s=1.0, recorder in the parent),
    with the child's tick instrumented (GPUWATCH_SAMPLER_PROFILE; off in normal runs): per section of a
    tick CPU (thread_time) and wall, p50/p99/mean; per thread CPU and wake-ups of both processes; the
    tree's total; CPU frequency / idle-state hints."""
    from gpuwatch.telemetry.ticker import PROFILE_ENV as ENV

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-profile-"))
    prof_path = work / "child_profile.json"
    env = dict(os.environ, **{ENV: str(prof_path)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])  # the profiler
    fake_how = fake_nvml_env(env, work, fake_nvml) if fake_nvml else None
    dur = warmup + seconds + 1.5
    cmd = [sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", f"{dur}s", "-o", str(work / "rec"),
           *(gpus_flag(max_gpus) if max_gpus else [])]
    p, child = _launch(cmd, env)
    if child is None:
        p.kill()
        err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
        return {"measure": "sampler_profile", "error": "the sampler child did not start", "stderr": err}
    time.sleep(warmup)
    win = _window(p, seconds)
    dt, hints0, hints1 = win["dt"], win["hints"]["start"], win["hints"]["end"]
    try:
        p.wait(timeout=max(5.0, t_start + seconds + 14 - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
    err = p.stderr.read().decode(errors="replace")[-2000:] if p.stderr else ""
    per = _per_thread(win["a"], win["b"], dt)
    res: dict = {"measure": "sampler_profile", "command": " ".join(cmd[2:]), "seconds": round(dt, 2),
                 "fake_nvml_gpus": fake_nvml or None, "fake_nvml": fake_how,
                 "tree_cpu_pct_of_one_core": round(100 * (win["tree1"] - win["tree0"]) / dt, 3),
                 "threads_cpu_sum_pct": round(sum(d["cpu_pct"] for d in per.values()), 3),
                 "threads": per, "cpu_hints": win["hints"]}
    if hints0.get("idle_states") and hints1.get("idle_states"):
        res["idle_state_entries_per_s_all_cpus"] = {
            n: round((hints1["idle_states"][n]["usage"] - s0["usage"]) / dt, 1)
            for n, s0 in hints0["idle_states"].items() if n in hints1["idle_states"]}
    try:
        raw = json.loads(prof_path.read_text())
    except (OSError, ValueError) as e:
        res["error"] = f"no profile from the child ({e!r}); stderr: {err}"
        shutil.rmtree(work, ignore_errors=True)
        return res
    _child_profile(res, raw, win["m0"], win["m1"], dt)
    try:
        from gpuwatch.recording.reader import open_recording

        sess = [q for q in (work / "rec").iterdir() if (q / "meta.json").exists()]
        res["recorded_interval_ms"] = interval_stats(open_recording(sess[0]).samples) if sess else None
    except Exception as e:  # noqa: BLE001
        res["recorded_interval_ms"] = repr(e)[:200]
    if err.strip():
        res["record_stderr_tail"] = err[-600:]
    res["elapsed_s"] = round(time.monotonic() - t_start, 1)
    shutil.rmtree(work, ignore_errors=True)
    return res


def compare(trees: list[Path], seconds: float, runs: int, fake_nvml: int = 0, warmup: float = 5.0,
            max_gpus: int | None = None) -> dict:
    """Side by side: `gpuwatch record --no-model` of each source tree (e.g. the commit before a change and
    after), all running at the same time, `runs` times; CPU of each process tree (user+system, and the
    exact on-CPU time of its threads from schedstat) in % of one core, plus per thread for each run."""
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-compare-"))
    env = dict(os.environ)
    how = fake_nvml_env(env, work, fake_nvml) if fake_nvml else None
    only = gpus_flag(max_gpus) if max_gpus else []  # a tree from before the flag refuses it: compare without
    out: dict = {"measure": "cpu_pct_of_one_core_side_by_side", "trees": [str(t) for t in trees], "seconds": seconds,
                 "fake_nvml": how, "max_gpus": max_gpus, "runs": []}
    for r in range(runs):
        procs = []
        for k, tree in enumerate(trees):
            e = dict(env, PYTHONPATH=str(tree))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", f"{warmup + seconds + 2}s",
                 "-o", str(work / f"r{r}-t{k}"), *only], cwd=tree, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(warmup)
        a = [_thread_snap(p.pid) for p in procs]
        c0 = [cpu_seconds(psutil.Process(p.pid)) for p in procs]
        t0 = time.monotonic()
        time.sleep(seconds)
        b = [_thread_snap(p.pid) for p in procs]
        c1 = [cpu_seconds(psutil.Process(p.pid)) for p in procs]
        dt = time.monotonic() - t0
        row = []
        for k, p in enumerate(procs):
            per: dict[str, float] = {}
            for key, v in b[k].items():
                if key in a[k] and v["on_cpu_ns"] is not None:
                    name = key.rsplit(":", 1)[0]
                    per[name] = per.get(name, 0.0) + 100 * (v["on_cpu_ns"] - a[k][key]["on_cpu_ns"]) / 1e9 / dt
            row.append({"tree_pct": round(100 * (c1[k] - c0[k]) / dt, 3), "threads_pct": round(sum(per.values()), 3),
                        "threads": {n: round(x, 3) for n, x in sorted(per.items(), key=lambda kv: -kv[1]) if x > 0.0005}})
        for k, p in enumerate(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            err = p.stderr.read().decode(errors="replace") if p.stderr else ""
            if p.returncode:
                row[k]["error"] = f"exit {p.returncode}: {err[-500:]}"
            try:  # the tick's own CPU as the sampler recorded it (sampler_cpu_us: not instrumented)
                from gpuwatch.recording.reader import open_recording

                sess = [q for q in (work / f"r{r}-t{k}").iterdir() if (q / "meta.json").exists()]
                row[k]["recorded"] = interval_stats(open_recording(sess[0]).samples)
            except Exception as e:  # noqa: BLE001
                row[k]["recorded"] = repr(e)[:200]
        out["runs"].append(row)
        print(f"run {r + 1}: " + "  ".join(
            f"{trees[k].name or trees[k]}: tree {x['tree_pct']} % threads {x['threads_pct']} % tick CPU p50 "
            f"{x['recorded'].get('tick_cpu_us_p50') if isinstance(x.get('recorded'), dict) else '?'} us"
            for k, x in enumerate(row)), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return out


def print_profile(res: dict) -> None:
    """The profile as a readable table (the JSON has everything)."""
    if "sections" not in res:
        print(json.dumps(res, indent=1))
        return
    print(f"gpuwatch record --no-model, {res['seconds']} s, {res['ticks']} ticks; process tree "
          f"{res['tree_cpu_pct_of_one_core']} % of one core (threads sum {res['threads_cpu_sum_pct']} %)"
          + (f"; FAKE NVML x{res['fake_nvml_gpus']}" if res.get("fake_nvml_gpus") else ""))
    cal = res.get("calibration", {})
    print(f"timer cost per section: {cal.get('timer_cpu_ns_per_section', 0) / 1000:.2f} us CPU warm, "
          f"{cal.get('timer_cpu_ns_per_section_cold', 0) / 1000:.1f} us cold (included below); "
          f"batch of {cal.get('batch_ticks')} ticks: {res.get('batch_bytes_mean')} B, pickle "
          f"{cal.get('pickle_batch_cpu_us', 0):.0f} us, unpickle {cal.get('unpickle_batch_cpu_us', 0):.0f} us CPU")
    print(f"\n{'section (tick thread, per loop iteration)':58} {'n':>5} {'cpu p50':>8} {'p99':>8} {'mean':>8} "
          f"{'/tick':>7} {'wall p50':>9} {'p99':>8} {'% core':>7}")
    for path, s in res["sections"].items():
        depth = path.count("/")
        label = "  " * depth + path.rsplit("/", 1)[-1]
        c, w = s["cpu_us"], s["wall_us"]
        print(f"{label[:58]:58} {c['n']:5d} {c['p50']:8.1f} {c['p99']:8.1f} {c['mean']:8.1f} {c['per_tick']:7.1f} "
              f"{w['p50']:9.1f} {w['p99']:8.1f} {s['pct_of_core']:7.3f}")
    if res.get("slow_sections"):
        print(f"\n{'slow thread (1 Hz)':58} {'n':>5} {'cpu p50':>8} {'p99':>8} {'mean':>8} {'':>7} {'wall p50':>9} "
              f"{'p99':>8} {'% core':>7}")
        for path, s in res["slow_sections"].items():
            c, w = s["cpu_us"], s["wall_us"]
            print(f"{('  ' * path.count('/') + path.rsplit('/', 1)[-1])[:58]:58} {c['n']:5d} {c['p50']:8.1f} "
                  f"{c['p99']:8.1f} {c['mean']:8.1f} {'':7} {w['p50']:9.1f} {w['p99']:8.1f} {s['pct_of_core']:7.3f}")
    print(f"\n{'thread':40} {'% core':>8} {'wakeups/s':>10} {'preempt/s':>10}")
    for k, d in res["threads"].items():
        print(f"{k[:40]:40} {d['cpu_pct']:8.3f} {d['wakeups_per_s']:10.1f} {d['involuntary_per_s']:10.1f}")
    h = res["cpu_hints"].get("mid", {})
    print(f"\nCPU: {h.get('driver', '?')}/{h.get('governor', '?')}, MHz mean {h.get('mhz_mean')} "
          f"(min {h.get('mhz_min')}, max {h.get('mhz_max')}), sampler CPUs {h.get('mhz_of')}; idle driver "
          f"{h.get('idle_driver', '?')}, max_cstate {h.get('intel_idle_max_cstate', '?')}; idle entries/s (all CPUs) "
          f"{res.get('idle_state_entries_per_s_all_cpus')}")
    print(f"recorded intervals: {res.get('recorded_interval_ms')}")
    meta = res.get("child_meta", {})
    print(f"host_cpu_pct source: {meta.get('host_cpu_source')}; PCIe counters every {meta.get('pcie_every')} slow read(s)")
    if res.get("error"):
        print("ERROR:", res["error"])
