"""Sampler timing with an injected clock, and the replay-as-live backend on a real recording."""

from __future__ import annotations

import pytest

from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.telemetry.bus import Bus, Channel
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP


class FakeTime:
    """A clock that only moves when the sampler waits (plus a cost per tick)."""

    def __init__(self, tick_cost=0.0, stop_after=20):
        self.t = 1000.0
        self.tick_cost = tick_cost
        self.waits = []
        self.stop_after = stop_after
        self.slow_ticks = set()

    def clock(self):
        return self.t

    def wait(self, seconds):
        self.waits.append(seconds)
        self.t += seconds
        return len(self.waits) >= self.stop_after


class SlowHost:
    def __init__(self, ft, costs):
        self.ft, self.costs, self.n = ft, costs, 0

    def read_fast(self):
        self.ft.t += self.costs.get(self.n, 0.0)
        self.n += 1
        return {"host_cpu_pct": 1.0}

    def read_slow(self):
        return {}


def test_deadline_schedule_does_not_drift():
    ft = FakeTime()
    host = SlowHost(ft, {i: 0.013 for i in range(100)})  # every tick costs 13 ms
    bus = Bus()
    s = Sampler(bus, None, host, interval=0.1, clock=ft.clock, wait=ft.wait)
    s.run()
    ticks = bus.ticks.latest(100)
    assert len(ticks) == 20
    # each wait is interval minus the tick's cost, so ticks start exactly 100 ms apart
    assert all(w == pytest.approx(0.087) for w in ft.waits)
    intervals = [r.rows[0]["sampler_interval_us"] for r in ticks[1:]]
    assert intervals == [100_000] * 19
    assert all(r.rows[0]["sampler_cost_us"] == 13_000 for r in ticks)


def test_a_stall_skips_missed_deadlines_instead_of_bursting():
    ft = FakeTime(stop_after=10)
    host = SlowHost(ft, {3: 0.35})  # tick 3 stalls 350 ms (a long C call holding the GIL)
    bus = Bus()
    s = Sampler(bus, None, host, interval=0.1, clock=ft.clock, wait=ft.wait)
    s.run()
    assert s.late_ticks == 1
    assert min(ft.waits) >= 0.0
    intervals = [t.rows[0]["sampler_interval_us"] for t in bus.ticks.latest(20)[1:]]
    assert intervals[3] == 350_000  # the stall is visible in the data (tick 4 started 350 ms after 3)...
    assert intervals[:3] + intervals[4:] == [100_000] * 8  # ...then the 100 ms rhythm resumes, no burst


def test_channel_reports_what_a_slow_reader_missed():
    ch: Channel[int] = Channel(5)
    for i in range(12):
        ch.append(i)
    items, nxt, lost = ch.since(0)
    assert items == [7, 8, 9, 10, 11] and nxt == 12 and lost == 7
    assert ch.since(nxt) == ([], 12, 0)


def test_replay_backend_feeds_real_rows_and_is_labelled():
    b = ReplayGpuBackend(RAMP)
    assert "REPLAY" in b.label and b.gpus[0].name.endswith("[replay]")
    bus = Bus()
    s = Sampler(bus, b, None)
    s.slow_tick()
    rows = [s.tick().rows[0] for _ in range(50)]
    assert all(r["gpu"] == 0 for r in rows)
    assert max(r["gpu_mem_used_bytes"] for r in rows) > 10 * 2**30  # real H200 data, a 29 GiB model loaded
    assert rows[0]["gpu_mem_total_bytes"] == 150754820096
    assert rows[0]["gpu_energy_mj"] is not None


def test_pipe_hands_ticks_over_in_batches_and_events_at_once_in_order():
    """The process sampler's hand-over: `deliver_n` ticks per message; an event flushes what is held
    first, so the parent sees everything in the order it happened."""
    import multiprocessing as mp
    import threading

    from gpuwatch.telemetry.bus import Event, Tick
    from gpuwatch.telemetry.sampler_process import _PipeChannel

    r, w = mp.Pipe(duplex=False)
    stop = threading.Event()
    ch = _PipeChannel(w, stop, deliver_n=10)
    for i in range(23):
        ch.append(Tick(i, i * 100_000, [{"gpu": 0}]))
    ch.append(Event("xid", "XID 79 on GPU 0", "error", 0))
    ch.append(Tick(23, 2_300_000, [{"gpu": 0}]))
    ch.flush()
    got = []
    while r.poll(0.1):
        got.append(r.recv())
    assert [len(m) if isinstance(m, list) else m.kind for m in got] == [10, 10, 3, "xid", 1]
    assert [t.tick for m in got if isinstance(m, list) for t in m] == list(range(24))
    assert not stop.is_set()
    r.close()  # the parent is gone: the next hand-over breaks the pipe and stops the sampler
    ch.append(Event("xid", "after the parent went", "error", 0))
    assert stop.is_set()


def test_slow_reads_share_the_tick_thread_once_a_second_when_they_do_not_block():
    """No GPU (or NVML with PCIe counters): the 1 Hz reads run on the tick thread after every tenth tick,
    and the next tick carries them; no second thread."""
    ft = FakeTime(stop_after=25)

    class CountingHost(SlowHost):
        slow = 0

        def read_slow(self):
            self.slow += 1
            return {"host_load1": float(self.slow)}

    host = CountingHost(ft, {})
    bus = Bus()
    s = Sampler(bus, None, host, interval=0.1, slow_interval=1.0, clock=ft.clock, wait=ft.wait)
    assert s.slow_inline()
    s.run(slow_inline=True)
    assert host.slow == 2  # after ticks 10 and 20
    ticks = bus.ticks.latest(25)
    assert [t.rows[0].get("host_load1") for t in ticks] == [None] * 10 + [1.0] * 10 + [2.0] * 5
    assert all(w == pytest.approx(0.1) for w in ft.waits)  # the schedule is unchanged


def test_a_backend_whose_slow_read_blocks_keeps_its_own_thread():
    class Blocking:
        gpus = []
        slow_blocks = True

    class Unsaid:
        gpus = []

    assert not Sampler(Bus(), Blocking(), None).slow_inline()
    assert not Sampler(Bus(), Unsaid(), None).slow_inline()
