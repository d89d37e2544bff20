"""A GPU backend that replays a real recording as if it were live: for tests and for demos on machines
with no GPU. Everything that shows its data labels it as a replay (`label`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from gpuwatch.recording.reader import open_recording
from gpuwatch.telemetry.nvml import GpuInfo, GpuLost, chosen_gpus

_SLOW = ("gpu_pcie_tx_bytes_per_s", "gpu_pcie_rx_bytes_per_s", "gpu_energy_mj")


class ReplayGpuBackend:
    kind = "replay"

    def __init__(self, path: Path | str, loop: bool = True, only: Sequence[int] | None = None) -> None:
        """`only`: replay those recorded GPUs (their recorded indices), as `NvmlBackend(only=...)` samples
        those NVML indices; None: every GPU the recording has."""
        rec = open_recording(path)
        if not rec.gpus:  # nothing to replay as a GPU: the same one-line error `replay` gives
            from gpuwatch.errors import RecordingError

            raise RecordingError(rec.warnings[0] if rec.warnings else f"{rec.path}: no GPU samples to replay")
        self.label = f"REPLAY of {rec.path.name} (not live)"
        self.driver_version = rec.meta.get("driver_version")
        self.loop = loop
        gpus = chosen_gpus(rec.gpus, only)
        self._rows: dict[int, list[dict[str, Any]]] = {
            g: rec.samples.filter(rec.samples["gpu"] == g).drop("ts", "tick").to_dicts() for g in gpus}
        meta_gpus = {g.get("index"): g for g in rec.meta.get("gpus", [])}
        self.gpus = [GpuInfo(
            index=g, name=meta_gpus.get(g, {}).get("name", f"GPU {g}") + " [replay]",
            uuid=None, pci_bus_id=None, mem_total_bytes=self._rows[g][0].get("gpu_mem_total_bytes"),
            power_limit_w=self._rows[g][0].get("gpu_power_limit_w"),
            temp_slowdown_c=self._rows[g][0].get("gpu_temp_slowdown_c")) for g in gpus]
        self._pos = {g: 0 for g in gpus}
        self.lost: set[int] = set()

    def _next(self, i: int) -> dict[str, Any]:
        rows = self._rows[i]
        if self._pos[i] >= len(rows):
            if not self.loop:
                self.lost.add(i)
                raise GpuLost(f"GPU {i}: end of replayed recording")
            self._pos[i] = 0
        row = rows[self._pos[i]]
        self._pos[i] += 1
        return row

    def read_fast(self, i: int) -> dict[str, Any]:
        if i in self.lost:
            raise GpuLost(f"GPU {i}: end of replayed recording")
        row = self._next(i)
        return {k: v for k, v in row.items() if k.startswith("gpu_") and k not in _SLOW}

    def read_slow(self, i: int) -> dict[str, Any]:
        rows = self._rows[i]
        return {k: rows[min(self._pos[i], len(rows) - 1)].get(k) for k in _SLOW}

    def close(self) -> None:
        pass
