"""The lookahead (predict/ahead.py): what the schedule knows of the steps to come, recorded on each step
row live, filled the same way into sessions recorded before it, and read by the risk."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from gpuwatch import backfill as bf
from gpuwatch.cli.parser import parse_recorded
from gpuwatch.predict import ahead as A
from gpuwatch.predict.composite import RiskComposite
from gpuwatch.predict.features import NAMES
from gpuwatch.recording.reader import open_recording
from gpuwatch.workload.schedule import Schedule

from conftest import ROOT

NEARCAP = ROOT / "recordings" / "h200-nearcap-2026-12-01"


def test_the_schedule_walks_ahead_on_a_copy():
    s = Schedule("ramp", 16, 32)  # starts at 4, six steps a level, x1.25 a level
    assert s.ahead(8) == [(4, 32)] * 6 + [(5, 32)] * 2
    assert s.ahead(8) == s.ahead(8) and s.step == 0 and s.batch == 4  # left as it was
    s.set_ceiling(4)
    assert s.ahead(8) == [(4, 32)] * 8  # the ceiling stops the climb
    sw = Schedule("sweep", 8, 16, max_batch=4)  # levels 1, 2, 4: the sweep ends after 18 steps
    assert len(sw.ahead(64)) == 18 and sw.ahead(64)[-1] == (4, 16)
    assert Schedule("steady", 3, 7).ahead(3) == [(3, 7)] * 3


def test_how_far_ahead_follows_the_pace():
    assert A.steps_within([]) == 1 and A.steps_within([5.0]) == 1
    assert A.steps_within([0.0, 0.5, 1.0, 1.5]) == 8  # 4 s at 0.5 s a step
    assert A.steps_within([0.0, 0.5, 1.0, 30.0]) == 8  # the median, not one stall
    assert A.steps_within([0.0, 0.001, 0.002]) == A.MAX_STEPS
    assert A.steps_within([0.0, 20.0, 40.0]) == 1  # a 20 s decode step: the next one only
    assert A.pick([(4, 32), (5, 32), (5, 32), (2, 64)]) == {"ahead_batch": 5, "ahead_seq_len": 32, "ahead_steps": 2}
    assert A.pick([]) == {"ahead_batch": None, "ahead_seq_len": None, "ahead_steps": None}


def test_the_lookahead_ends_where_the_run_does():
    """A timed run (--duration) or one of --steps N: no step planned past its end is looked at - a ramp's
    next level, 2 s after a deadline 1 s away, is not the run's to take (5 of the 7 false alarms of the
    held-out H200 sessions were such warnings in a timed run's last 6 s)."""
    s = Schedule("ramp", 16, 32)  # levels of six steps: 4 x 6, then 5 ...
    ends = [0.0, 0.5, 1.0, 1.5]  # a step every 0.5 s: 8 steps in the 4 s lookahead
    assert A.columns(s, ends) == {"ahead_batch": 5, "ahead_seq_len": 32, "ahead_steps": 7}
    assert A.columns(s, ends, left_s=1.0) == {"ahead_batch": 4, "ahead_seq_len": 32, "ahead_steps": 1}
    assert A.columns(s, ends, left_s=3.4)["ahead_batch"] == 5  # 7 steps start before the end
    assert A.columns(s, ends, left_s=0.2)["ahead_steps"] == 1  # a step may still start before it
    assert A.columns(s, ends, left_s=-2.0) == A.pick([])  # past it, none does
    assert A.columns(s, ends, left_steps=6)["ahead_batch"] == 4
    assert A.columns(s, ends, left_steps=0) == A.pick([])


def test_a_timed_stress_run_tells_its_workload_where_it_ends(tmp_path, py, env, monkeypatch):
    """`stress --duration`: the run records its deadline (a `deadline` event) and its workload's lookahead
    stops there: the backfill's replay of the run through its command's schedule, ended at that deadline,
    equals every lookahead cell the run wrote - and the same replay without the deadline does not (the
    ramp's next levels past the end)."""
    import re
    import subprocess

    out = tmp_path / "run"
    r = subprocess.run([py, "-m", "gpuwatch", "stress", "--preset", "tiny", "--device", "cpu", "--mode", "prefill",
                        "--schedule", "ramp", "--batch", "64", "--seq-len", "16", "--duration", "6s", "--progress", "0",
                        "--guard", "off", "-o", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    folder = out if (out / "meta.json").exists() else next(p for p in out.iterdir() if (p / "meta.json").exists())
    assert open_recording(folder).events.filter(pl.col("kind") == "deadline").height == 1

    def cells(line: str) -> tuple[int, int]:
        m = re.search(r"equals it in (\d+)/(\d+) cells", line)
        assert m, line
        return int(m.group(1)), int(m.group(2))
    same, n = cells(bf.run(folder, True, True, parse=parse_recorded))
    assert n > 30 and same == n
    monkeypatch.setattr(bf, "run_end", lambda *a: (None, []))  # the replay as before the rule: past the end
    uncut, _ = cells(bf.run(folder, True, True, parse=parse_recorded))
    assert uncut < n


@pytest.mark.parametrize("name", ["nc3-small-prefill-rampmax-b256", "nc-small-train-rampmax-b16"])
def test_recorded_lookahead_holds_the_next_step_and_stops_at_the_max(name):
    """On real sessions (filled by `gpuwatch backfill` (gpuwatch/backfill.py), whose replayed plans equalled every
    recorded next step): the largest step ahead is never smaller than the next one, and a ramp capped by
    --max-batch never looks beyond its max."""
    st = open_recording(NEARCAP / name).steps
    ends = st["next_batch"].is_null()  # the timed run's last step (past its deadline): nothing planned
    assert ends.sum() == 1 and bool(ends[-1]) and st["ahead_batch"].is_null().to_list() == ends.to_list()
    st = st.filter(~ends)
    nxt = st["next_batch"].cast(pl.Float64) * st["next_seq_len"]
    ahd = st["ahead_batch"].cast(pl.Float64) * st["ahead_seq_len"]
    assert (ahd >= nxt).all() and (st["ahead_steps"] >= 1).all()
    top = {"nc3-small-prefill-rampmax-b256": 256, "nc-small-train-rampmax-b16": 16}[name]
    assert st["ahead_batch"].max() <= top
    assert (ahd > nxt).any() or name == "nc-small-train-rampmax-b16"  # the ramp saw its next level coming


def test_live_rows_equal_what_the_backfill_replays():
    """The stress workload's own step rows (ahead_* computed live after each step) and the backfill's
    replay of the same run through its command's schedule and its history agree row for row - so sessions
    filled afterwards read as if recorded with the columns."""
    pytest.importorskip("torch")
    from gpuwatch.recording.writer import to_frame
    from gpuwatch.recording import schema
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="prefill", schedule="ramp", batch=8, seq_len=8, integrity_every=0,
                                     max_steps=20, overrides={"num_hidden_layers": 1}))
    w.start()
    w.join(timeout=120)
    rows = bus.steps.since(0)[0]
    assert len(rows) == 20 and all(r["ahead_batch"] for r in rows[:-1])
    assert rows[-1]["ahead_batch"] is None and rows[-2]["ahead_steps"] == 1  # --steps 20: nothing past the end
    live = to_frame(rows, "steps")
    replayed, figs = bf.backfill(live.drop("ahead_batch", "ahead_seq_len", "ahead_steps"), schema.empty("events"),
                                 Schedule("ramp", 8, 8), None, max_steps=20)
    assert figs["agree"] == figs["compared"] == 19  # the 20th step, the run's last, plans no next one
    for c in bf.COLS + bf.NEXT:
        assert replayed[c].to_list() == live[c].to_list(), c
    assert live["next_batch"][-1] is None and live["next_batch"][-2] is not None  # the 20th step plans none
    assert live["ahead_batch"].max() > live["next_batch"].min()  # it saw the ramp's next levels


def test_the_estimator_part_takes_the_lookahead_where_higher():
    c = RiskComposite(None, 0.8, float("inf"))
    x = np.full((3, len(NAMES)), np.nan)
    i, j = NAMES.index("peak_cross_p"), NAMES.index("ahead_cross_p")
    x[0, i], x[0, j] = 0.1, 0.9  # the ramp's next level will not fit
    x[1, i], x[1, j] = 0.7, 0.2  # (cannot happen: ahead >= next) the next step's
    x[2, i] = 0.3  # no lookahead recorded: the next step's
    assert c.p_estimator(x).tolist() == [0.9, 0.7, 0.3]
    r = c.predict_proba(x)[:, 1]
    assert math.isclose(r[0], min(1.0, 0.9 * 0.5 / 0.8)) and math.isclose(r[2], 0.3 * 0.5 / 0.8)


def test_the_guard_acts_on_the_next_steps_risk_not_the_lookahead():
    """An alarm raised by a step several levels ahead warns; the guard does not cut the batch that fits -
    the step is refused when it becomes the next one (its re-scoring between steps)."""
    from gpuwatch.control.guard import Guard
    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.predict.model import load_model
    from gpuwatch.predict.scorer import RISK_NEXT, Scorer
    from gpuwatch.telemetry.bus import Bus

    sc = Scorer(load_model(ROOT / "models" / "risk.joblib"))
    x = [float("nan")] * len(NAMES)
    x[NAMES.index("peak_cross_p")], x[NAMES.index("ahead_cross_p")] = 0.0, 0.99
    r = sc.score_vector(x)
    assert r >= sc.model.threshold and sc.risk_next(x, r) < sc.model.threshold
    y = list(x)
    y[NAMES.index("ahead_cross_p")] = float("nan")
    assert sc.risk_next(y, 0.42) == 0.42  # no lookahead: the risk is the next step's

    class W:
        gpu_index = None

        def next_plan(self):
            from gpuwatch.contract import StepPlan
            return StepPlan(batch=8, seq_len=16, precision="bf16", mode="prefill")

        def guard_view(self):
            from gpuwatch.contract import WorkloadView
            return WorkloadView(gpu=None, ceiling=None, last_ok_batch=8, lower_precisions=(), manual=False)

        def accepts(self):
            return frozenset({"lower_ceiling", "refuse_step"})

        def apply(self, action, who="guard"):
            raise AssertionError(f"acted: {action}")

        def request_snapshot(self, directory, reason):
            pass

    bus, w = Bus(), W()
    g = Guard(bus, GuardConfig(cooldown_s=0.0), {None: w}, threshold=0.5)
    g.on_risk(None, r, [], {RISK_NEXT: sc.risk_next(x, r), "peak_cross_p": 0.0}, {"batch": 8, "seq_len": 16}, True)
    assert g.before_step(w).kind == "none"


def test_an_alarm_about_a_later_step_says_which():
    from gpuwatch.predict.scorer import _ahead_text

    plan = {"batch": 8, "seq_len": 512, "ahead_batch": 12, "ahead_seq_len": 512, "ahead_steps": 7}
    assert _ahead_text(plan, 0.1, 0.5) == " (batch 12 x 512 planned in 7 steps)"
    assert _ahead_text(plan, 0.6, 0.5) == ""  # the next step itself is at risk
    assert _ahead_text({"batch": 8, "seq_len": 512}, 0.1, 0.5) == ""  # no lookahead known


def test_a_ramp_whose_start_does_not_fit_starts_lower_and_an_oom_loop_stops():
    """Call 29: a decode ramp under a 3 GiB cap failed at its start batch and restarted there 995 times."""
    s = Schedule("ramp", 256, 8)  # starts at 64
    assert "restarting lower, at 32" in s.oom(64) and s.plan()[0] == 32
    assert "restarting lower, at 16" in s.oom(32)
    s.done()
    st = s.state()
    r = Schedule("ramp", 256, 8)
    r.restore(st)
    assert r.ahead(3) == s.ahead(3) and r.state() == st  # the lowered start survives a resume
    pytest.importorskip("torch")
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.config import Faults
    from gpuwatch.workload.runner import OOM_LOOP, Workload, WorkloadConfig

    bus = Bus()  # every step over 1 token fails: nothing can ever run
    w = Workload(bus, WorkloadConfig(mode="prefill", schedule="steady", batch=1, seq_len=8, integrity_every=0,
                                     max_steps=5, faults=Faults(oom_above_tokens=1), overrides={"num_hidden_layers": 1}))
    w.start()
    w.join(timeout=60)
    w.stop()
    assert w.ooms == OOM_LOOP and w.unrecovered and "in a row" in w.unrecovered


def test_the_library_loop_looks_ahead_at_the_batches_its_loader_will_give():
    """`GuardedLoop.wrap` draws the next few seconds of batches early: the plan and each step row carry
    the largest of them (a batch on the GPU already is never drawn early)."""
    torch = pytest.importorskip("torch")
    from gpuwatch.integrations.loop import GuardedLoop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))

    def loss(mb):
        return torch.nn.functional.cross_entropy(model(mb).flatten(0, 1), mb.flatten())

    sizes = [2, 2, 2, 3, 3, 4, 4, 8, 2, 2]  # a loader whose batches grow, then one large one
    batches = [torch.randint(0, 32, (b, 6)) for b in sizes]
    g = GuardedLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), record_dir=None, use_model=False,
                    guard="off", sampler="thread")
    plans, rows = [], []
    with g:
        for batch in g.wrap(batches):
            g.step(batch, loss)
            plans.append(g.next_plan())
            rows.append(g.last_step)
    assert g.steps == len(sizes)
    # until two steps have ended the pace is unknown: one batch ahead; then a CPU's steps take well under
    # 4 s / 16, the loop draws MAX_AHEAD batches ahead, and the batch of 8 is in sight until it has run
    assert [r["ahead_batch"] for r in rows[:2]] == [2, 2]
    assert [r["ahead_batch"] for r in rows[2:7]] == [8] * 5 and rows[7]["ahead_batch"] == 2
    assert [r["next_batch"] for r in rows[:-1]] == sizes[1:]  # the next batch, known, not assumed the same
    assert rows[-1]["ahead_batch"] is None  # the loader has ended: nothing ahead
    assert all(r["ahead_steps"] == sizes[i + 1:].index(8) + 1 for i, r in enumerate(rows[:7]) if r["ahead_batch"] == 8)
    assert plans[3].ahead_batch == 8 and plans[3].scored()["ahead_batch"] == 8
    g2 = GuardedLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), record_dir=None, use_model=False,
                     guard="off", sampler="thread")
    with g2:
        for batch in g2.wrap(batches, lookahead=False):
            g2.step(batch, loss)
            assert g2.last_step["ahead_batch"] is None and g2.next_plan().ahead_batch is None


def test_after_an_oom_the_replay_scores_the_recovered_plan_not_the_stale_one():
    """Held-out H200 session: the v2-lite ramp failed at batch 72 and restarted at 16. Between the OOM and
    the next step row, the last row still says "next: 72"; scoring that raised a false alarm after every
    OOM in a replay (live, the workload's own plan is scored). Now: the oom_recovered event's plan where
    it recorded one, else no forecast at all."""
    from gpuwatch.predict.features import _plan_after_oom, features
    from gpuwatch.recording.source import ReplaySource

    src = ReplaySource(ROOT / "recordings" / "heldout-h200-2026-12-01" / "nc4-v2lite-prefill-ramp-cap36")
    g = src.gpus[0].index
    ev = src.events_df.filter(pl.col("kind") == "oom")
    t_oom = int(ev["ts"][0].timestamp() * 1e6)
    after = features(src.window_at(g, t_oom + 300_000))  # 0.3 s after the OOM, before the next step
    before = features(src.window_at(g, t_oom - 300_000))
    assert before["next_peak_est_frac"] > 0.9 and not math.isnan(before["peak_cross_p"])
    assert math.isnan(after["peak_cross_p"]) and math.isnan(after["next_peak_est_frac"])
    w = src.window_at(g, t_oom + 300_000)
    last_us = float(w.steps["ts"][-1].timestamp() * 1e6)
    assert _plan_after_oom(w.events, last_us) == {"batch": None, "seq_len": None}
    assert _plan_after_oom(w.events, float(t_oom + 1)) is None  # no OOM after the last row: the row's plan
    detail = '{"decision": "ramp: restarting at 16", "next_batch": 16, "next_seq_len": 512, "next_precision": "bf16"}'
    ev2 = pl.concat([w.events.filter(pl.col("kind") != "oom_recovered"), pl.DataFrame({"ts": [w.events["ts"].max()], "kind": ["oom_recovered"],
                                              "detail": [detail]}).cast({"ts": w.events["ts"].dtype})],
                    how="diagonal_relaxed")
    assert _plan_after_oom(ev2, last_us) == {"batch": 16, "seq_len": 512, "precision": "bf16"}
    bad = ev2.with_columns(pl.col("detail").str.replace('"next_batch": 16', '"next_batch": "sixteen"'))
    assert _plan_after_oom(bad, last_us) == {"batch": None, "seq_len": None}  # a corrupt detail: no plan, no error


def test_above_the_alarm_the_risk_ranks_by_how_far_over_the_limit_and_raises_no_new_alarm():
    """p ~1 is the ceiling of a probability: a step estimated 0.3 % over the usable limit and one 20 % over
    scored the same 0.5 / t_e, so no threshold above the alarm told them apart. The excess orders them;
    which rows alarm (risk >= 0.5) is what it was."""
    from gpuwatch.predict.composite import ALARM

    c = RiskComposite(None, 0.6, float("inf"))
    x = np.full((6, len(NAMES)), np.nan)
    p, a = NAMES.index("peak_cross_p"), NAMES.index("ahead_cross_p")
    nf, af = NAMES.index("next_peak_est_frac"), NAMES.index("ahead_peak_est_frac")
    x[0, p], x[0, nf] = 1.0, 1.003  # just over: the cap's fragmentation margin may still hold it
    x[1, p], x[1, nf] = 1.0, 1.20  # far over
    x[2, p], x[2, a], x[2, nf], x[2, af] = 0.1, 1.0, 0.9, 1.10  # the lookahead's step is over, the next is not
    x[3, p], x[3, nf] = 0.55, 1.05  # over by the estimate but under the alarm (a wide spread): unchanged
    x[4, p], x[4, nf] = 1.0, 0.98  # at p ~1 by another rule (a failed shape) with the estimate under: the ceiling
    x[5, p] = 0.3  # nothing estimated
    r = c.predict_proba(x)[:, 1]
    without = c.combine(c.p_estimator(x), np.zeros(6))[:, 1]
    assert ((r >= ALARM) == (without >= ALARM)).all()
    assert r[3] == without[3] and r[5] == without[5] and r[4] == without[4] == 0.5 / 0.6
    assert without[0] == without[1] and r[1] > r[0] > without[0]  # the tie is broken the right way round
    assert r[1] > r[2] > r[0] and r.max() <= 1.0
    assert c.over(x)[2] == pytest.approx(0.10)


def test_the_lookahead_feature_estimates_its_step_at_least_as_high_as_the_next():
    """On a real recorded ramp (a schedule that plans ahead): where the lookahead is recorded its estimate is
    there, never under the next step's, and above it somewhere (a larger level ahead)."""
    from gpuwatch.predict.dataset import session_timelines

    tl = session_timelines(ROOT / "recordings" / "sample-h200-guard-ramp-train", stride=5)[0]
    nf, af = tl.X[:, NAMES.index("next_peak_est_frac")], tl.X[:, NAMES.index("ahead_peak_est_frac")]
    ap = tl.X[:, NAMES.index("ahead_cross_p")]
    assert np.array_equal(np.isfinite(af), np.isfinite(ap))
    both = np.isfinite(af) & np.isfinite(nf)
    assert both.sum() > 20 and (af[both] >= nf[both] - 1e-12).all() and (af[both] > nf[both] + 0.01).any()


def test_on_a_recorded_blind_set_the_ranking_above_the_alarm_keeps_catches_where_the_quietest_baseline_is():
    """Blind set 2906 (H200, shipped): vramtop's rule raises no near-limit false alarm there and catches 11 of
    102 OOMs. Every alarm of the risk at p ~1 used to score the same, so at that rate it caught none; ranked
    by the estimate's excess over the usable limit it keeps most (75 when measured, session 43)."""
    import functools

    from gpuwatch.predict import evaluate as E
    from gpuwatch.predict.dataset import load_sessions, sessions_under
    from gpuwatch.predict.features import features
    from gpuwatch.predict.model import load_model

    model = load_model(ROOT / "models" / "risk.joblib")
    tls, _ = load_sessions(sessions_under(ROOT / "recordings" / "heldout-h200-2026-12-06-blind-2906"), stride=5,
                           feature_fn=functools.partial(features, prior=model.prior))
    c = model.estimator
    ranked = [c.predict_proba(t.X)[:, 1] for t in tls]
    flat = [c.combine(c.p_estimator(t.X), c.classifier.predict_proba(t.X)[:, 1])[:, 1] for t in tls]
    vt = E.baseline_metrics(tls)["vramtop"]
    assert vt.near_false_alarms == 0 and vt.caught == 11
    at_ranked, at_flat = (E.recall_at_fa(tls, s, 0.0, near=True) for s in (ranked, flat))
    assert at_flat is None or at_flat.caught == 0
    assert at_ranked is not None and at_ranked.caught >= 60 and at_ranked.near_false_alarms == 0
    # at the alarm itself nothing changed
    a, b = (E.event_metrics(tls, s, model.threshold) for s in (ranked, flat))
    assert (a.caught, a.false_alarms, a.near_false_alarms) == (b.caught, b.false_alarms, b.near_false_alarms)


def test_the_next_steps_risk_leaves_out_the_lookaheads_excess_too():
    """Both probabilities at ~1: the lookahead's step 20 % over the limit ranks the risk above the next step's
    own (0.3 % over); the risk the guard acts on is the next step's, not raised by a step further ahead
    (what a --risk-threshold above the ceiling of 0.83 would otherwise cut)."""
    from gpuwatch.predict.model import load_model
    from gpuwatch.predict.scorer import Scorer

    sc = Scorer(load_model(ROOT / "models" / "risk.joblib"))
    x = [float("nan")] * len(NAMES)
    for n, v in (("peak_cross_p", 1.0), ("ahead_cross_p", 1.0), ("next_peak_est_frac", 1.003),
                 ("ahead_peak_est_frac", 1.2)):
        x[NAMES.index(n)] = v
    r = sc.score_vector(x)
    y = list(x)
    y[NAMES.index("ahead_cross_p")] = y[NAMES.index("ahead_peak_est_frac")] = float("nan")
    alone = sc.score_vector(y)
    assert r > alone >= sc.model.threshold and sc.risk_next(x, r) == pytest.approx(alone)
    z = list(x)
    z[NAMES.index("ahead_peak_est_frac")] = 1.003  # the lookahead adds nothing: no second prediction needed
    assert sc.risk_next(z, 0.9) == 0.9
