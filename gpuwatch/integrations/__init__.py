"""The guard in the user's own training loop (layer 5, beside the UI: it builds a `runtime.Session` and
touches torch, so it sits above the runtime and is the one package outside `gpuwatch/workload/` allowed
to import torch; transformers and lightning only in their own optional modules).

- `loop.GuardedLoop`: around any PyTorch loop; told each step's batch, splits it into micro-batches
  (gradient accumulation: same effective batch, same update) before a step the risk model says will
  not fit, gives the batch back when the danger passes, records a normal gpuwatch session.
- `hf.GpuwatchCallback`: a Hugging Face `TrainerCallback` (`pip install 'gpuwatch[hf]'`).
- `lightning.GpuwatchLightningCallback`: a Lightning `Callback` (`pip install 'gpuwatch[lightning]'`).
"""

__all__ = ["GuardedLoop"]


def __getattr__(name: str):
    """`GuardedLoop` imported on first use, so that `import gpuwatch.integrations.hf` (or `.lightning`)
    reaches that module's own check and names its extra when one is missing."""
    if name == "GuardedLoop":
        from gpuwatch.integrations.loop import GuardedLoop

        return GuardedLoop
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
