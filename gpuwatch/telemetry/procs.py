"""What the sampler adds, once a second, to each process NVML lists on a GPU (`samples.gpu_procs`): its SM
and memory utilization (NVML's per-process samples, `NvmlBackend.read_proc_util`) and its user and
command (psutil, looked up once per new PID and kept while the PID stays on a GPU)."""

from __future__ import annotations

from typing import Any, Callable

COMMAND_MAX = 256  # characters of a command line kept (the panel shows the start; the rest is arguments)


def _lookup(pid: int) -> tuple[str | None, str | None]:
    """(user, command) of `pid` on this machine; None for what cannot be seen (another PID namespace, a
    process gone or hidden)."""
    import psutil

    try:
        p = psutil.Process(pid)
    except (psutil.Error, OSError, ValueError):
        return None, None
    user = cmd = None
    try:
        user = p.username()
    except (psutil.Error, OSError, KeyError):
        pass
    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except (psutil.Error, OSError):
        pass
    return user, cmd[:COMMAND_MAX] if cmd else None


class ProcInfo:
    """Builds, once a second, each GPU's {pid: the fields added to its `gpu_procs` entry}."""

    def __init__(self, lookup: Callable[[int], tuple[str | None, str | None]] = _lookup) -> None:
        self.lookup = lookup
        self.names: dict[int, tuple[str | None, str | None]] = {}  # pid -> (user, command), once per PID

    def build(self, procs: list[dict[str, Any]] | None, util: dict[int, tuple[int, int]] | None
              ) -> dict[int, dict[str, Any]]:
        """The fields of each PID in `procs` (one GPU's last list): utilization from `util` (None: not
        given, so null; a PID without a sample in a given answer ran no kernel: 0) and user/command."""
        out: dict[int, dict[str, Any]] = {}
        names = self.names
        for p in procs or ():
            pid = p.get("pid")
            if pid is None:
                continue
            who = names.get(pid)
            if who is None:
                who = names[pid] = self.lookup(pid)
            sm = mem = None
            if util is not None:
                sm, mem = util.get(pid, (0, 0))
            out[pid] = {"sm_util_pct": sm, "mem_util_pct": mem, "user": who[0], "command": who[1]}
        return out

    def forget_except(self, pids: set[int]) -> None:
        """Drop the names of PIDs no GPU lists any more (a PID used again later is looked up again)."""
        for pid in [p for p in self.names if p not in pids]:
            del self.names[pid]
