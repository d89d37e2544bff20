"""The Hugging Face and Lightning callbacks, each run in a real Trainer for a few steps on the CPU with a
tiny model. Neither framework changes its data loader's batch mid-run, so the guard's smaller
micro-batch is either run inside the framework's step (split in place: no restart) or becomes a resumed
run with the per-device batch down and the accumulation up: either way the effective batch holds, and so
does the update (compared with an unguarded run)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.contract import Action  # noqa: E402
from gpuwatch.integrations.batches import per_device_batch  # noqa: E402
from support.decisions import LengthData, spy_decisions  # noqa: E402


def test_per_device_batch_keeps_the_effective_batch_exact():
    assert per_device_batch(8, 3) == 2 and per_device_batch(12, 5) == 4 and per_device_batch(7, 6) == 1
    assert per_device_batch(8, 100) == 8 and per_device_batch(8, 0) == 1


# -- Hugging Face ---------------------------------------------------------------------------------------
def _hf_run(tmp_path, name, actions: dict[int, Action] | None, split: bool = True, items: bool = True,
            pad: bool = False, trainer_cls=None):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gpuwatch.integrations.hf import GpuwatchCallback, train

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (96, 16), generator=gen)]
    if pad:  # rows of 4 to 16 label tokens (the rest -100): a mean over tokens weighs rows unequally
        data = [{"input_ids": d["input_ids"], "labels": torch.where(torch.arange(16) < 4 + i % 13, d["labels"], -100)}
                for i, d in enumerate(data)]
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{name}"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=1, max_steps=8, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", train_sampling_strategy="sequential", report_to=[],
                             save_strategy="no", logging_steps=1, use_cpu=True, include_num_input_tokens_seen=True,
                             seed=0, disable_tqdm=True)
    gw = GpuwatchCallback(record_dir=tmp_path, name=name, sampler="thread", split=split)
    seen: list[int] = []  # rows of every micro-batch the model saw

    class Inject(TrainerCallback):  # stands in for the guard's decisions at chosen steps (CPU: no risk)
        def on_step_end(self, args, state, control, **kw):
            if actions and state.global_step in actions:
                gw.loop.apply(actions[state.global_step])

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append(-1)  # an optimizer step ends here

    model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["input_ids"].shape[0])), with_kwargs=True)
    trainer = (trainer_cls or Trainer)(model=model, args=args, train_dataset=data, callbacks=[Inject(), Count(), gw])
    if not items:  # the Trainer divides a micro-batch's mean loss itself (no item count reaches the model)
        trainer.model_accepts_loss_kwargs = False
    train(trainer)
    per_step, cur = [], 0
    for x in seen:
        if x == -1:
            per_step.append(cur)
            cur = 0
        else:
            cur += x
    return trainer, gw, per_step


@pytest.mark.parametrize("items", [True, False], ids=["loss-by-items", "mean-loss"])
def test_hf_trainer_splits_its_step_with_no_restart_and_keeps_the_update(tmp_path, items):
    """One process: the guard's micro-batch of 3 runs inside the Trainer's step (8 rows as 3 + 3 + 2) from the
    next step, and the batch is given back the same way: no restart, the same parameters as unguarded -
    whether the Trainer normalises the loss by the batch's tokens or divides a mean loss itself."""
    from gpuwatch.recording.reader import open_recording

    plain, _, steps0 = _hf_run(tmp_path, "plain", None, items=items)
    guarded, gw, steps1 = _hf_run(tmp_path, "guarded", {2: Action("lower_ceiling", 3, "test"),
                                                         5: Action("clear_ceiling", None, "test")}, items=items)
    assert gw.splitting and gw.restarts == 0 and guarded.state.global_step == plain.state.global_step == 8
    assert steps0 == [8] * 8 and steps1 == [8] * 8, (steps0, steps1)  # rows per optimizer step held
    assert gw.effective == [8] * 8
    for a, b in zip(plain.model.parameters(), guarded.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert guarded.state.log_history[3]["loss"] == pytest.approx(plain.state.log_history[3]["loss"], rel=1e-4)
    rec = open_recording(tmp_path / "guarded")
    assert rec.steps.height == 8 and set(rec.steps["batch"].to_list()) == {8}
    assert rec.steps["micro_batches"].to_list() == [1, 1, 3, 3, 3, 1, 1, 1]
    ev = rec.events.filter(rec.events["kind"] == "control")["message"].to_list()
    assert any("3 micro-batches of at most 3 in the step" in m and "no restart" in m for m in ev), ev


def test_hf_split_weighs_padded_rows_by_their_label_tokens(tmp_path):
    """Where the Trainer divides a micro-batch's mean loss itself, a micro-batch counts by its share of the
    batch's label tokens, not of its rows: with padding the update still equals an unguarded run's."""
    plain, _, _ = _hf_run(tmp_path, "plain", None, items=False, pad=True)
    guarded, gw, _ = _hf_run(tmp_path, "guarded", {1: Action("lower_ceiling", 3, "test")}, items=False, pad=True)
    assert gw.splitting and gw.restarts == 0
    for a, b in zip(plain.model.parameters(), guarded.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_hf_trainer_with_its_own_loss_is_not_split_and_restarts_instead(tmp_path):
    """A Trainer subclass's compute_loss may ignore the item count the split relies on (the documented
    custom-loss pattern returns a mean): its step is not split; the guard restarts it, and says why. (Such a
    loss is not divided by the accumulation under the Trainer's own rule either, so any accumulation - the
    restart's included - changes its update: transformers' semantics, not the guard's.)"""
    from transformers import Trainer

    from gpuwatch.recording.reader import open_recording

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            return (out.loss, out) if return_outputs else out.loss

    guarded, gw, steps = _hf_run(tmp_path, "guarded", {2: Action("lower_ceiling", 3, "test")}, trainer_cls=OwnLoss)
    assert not gw.splitting and gw.restarts == 1 and "overrides compute_loss" in gw.split_refused
    assert steps == [8] * 8  # (the update is the Trainer's own under accumulation: a mean loss it does not divide)
    ev = open_recording(tmp_path / "guarded").events
    assert any("cannot be split in place (OwnLoss overrides compute_loss)" in m
               for m in ev.filter(ev["kind"] == "guard_unable")["message"].to_list())


def test_hf_trainer_split_off_restarts_with_a_smaller_per_device_batch(tmp_path):
    from gpuwatch.recording.reader import open_recording

    plain, _, steps0 = _hf_run(tmp_path, "plain", None)
    guarded, gw, steps1 = _hf_run(tmp_path, "guarded", {2: Action("lower_ceiling", 3, "test"),
                                                         5: Action("clear_ceiling", None, "test")}, split=False)
    assert gw.restarts == 2 and guarded.state.global_step == plain.state.global_step == 8
    assert steps0 == [8] * 8 and steps1 == [8] * 8, (steps0, steps1)  # samples per optimizer step held
    assert gw.effective == [8] * 8
    for a, b in zip(plain.model.parameters(), guarded.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    rec = open_recording(tmp_path / "guarded")
    assert rec.steps.height == 8 and set(rec.steps["batch"].to_list()) == {8}
    assert rec.steps["micro_batches"].to_list() == [1, 1, 4, 4, 4, 1, 1, 1]
    assert set(rec.steps["seq_len"].to_list()) == {16}
    kinds = rec.events["kind"].to_list()
    assert kinds.count("guard_unable") == 1 and "session_end" in kinds  # CPU: said once, recording closed


def test_hf_trainer_stops_cleanly_with_a_checkpoint_when_the_guard_stops(tmp_path):
    trainer, gw, steps = _hf_run(tmp_path, "leak", {3: Action("stop", None, "test: a leak")})
    assert trainer.state.global_step == 3 and gw.loop.should_stop
    assert (tmp_path / "out-leak" / "checkpoint-3").is_dir()


# -- Lightning --------------------------------------------------------------------------------------------
def _lightning_run(tmp_path, name, actions, split=False, step_actions=None, accumulate=1, validate=False):
    L = pytest.importorskip("lightning")
    from support.lightning_lm import TinyLM
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    rows: list[int] = []  # rows of every forward
    losses: list[tuple[int, float]] = []  # (rows, loss) of every forward, read after it (test only)

    class LM(TinyLM):
        lr = 0.5

        def loss_of(self, batch):
            rows.append(batch[0].shape[0])
            loss = self.lm_loss(batch)
            if torch.is_grad_enabled():
                losses.append((batch[0].shape[0], float(loss.detach())))
            return loss

        def training_step(self, batch, i):
            return gw.step(self, batch, self.loss_of) if split else self.loss_of(batch)

        def validation_step(self, batch, i):  # a common pattern: the same step, under no_grad / inference mode
            return self.training_step(batch, i)

    gen = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (64, 12), generator=gen))
    gw = GpuwatchLightningCallback(record_dir=tmp_path, name=name, sampler="thread")
    seen = []

    class Inject(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0].shape[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if step_actions and trainer.global_step in step_actions:
                gw.loop.apply(step_actions.pop(trainer.global_step))

        def on_train_epoch_end(self, trainer, pl_module):
            if actions and trainer.current_epoch in actions:
                gw.loop.apply(actions[trainer.current_epoch])

    model = LM()
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, default_root_dir=str(tmp_path / f"pl-{name}"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Inject(), gw],
                        reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=accumulate)
    val = torch.utils.data.DataLoader(ds, batch_size=8) if validate else None
    trainer.fit(model, train_dataloaders=gw.dataloader(ds, batch_size=8), val_dataloaders=val)
    model.rows = [r for r in rows if r]
    model.losses = losses
    return model, gw, seen, trainer


def test_lightning_keeps_the_effective_batch_and_the_update_through_the_guard(tmp_path):
    from gpuwatch.recording.reader import open_recording

    plain, _, seen0, _ = _lightning_run(tmp_path, "plain", None)
    guarded, gw, seen1, t = _lightning_run(tmp_path, "guarded", {0: Action("lower_ceiling", 3, "test"),
                                                                  1: Action("clear_ceiling", None, "test")})
    assert seen0 == [8] * 32
    assert seen1 == [8] * 8 + [2] * 32 + [8] * 16, seen1  # epoch 2 ran at 2 x 4 accumulation
    assert t.global_step == 32 and gw.effective == [8] * 32
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    rec = open_recording(tmp_path / "guarded")
    assert set(rec.steps["batch"].to_list()) == {8} and rec.steps["micro_batches"].max() == 4


def test_lightning_stops_cleanly_with_a_checkpoint_when_the_guard_stops(tmp_path):
    model, gw, seen, t = _lightning_run(tmp_path, "leak", {1: Action("stop", None, "test: a leak")})
    assert t.global_step == 16 and gw.loop.should_stop and len(seen) == 16
    assert (tmp_path / "pl-leak" / "gpuwatch-stop-step16.ckpt").is_file()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_step_splits_mid_epoch_with_the_same_update(tmp_path, accumulate):
    """`gw.step` in training_step: the guard's micro-batch of 3 applies from the next batch, mid-epoch (8 rows
    as 3 + 3 + 2), and is given back the same way; the loader's batch never changes and the parameters end
    as an unguarded run's - with Lightning's own accumulation on top too."""
    from gpuwatch.recording.reader import open_recording

    plain, _, _, _ = _lightning_run(tmp_path, "plain", None, split=True, accumulate=accumulate)
    n = 32 // accumulate  # optimizer steps
    guarded, gw, seen, t = _lightning_run(tmp_path, "guarded", None, split=True, accumulate=accumulate,
                                          step_actions={n // 8: Action("lower_ceiling", 3, "test"),
                                                        5 * n // 8: Action("clear_ceiling", None, "test")})
    assert plain.rows == [8] * 32 and seen == [8] * 32  # the loader's batch held
    whole, split = [8] * (n // 8 * accumulate), [3, 3, 2] * (n // 2 * accumulate)
    assert guarded.rows == whole + split + [8] * (32 - len(whole) - len(split) // 3), guarded.rows
    assert t.global_step == n and gw.effective == [8 * accumulate] * n and gw.splitting
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    rec = open_recording(tmp_path / "guarded")
    k = rec.steps["micro_batches"].to_list()
    assert k == [accumulate] * (n // 8) + [3 * accumulate] * (n // 2) + [accumulate] * (n - n // 8 - n // 2), k
    ev = rec.events.filter(rec.events["kind"] == "control")["message"].to_list()
    assert any("3 micro-batches of at most 3 in the step" in m for m in ev), ev


@pytest.mark.parametrize("split", [False, True])
def test_lightning_records_each_steps_mean_loss_over_its_accumulation_and_micro_batches(tmp_path, split):
    """The steps row's loss is the optimizer step's mean over everything it ran: Lightning's accumulation of 2
    batches and, with `gw.step`, the guard's micro-batches (8 rows as 3 + 3 + 2, weighted by their rows) - read
    from the losses Lightning backpropagates (`StepLoss`), not the last batch's loss divided by the accumulation
    as the step's output says (what the row held before)."""
    from gpuwatch.recording.reader import open_recording

    model, gw, _, t = _lightning_run(tmp_path, "acc", None, split=split, accumulate=2,
                                     step_actions={3: Action("lower_ceiling", 3, "test")} if split else None)
    per_step, cur, rows = [], 0.0, 0
    for n, loss in model.losses:  # 16 rows a step: 2 batches of 8
        cur, rows = cur + loss * n, rows + n
        if rows == 16:
            per_step.append(cur / 16)
            cur, rows = 0.0, 0
    got = open_recording(tmp_path / "acc").steps["loss"].to_list()
    assert t.global_step == 16 and len(got) == 16 == len(per_step)
    assert got == pytest.approx(per_step, rel=1e-5), (got, per_step)
    if split:
        assert any(n == 3 for n, _ in model.losses)  # the split ran


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_step_decides_at_each_steps_end_and_before_the_first_step(tmp_path, monkeypatch, accumulate):
    """With `gw.step` the guard decides before the first step runs and at every step's end (where a leak stop
    still ends the fit before another batch). Without accumulation it assumes the next batch as long as the last
    (in hand: not the longest recent length); with accumulation the step's other batches are unknown, so the
    longest recent length is assumed as before."""
    calls = spy_decisions(monkeypatch)
    _, gw, _, t = _lightning_run(tmp_path, "decide", None, split=True, accumulate=accumulate)
    n = 32 // accumulate
    got = [c[:3] for c in calls]
    assert t.global_step == n and got == [(8 * accumulate, 12, accumulate == 1)] * (n + 1), got


def _varying_run(tmp_path, name, lens_of, accumulate=1, body=None, stop_at=None, n_items=64, precision="32-true",
                 plugins=None, max_epochs=1):
    """A Lightning fit whose item i has length `lens_of(i)` (batches of 8, sequential); returns (trainer, gw,
    the lengths each optimizer step ran, every forward's (rows, loss))."""
    L = pytest.importorskip("lightning")
    from support.lightning_lm import TinyLM
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    losses: list[tuple[int, float]] = []

    class LM(TinyLM):
        def loss_of(self, b):
            loss = self.lm_loss(b)
            if torch.is_grad_enabled():
                losses.append((b[0].shape[0], float(loss.detach())))
            return loss

        def training_step(self, b, i):
            return body(self, gw, b) if body else gw.step(self, b, self.loss_of)

    ran: list[list[int]] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % accumulate == 0:
                ran.append([])
            ran[-1].append(batch[0].shape[1])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if stop_at is not None and trainer.global_step == stop_at and not gw.loop.should_stop:
                gw.loop.apply(Action("stop", None, "test: a leak"))

    gw = GpuwatchLightningCallback(record_dir=tmp_path, name=name, sampler="thread")
    t = L.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch(), gw],
                  reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=accumulate, precision=precision,
                  default_root_dir=str(tmp_path / f"pl-{name}"), **({"plugins": plugins} if plugins else {}))
    t.fit(LM(), train_dataloaders=gw.dataloader(LengthData(n_items, lens_of), batch_size=8))
    return t, gw, ran, losses


def test_lightning_step_decides_again_on_a_batch_whose_length_the_steps_end_did_not_assume(tmp_path, monkeypatch):
    """Batches alternating 6 and 24 tokens: each step's end assumed the last length, so `gw.step` decides again
    with the batch in hand (its length) before running it."""
    calls = spy_decisions(monkeypatch)
    t, _, ran, _ = _varying_run(tmp_path, "alt", lambda i: 6 if (i // 8) % 2 == 0 else 24)
    assert t.global_step == 8 and ran == [[6], [24]] * 4
    # per step: gw.step's own decision on its batch (the first step's, and each one whose length changed), then
    # the step's end assuming the same length again
    got = [c[:3] for c in calls]
    assert got == [(8, n, True) for n in [6, 6, 24, 24] * 4], got


def test_with_accumulation_every_decision_assumes_the_longest_recent_length(tmp_path, monkeypatch):
    """Review of 650cf89: with accumulation 2 a decision on the step's first batch (6 tokens) in hand would not
    cover its second (24): no decision with `gw.step` under accumulation is in hand."""
    from gpuwatch.control.planner import Planner

    calls = spy_decisions(monkeypatch)
    t, _, ran, _ = _varying_run(tmp_path, "acc", lambda i: 6 if (i // 8) % 2 == 0 else 24, accumulate=2)
    assert t.global_step == 4 and ran == [[6, 24]] * 4 and not any(c.in_hand for c in calls)
    p = Planner()
    p.lens.extend([24, 24, 24])
    assert p.coming_seq(calls[-1].plan, 2) >= 24


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_step_leak_stop_ends_cleanly_without_a_phantom_step(tmp_path, accumulate):
    """Review of 650cf89: a stop decided inside `gw.step` returned None, and Lightning still stepped the optimizer
    for that batch (a fifth row, the session "finished"). The stop is decided at the step's end, before the next
    batch: four steps, four rows, "stopped"."""
    from gpuwatch.recording.reader import open_recording

    model, gw, seen, t = _lightning_run(tmp_path, "leak", None, split=True, accumulate=accumulate,
                                        step_actions={4: Action("stop", None, "test: a leak")})
    rec = open_recording(tmp_path / "leak")
    stop = rec.events.filter(rec.events["kind"] == "workload_stop")["message"].to_list()
    assert gw.loop.should_stop and (tmp_path / "pl-leak" / "gpuwatch-stop-step4.ckpt").is_file()
    assert (rec.steps.height, t.global_step) == (4, 4), rec.steps["loss"].to_list()
    assert "stopped after 4 steps" in stop[0], stop


@pytest.mark.parametrize("form", ["dict", "logged"])
def test_a_leak_stop_ends_the_fit_cleanly_whatever_training_step_does_with_the_loss(tmp_path, form):
    """Review of 650cf89: `gw.step` returning None on a stop broke `{"loss": gw.step(...)}` and `self.log(...,
    gw.step(...))`; it never returns None now."""
    def body(m, gw, b):
        loss = gw.step(m, b, m.loss_of)
        if form == "logged":
            m.log("train_loss", loss)
            return loss
        return {"loss": loss}

    from gpuwatch.recording.reader import open_recording

    t, gw, _, _ = _varying_run(tmp_path, form, lambda i: 12, body=body, stop_at=3)
    rec = open_recording(tmp_path / form)  # closed at the fit's end: the session says it stopped
    stop = rec.events.filter(rec.events["kind"] == "workload_stop")["message"].to_list()
    assert gw.loop.should_stop and t.global_step == 3 and "stopped after 3 steps" in stop[0], stop


def test_the_rows_loss_of_a_final_partial_accumulation_is_its_mean(tmp_path):
    """Review: 40 items in batches of 8 at accumulation 2 - the epoch's last step runs one batch, whose loss
    Lightning still divides by 2."""
    from gpuwatch.recording.reader import open_recording

    t, _, _, losses = _varying_run(tmp_path, "partial", lambda i: 12, accumulate=2, n_items=40,
                                   body=lambda m, gw, b: m.loss_of(b))
    got = open_recording(tmp_path / "partial").steps["loss"].to_list()
    want = [(losses[0][1] + losses[1][1]) / 2, (losses[2][1] + losses[3][1]) / 2, losses[4][1]]
    assert t.global_step == 3 and got == pytest.approx(want, rel=1e-5), (got, want)


def test_fp16_mixed_with_a_scaler_records_the_steps_mean_loss(tmp_path):
    """Review: under 16-mixed the backward's loss is scaled; the row reads each batch's output instead (a
    GradScaler on the CPU through Lightning's own plugin)."""
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision
    from gpuwatch.recording.reader import open_recording

    plug = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    t, _, _, losses = _varying_run(tmp_path, "fp16", lambda i: 12, accumulate=2, n_items=32, plugins=plug,
                                   body=lambda m, gw, b: m.loss_of(b), precision=None)
    got = open_recording(tmp_path / "fp16").steps["loss"].to_list()
    want = [(a[1] + b[1]) / 2 for a, b in zip(losses[::2], losses[1::2])]
    assert t.global_step == 2 and got == pytest.approx(want, rel=1e-3), (got, want)


def test_the_step_loss_sums_what_was_added_and_resets_on_the_cpu():
    from gpuwatch.integrations.lightning import StepLoss

    s = StepLoss()
    assert s.take() is None
    s.add(torch.tensor(1.25, requires_grad=True) * 2)
    s.add(torch.tensor([0.5]))
    s.add(torch.ones(3))  # not a scalar loss: ignored
    s.add(None)
    assert s.take() == pytest.approx(3.0) and s.take() is None


def test_lightning_step_in_validation_runs_whole_and_the_update_holds(tmp_path):
    """validation_step calling training_step (through gw.step) runs the batch whole under no_grad: no backward
    there, no gradients set aside, and the training update still equals an unguarded run's."""
    plain, _, _, _ = _lightning_run(tmp_path, "plain", None, split=True, validate=True)
    guarded, gw, _, t = _lightning_run(tmp_path, "guarded", None, split=True, validate=True,
                                       step_actions={4: Action("lower_ceiling", 3, "test")})
    assert t.global_step == 32 and gw.splitting and not gw._held
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.gpu
def test_lightning_reads_the_steps_loss_on_a_gpu_without_a_host_sync(tmp_path):
    """On CUDA the callback's step end makes no synchronizing call (torch's sync debug mode raises on one, as
    `float(loss)` did there), and the row's loss is still the step's mean (bf16-mixed, accumulation 2)."""
    L = pytest.importorskip("lightning")
    from support.lightning_lm import TinyLM
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback, StepLoss
    from gpuwatch.recording.reader import open_recording

    s = StepLoss()
    x = torch.tensor(2.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.add(x * 1.5)
        s.add(x)
        got = s.take()
        with pytest.raises(RuntimeError):
            float(x)  # what the mode catches
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == pytest.approx(5.0)

    losses: list[float] = []

    class Strict(GpuwatchLightningCallback):
        def on_train_batch_end(self, *a, **kw):
            torch.cuda.set_sync_debug_mode("error")
            try:
                super().on_train_batch_end(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    class LM(TinyLM):
        width = 32

        def training_step(self, batch, i):
            loss = self.lm_loss(batch)
            losses.append(float(loss.detach()))  # the test's own read, outside the callback
            return loss

    gen = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 12), generator=gen))
    gw = Strict(record_dir=tmp_path, name="strict", sampler="thread")
    trainer = L.Trainer(max_epochs=1, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[gw], reload_dataloaders_every_n_epochs=1, accumulate_grad_batches=2)
    trainer.fit(LM(), train_dataloaders=gw.dataloader(ds, batch_size=8))
    got = open_recording(tmp_path / "strict").steps["loss"].to_list()
    want = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
    assert trainer.global_step == 2 and got == pytest.approx(want, rel=1e-3), (got, want)
