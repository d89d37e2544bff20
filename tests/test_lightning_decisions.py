"""Lightning's `gw.step` and the guard's decisions in a real Trainer on the CPU: every batch runs under a decision
that considered a length at least its own and under the guard's ceiling, and a stop ends the fit (a helper's review
of session 49's change to where Lightning decides; each of these failed on 0f1ee96)."""
import pytest
import torch

from gpuwatch.contract import Action
from support.decisions import LengthData, spy_decisions

L = pytest.importorskip("lightning")
from support.lightning_lm import TinyLM  # noqa: E402 - after the skip: it imports lightning


def _fit(tmp_path, name, lens_of, n_items=32, accumulate=1, max_epochs=1, callbacks=(), on_start=None, on_end=None,
         trainer_kw=None):
    """A fit through gw.step; returns (trainer, gw, checks) where checks holds, for every batch, (its length, its
    rows, the length the decision it runs under considered, the micro-batch rows it ran as)."""
    from gpuwatch.control.planner import Planner
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback
    from gpuwatch.integrations.loop import GuardedLoop

    recorded: list[int] = []  # seq_len of every steps row, in order (what the planner's lens see)
    real_record = GuardedLoop.record_step

    def rec(self, b, s, *a, **k):
        recorded.append(int(s))
        return real_record(self, b, s, *a, **k)

    GuardedLoop.record_step = rec
    checks: list[tuple[int, int, int, int]] = []
    cur: dict = {}

    class LM(TinyLM):
        def loss_of(self, b):
            ids = b[0]
            if torch.is_grad_enabled() and not cur.get("seen"):
                cur["seen"] = True  # the first micro-batch of this batch: the decision it runs under is made
                p = Planner()
                p.lens.extend(recorded[-16:])
                plan = gw.loop.next_plan()
                considered = p.coming_seq(plan, 2.0) if plan is not None else -1
                checks.append((cur["len"], cur["rows"], considered, ids.shape[0]))
            return self.lm_loss(b)

        def training_step(self, b, i):
            cur.update(seen=False, len=b[0].shape[1], rows=b[0].shape[0])
            return gw.step(self, b, self.loss_of)

    class Hooks(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if on_start:
                on_start(trainer, gw)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if on_end:
                on_end(trainer, gw)

    gw = GpuwatchLightningCallback(record_dir=tmp_path, name=name, sampler="thread")
    kw = dict(accumulate_grad_batches=accumulate) if not any(
        type(c).__name__ == "GradientAccumulationScheduler" for c in callbacks) else {}
    t = L.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Hooks(), *callbacks, gw],
                  reload_dataloaders_every_n_epochs=1, default_root_dir=str(tmp_path / f"pl-{name}"),
                  **kw, **(trainer_kw or {}))
    try:
        t.fit(LM(), train_dataloaders=gw.dataloader(LengthData(n_items, lens_of), batch_size=8))
    finally:
        GuardedLoop.record_step = real_record
    return t, gw, checks


def test_a_partial_last_batch_lifts_the_ceiling_for_the_next_epochs_first_batch(tmp_path):
    """36 items in batches of 8: each epoch ends with 4 rows. The guard's ceiling of 4 (applied at step 1) makes
    the step's end after the 4-row batch set micro=None ("whole" for 4 rows); the next epoch's first batch, 8 rows
    of the same length, is not re-decided (only its length is compared) and runs whole: 8 rows over a ceiling of 4."""
    def on_end(trainer, gw):
        if trainer.global_step == 1 and gw.loop.ceiling is None:
            gw.loop.apply(Action("lower_ceiling", 4, "test"))

    t, gw, checks = _fit(tmp_path, "partial", lambda i: 12, n_items=36, max_epochs=2, on_end=on_end)
    assert gw.loop.ceiling == 4
    over = [(i, c) for i, c in enumerate(checks) if i >= 2 and c[3] > 4]
    assert not over, over  # (batch index, (len, rows, considered, micro rows))


def test_accumulation_raised_between_epochs_runs_a_longer_batch_under_an_in_hand_decision(tmp_path):
    """GradientAccumulationScheduler 1 -> 2 at epoch 1. Epoch 0 ends on a 6-token batch: its step's end decides
    in hand for 6 (the recent 24s not assumed). Epoch 1's first batch is 24 tokens, but with accumulation 2
    gw.step makes no in-step decision: it runs under the decision for 6."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    t, gw, checks = _fit(tmp_path, "sched", lambda i: 6 if i // 8 == 3 else 24, n_items=32, max_epochs=2,
                         callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])
    assert t.accumulate_grad_batches == 2
    short = [(i, c) for i, c in enumerate(checks) if c[2] < c[0]]
    assert not short, short  # (batch index, (len, rows, considered, micro rows))


def test_with_accumulation_the_longest_recent_length_excludes_all_but_each_steps_last_batch(tmp_path):
    """Accumulation 2 over batches of 24 then 6 tokens: the row and every step-end decision carry the last
    batch's length (6), so 'the longest recent length' is 6 and each step's 24-token first batch runs under a
    decision that considered 6."""
    t, gw, checks = _fit(tmp_path, "acc", lambda i: 24 if (i // 8) % 2 == 0 else 6, n_items=64, accumulate=2)
    short = [(i, c) for i, c in enumerate(checks) if c[2] < c[0]]
    assert not short, short


def test_a_stop_decided_in_the_step_runs_that_batch_one_row_at_a_time_and_ends_the_fit(tmp_path):
    """Lengths alternate 6/24; a leak stop pending when batch 3 (24 tokens, not what step 3's end assumed) comes
    is decided inside gw.step: the checkpoint is saved at step 3, but that batch still runs and the optimizer
    steps (global_step 4, 4 rows), under the micro-batch decided for 6 tokens."""
    from gpuwatch.recording.reader import open_recording

    def on_start(trainer, gw):
        if trainer.global_step == 3 and not gw.loop.should_stop and not gw.loop._pending:
            gw.loop.apply(Action("stop", None, "test: a leak"))

    t, gw, checks = _fit(tmp_path, "instep", lambda i: 6 if (i // 8) % 2 == 0 else 24, n_items=64, on_start=on_start)
    assert gw.loop.should_stop and (tmp_path / "pl-instep" / "gpuwatch-stop-step3.ckpt").is_file()
    steps = open_recording(tmp_path / "instep").steps
    # Lightning cannot skip the batch without a phantom optimizer step: it runs, one row at a time, and the fit ends
    assert (t.global_step, steps.height) == (4, 4) and checks[-1][3] == 1, (t.global_step, steps.height, checks)
    assert steps["micro_batches"].to_list()[-1] == 8


def test_a_leak_stop_ends_the_fit_even_with_min_steps(tmp_path):
    """Trainer(min_steps=...) makes Lightning ignore should_stop ('Training will continue...'): after a leak stop
    the fit runs on with the guard off (every decision returns None at once)."""
    def on_end(trainer, gw):
        if trainer.global_step == 2 and not gw.loop.should_stop and not gw.loop._pending:
            gw.loop.apply(Action("stop", None, "test: a leak"))

    t, gw, _ = _fit(tmp_path, "minsteps", lambda i: 12, n_items=64, on_end=on_end, trainer_kw={"min_steps": 8})
    assert gw.loop.should_stop
    assert t.global_step == 2, t.global_step


def test_a_second_fit_with_the_same_callback_gets_its_own_session_decided_before_its_first_step(tmp_path, monkeypatch):
    """fit() twice with one callback (a new model): `_assumed` survives on_train_start, so gw.step makes no
    decision before the second fit's first step (it runs under the first fit's last step-end decision); and
    on_train_end closed the session (sampler, scorer, recorder stopped) while on_train_start does not reopen it:
    the second fit's rows never reach the recording."""
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback
    from gpuwatch.recording.reader import open_recording

    decided = spy_decisions(monkeypatch)

    class LM(TinyLM):
        def training_step(self, b, i):
            return gw.step(self, b, self.lm_loss)

    gw = GpuwatchLightningCallback(record_dir=tmp_path, name="twice", sampler="thread")
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 12)))
    for _ in range(2):
        t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[gw],
                      reload_dataloaders_every_n_epochs=1, default_root_dir=str(tmp_path))
        t.fit(LM(), train_dataloaders=gw.dataloader(ds, batch_size=8))
    calls = [d.steps for d in decided]
    assert calls.count(4) == 2, calls  # fit 1's last step end, and fit 2 before its first step
    first = open_recording(tmp_path / "twice").steps.height
    second = open_recording(gw.loop.session_dir)  # its own session (the first fit's was closed at its end)
    assert (first, second.steps.height, gw.loop.session_dir.name) == (4, 4, "twice-2")


def test_gw_step_decides_and_splits_on_the_batch_it_is_given(tmp_path, monkeypatch):
    """A loader of raw text (a list of strings: batch_size_of raises TypeError in on_train_batch_start, swallowed),
    tokenized in training_step and passed to gw.step: the callback's `_seq`/`_batch_n` stay 1, so every decision
    is for 1 token and in_step_split sees a per-device batch of 1 - the guard's ceiling of 3 never splits the
    8 x 24 batches."""
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    decided, rows = spy_decisions(monkeypatch), []

    class LM(TinyLM):
        vocab = 128

        def lf(self, b):
            rows.append(b[0].shape[0])
            return self.lm_loss(b)

        def training_step(self, texts, i):
            ids = torch.tensor([[ord(c) % 128 for c in s] for s in texts])
            return gw.step(self, (ids,), self.lf)

    class Ceil(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and gw.loop.ceiling is None:
                gw.loop.apply(Action("lower_ceiling", 3, "test"))

    gw = GpuwatchLightningCallback(record_dir=tmp_path, name="text", sampler="thread")
    texts = [f"sample text number {i:05d}" for i in range(32)]  # 24 characters
    t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[Ceil(), gw], reload_dataloaders_every_n_epochs=1,
                  default_root_dir=str(tmp_path))
    t.fit(LM(), train_dataloaders=gw.dataloader(texts, batch_size=8))
    assert gw.loop.ceiling == 3
    seqs = [d.seq_len for d in decided]
    assert max(rows[2:]) <= 3 and min(seqs) == 24, (rows, seqs)


@pytest.mark.parametrize("split", [False, True])
def test_a_skipped_batch_leaves_no_gradient_behind(tmp_path, split):
    """training_step returning None skips a batch's backward (Lightning's documented skip, e.g. a non-finite
    loss). With gw.step splitting, that batch's micro-batch gradients were set aside in `_held` for an
    on_before_backward that never comes; the next batch's backward (accumulation 2: the step's second batch)
    puts them back - the skipped batch enters the update. The parameters should equal an unsplit run's."""
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    def run(name, use_split):
        class LM(TinyLM):
            lr = 0.5

            def training_step(self, b, i):
                loss = gw.step(self, b, self.lm_loss) if use_split else self.lm_loss(b)
                return None if i == 2 else loss  # e.g. `if not torch.isfinite(loss): return None`

        class Ceil(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if gw.loop.ceiling is None:
                    gw.loop.apply(Action("lower_ceiling", 3, "test"))

        gw = GpuwatchLightningCallback(record_dir=tmp_path, name=name, sampler="thread")
        ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1)))
        t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Ceil(), gw],
                      reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=2, default_root_dir=str(tmp_path))
        m = LM()
        t.fit(m, train_dataloaders=gw.dataloader(ds, batch_size=8))
        return m

    plain, guarded = run("plain", False), run("guarded", split)
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_without_gw_step_the_plan_is_the_loaders_batch_under_accumulation(tmp_path, monkeypatch):
    """A LightningModule that does not call gw.step, accumulation 2 over the loader's batches of 4: every step runs
    4 x 2, and every plan the guard decided on says so (it said 8 x 1: a shape that never ran, scored and weighed
    at every step - s50's observe arm)."""
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback
    from support.decisions import LengthData, spy_decisions

    calls = spy_decisions(monkeypatch)

    class LM(TinyLM):
        def training_step(self, b, i):
            return self.lm_loss(b)

    gw = GpuwatchLightningCallback(record_dir=tmp_path, name="acc", sampler="thread")
    t = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[gw], reload_dataloaders_every_n_epochs=1,
                  accumulate_grad_batches=2, default_root_dir=str(tmp_path / "pl"))
    t.fit(LM(), train_dataloaders=gw.dataloader(LengthData(32, lambda i: 12), batch_size=4))
    assert len(calls) >= 8 and all(c.batch == 8 for c in calls)  # the effective batch
    assert {(c.plan.batch, c.plan.micro_batches) for c in calls if c.plan is not None} == {(4, 2)}


def test_gw_step_with_the_users_own_loader_under_accumulation(tmp_path, monkeypatch):
    """gw.step over the user's own DataLoader (not gw.dataloader), accumulation 2 over batches of 4: every plan says
    4 x 2 (review of 5c2159a: the per-device batch was unknown there, so the plans said 8 x 1)."""
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback
    from support.decisions import LengthData, spy_decisions
    calls = spy_decisions(monkeypatch)
    gw = GpuwatchLightningCallback(record_dir=tmp_path, name="acc", sampler="thread")

    class LM(TinyLM):
        def training_step(self, b, i):
            return gw.step(self, b, self.lm_loss)

    t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[gw], accumulate_grad_batches=2, default_root_dir=str(tmp_path / "pl"))
    loader = torch.utils.data.DataLoader(LengthData(32, lambda i: 12), batch_size=4)  # not gw.dataloader
    t.fit(LM(), train_dataloaders=loader)
    got = {(c.batch, c.plan.batch, c.plan.micro_batches) for c in calls if c.plan is not None}
    assert got == {(8, 4, 2)}, got
