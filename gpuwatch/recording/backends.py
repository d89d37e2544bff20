"""Which GPU backend a session samples: NVML (the default) or a recording replayed as live.

Lives in the recording layer because a replayed recording is one of the choices; the sampler child
process (layer 0) is handed `BackendFactory`, a picklable callable, and imports nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gpuwatch.telemetry.nvml import NvmlBackend, NvmlUnavailable, chosen_gpus


def make_gpu_backend(source: str | None = None, gpus: Sequence[int] | None = None) -> tuple[Any | None, str]:
    """NVML, or a recording replayed as live (`source` = a session path); `gpus`: only those GPU indices
    (None: all; one not there is a UsageError). Returns (backend or None for CPU-only, a one-line note
    saying what was found)."""
    if source:
        from gpuwatch.recording.replay_backend import ReplayGpuBackend

        rb = ReplayGpuBackend(source, only=gpus)
        return rb, f"{len(rb.gpus)} GPU(s) from {rb.label}"
    try:
        b = NvmlBackend(only=gpus)
    except NvmlUnavailable as e:
        chosen_gpus([], gpus)  # GPUs asked for where there are none: an error, not a CPU-only run
        return None, str(e)
    if not b.gpus:
        b.close()
        return None, "NVML found no GPU; running CPU-only"
    names = ", ".join(sorted({g.name for g in b.gpus}))
    return b, f"{len(b.gpus)} GPU(s): {names}; driver {b.driver_version}"


@dataclass(frozen=True)
class BackendFactory:
    """Picklable (spawn sends it to the sampler child): calling it builds the backend there."""

    source: str | None = None
    gpus: tuple[int, ...] | None = None

    def __call__(self) -> tuple[Any | None, str]:
        return make_gpu_backend(self.source, self.gpus)
