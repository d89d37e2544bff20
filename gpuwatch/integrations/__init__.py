"""The guard in the user's own training loop (layer 5, beside the UI: it builds a `runtime.Session` and
touches torch, so it sits above the runtime and is the one package outside `gpuwatch/workload/` allowed
to import torch; transformers and lightning only in their own optional modules).

- `loop.GuardedLoop`: around any PyTorch loop; told each step's batch, splits it into micro-batches
  (gradient accumulation: same effective batch, same update) before a step the risk model says will
  not fit, gives the batch back when the danger passes, records a normal gpuwatch session.
- `hf.GpuwatchCallback`: a Hugging Face `TrainerCallback` (`pip install 'gpuwatch[hf]'`).
- `lightning.GpuwatchLightningCallback`: a Lightning `Callback` (`pip install 'gpuwatch[lightning]'`).
"""

from gpuwatch.integrations.loop import GuardedLoop

__all__ = ["GuardedLoop"]
