"""`gpuwatch backfill` (gpuwatch/backfill.py), the migration that filled the shipped sessions' lookahead
columns, and `gpuwatch eval`, the evaluations the model card cites: commands of the package, not scripts."""

from __future__ import annotations

import json
import re
import shutil

import polars as pl

from gpuwatch.cli import main

from conftest import ROOT, SWEEP

HELDOUT = ROOT / "recordings" / "heldout-h200-2026-12-02"
BLIND = ROOT / "recordings" / "heldout-h200-2026-12-04-blind-2902"  # the smallest held-out set
AHEAD = ["ahead_batch", "ahead_seq_len", "ahead_steps"]


def _without_the_columns(tmp_path, session):
    """A copy of a shipped session as it was before schema v4: no lookahead columns."""
    copy = tmp_path / session.name
    shutil.copytree(session, copy)
    p = copy / "steps.parquet"
    pl.read_parquet(p).drop(AHEAD).write_parquet(p, metadata=pl.read_parquet_metadata(p))
    return copy


def test_backfill_fills_a_session_as_the_shipped_one_was_filled(tmp_path, capsys):
    copy = _without_the_columns(tmp_path, SWEEP)
    before = (copy / "steps.parquet").read_bytes()
    assert main(["backfill", "--check", str(copy)]) == 0
    assert capsys.readouterr().out.strip() == (f"{copy}: 30 steps, the replayed plan equals the recorded next step "
                                               "on 29/29 (100.0%)")
    assert (copy / "steps.parquet").read_bytes() == before  # --check writes nothing
    assert main(["backfill", str(copy)]) == 0
    assert capsys.readouterr().out.strip().endswith(" - filled")
    assert pl.read_parquet(copy / "steps.parquet").equals(pl.read_parquet(SWEEP / "steps.parquet"))
    note = json.loads((copy / "meta.json").read_text())["backfilled"][-1]
    assert note["by"] == "gpuwatch backfill" and note["plan_agreement"] == 1.0 and note["columns"] == AHEAD
    assert main(["backfill", str(copy)]) == 0  # a second run: nothing to do
    assert capsys.readouterr().out.strip() == f"{copy}: skipped (has the columns)"


def test_backfill_compares_a_session_recorded_with_the_columns(capsys):
    s = ROOT / "recordings" / "h200-nearcap-2026-12-01" / "nc3-small-prefill-rampmax-b256"
    assert main(["backfill", "--compare", str(s)]) == 0
    assert capsys.readouterr().out.strip().endswith("lookahead recorded live: the replay equals it in 4506/4506 cells")


def test_backfill_refuses_a_bad_flag_combination_in_one_line(capsys):
    assert main(["backfill", "--check", "--refill", str(SWEEP)]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_eval_scores_the_model_on_held_out_sessions(tmp_path, capsys):
    s = sorted(p for p in HELDOUT.iterdir() if (p / "meta.json").exists())[0]
    out = tmp_path / "eval.json"
    assert main(["eval", str(s), "--stride", "10", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(s.name) and lines[2] == f"== {HELDOUT.name}: 1 timelines"
    assert lines[3].startswith("model ") and not any(x.startswith("== all") for x in lines)
    figs = json.loads(out.read_text())
    assert set(figs["sessions"]) == {s.name} and figs["stride"] == 10 and figs["shape_library"] is True
    assert set(figs["sets"]) == {HELDOUT.name}


def test_eval_of_a_set_prints_every_rule_and_the_model_at_each_baselines_rate(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--set", str(BLIND), "--per-session", "--stride", "10", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    n = len([p for p in BLIND.iterdir() if (p / "meta.json").exists()])
    assert f"\n== {BLIND.name}: {n} timelines\n" in text
    for rule in ("model ", "model without the lookahead ", "model without the trend ", "baseline: mem>90% ",
                 "baseline: vramtop "):
        assert any(x.startswith(rule) and " OOMs " in x for x in text.splitlines()), rule
    assert re.search(r"^   at mem>90%'s [0-9.]+ near-limit false alarms/h \(\d+/\d+\): model ", text, re.M)
    figs = json.loads(out.read_text())
    row = figs["sets"][BLIND.name]
    assert {"model", "model without the lookahead", "model without the trend", "baseline: mem>90%",
            "at the rate of baseline: mem>90%"} <= set(row)
    assert row["model"]["oom_events"] == row["baseline: mem>90%"]["oom_events"] > 0
    assert len(figs["sessions"]) == n and {"model", "threshold", "stride", "shape_library"} <= set(figs)


def test_eval_of_an_empty_set_is_a_one_line_usage_error(tmp_path, capsys):
    (tmp_path / "empty" / "nothing").mkdir(parents=True)
    assert main(["eval", "--set", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--set" in err[0] and "no sessions" in err[0]


def test_eval_of_the_first_steps(tmp_path, capsys):
    s = HELDOUT / "nc6-v3slice-prefill-b10"
    out = tmp_path / "first.json"
    assert main(["eval", "--first-step", str(s), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== training sessions, leave one session out" in text and "nc6-v3slice-prefill-b10" in text
    figs = json.loads(out.read_text())
    assert [r["session"] for r in figs["heldout"]["rows"]] == ["nc6-v3slice-prefill-b10"]
    assert figs["training"]["summary"]["first_steps"] > 0


def test_the_model_at_a_baselines_rate_is_beaten_tied_or_not():
    """`eval` printed "model 0/9 ... beaten" where the model and the baseline both caught nothing at that rate:
    a tie is said as one. Beaten: more caught, or as many (some) with a longer median lead."""
    from dataclasses import replace

    from gpuwatch.predict import evaluate as E
    from gpuwatch.predict.heldout import _verdict

    base = E.event_metrics([], [], 0.5)
    m = lambda caught, lead: replace(base, caught=caught, oom_events=9, lead_s_median=lead)  # noqa: E731
    assert _verdict(m(0, None), m(0, None)) == "tied"
    assert _verdict(m(3, 4.0), m(3, 4.0)) == "tied"
    assert _verdict(m(3, 4.5), m(3, 4.0)) == "beaten" and _verdict(m(4, 1.0), m(3, 4.0)) == "beaten"
    assert _verdict(m(3, 3.0), m(3, 4.0)) == "NOT beaten" and _verdict(m(2, 9.0), m(3, 4.0)) == "NOT beaten"
