"""The Hugging Face and Lightning callbacks, each run in a real Trainer for a few steps on the CPU with a
tiny model. Neither framework changes its data loader's batch mid-run, so the guard's smaller
micro-batch becomes a resumed run with the per-device batch down and the accumulation up: the effective
batch holds, and so does the update (compared with an unguarded run)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.contract import Action  # noqa: E402
from gpuwatch.integrations.batches import per_device_batch  # noqa: E402


def test_per_device_batch_keeps_the_effective_batch_exact():
    assert per_device_batch(8, 3) == 2 and per_device_batch(12, 5) == 4 and per_device_batch(7, 6) == 1
    assert per_device_batch(8, 100) == 8 and per_device_batch(8, 0) == 1


# -- Hugging Face ---------------------------------------------------------------------------------------
def _hf_run(tmp_path, name, actions: dict[int, Action] | None):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gpuwatch.integrations.hf import GpuwatchCallback, train

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (96, 16), generator=gen)]
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{name}"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=1, max_steps=8, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", train_sampling_strategy="sequential", report_to=[],
                             save_strategy="no", logging_steps=1, use_cpu=True, include_num_input_tokens_seen=True,
                             seed=0, disable_tqdm=True)
    gw = GpuwatchCallback(record_dir=tmp_path, name=name, sampler="thread")
    seen: list[int] = []  # rows of every micro-batch the model saw

    class Inject(TrainerCallback):  # stands in for the guard's decisions at chosen steps (CPU: no risk)
        def on_step_end(self, args, state, control, **kw):
            if actions and state.global_step in actions:
                gw.loop.apply(actions[state.global_step])

    class Count(TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):
            seen.append(args.per_device_train_batch_size)

        def on_step_end(self, args, state, control, **kw):
            seen.append(args.per_device_train_batch_size)
            seen.append(-1)  # an optimizer step ends here

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Inject(), Count(), gw])
    train(trainer)
    per_step, cur = [], 0
    for x in seen:
        if x == -1:
            per_step.append(cur)
            cur = 0
        else:
            cur += x
    return trainer, gw, per_step


def test_hf_trainer_keeps_the_effective_batch_and_the_update_through_the_guard(tmp_path):
    from gpuwatch.recording.reader import open_recording

    plain, _, steps0 = _hf_run(tmp_path, "plain", None)
    guarded, gw, steps1 = _hf_run(tmp_path, "guarded", {2: Action("lower_ceiling", 3, "test"),
                                                         5: Action("clear_ceiling", None, "test")})
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
def _lightning_run(tmp_path, name, actions):
    L = pytest.importorskip("lightning")
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))

        def training_step(self, batch, i):
            ids = batch[0]
            logits = self.net(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    gen = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (64, 12), generator=gen))
    gw = GpuwatchLightningCallback(record_dir=tmp_path, name=name, sampler="thread")
    seen = []

    class Inject(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0].shape[0])

        def on_train_epoch_end(self, trainer, pl_module):
            if actions and trainer.current_epoch in actions:
                gw.loop.apply(actions[trainer.current_epoch])

    model = LM()
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, default_root_dir=str(tmp_path / f"pl-{name}"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Inject(), gw],
                        reload_dataloaders_every_n_epochs=1)
    trainer.fit(model, train_dataloaders=gw.dataloader(ds, batch_size=8))
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
