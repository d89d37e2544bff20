"""Joining a data-parallel job (gpuwatch/workload/distributed.py runs it): the rank's context from
torchrun's environment, both process groups (the data plane: NCCL or gloo; the control plane: gloo), the
checks of what cannot combine with ranks, and `stress --nproc N` relaunching itself under torchrun."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpuwatch.errors import UsageError

ENV_TIMEOUT = "GPUWATCH_DIST_TIMEOUT_S"  # the process groups' timeout (default 600 s)
CTRL_TIMEOUT_S = 3600.0  # the control plane waits this long (a paused rank 0 sends a heartbeat every second)
FATAL_KEY = "gpuwatch/fatal"


def launched() -> bool:
    """Whether this process is one rank of several (torchrun, or any launcher setting WORLD_SIZE)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not a number") from None


def under_torchrun() -> bool:
    """Started by torchrun (or a launcher like it), even with one rank: `torchrun --nproc-per-node 1`
    runs the job's code paths (NCCL, DDP, the collective check) on one GPU."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    backend: str
    device: torch.device
    ctrl: Any  # the gloo group of the control plane
    store: Any  # the rendezvous store (a failing rank's reason goes here)
    timeout_s: float

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world, "local_rank": self.local_rank,
                "backend": self.backend, "timeout_s": self.timeout_s}

    def fatal(self, reason: str) -> None:
        """Leave this rank's reason for the others (first one wins), before it fails."""
        try:
            if not self.store.check([FATAL_KEY]):
                self.store.set(FATAL_KEY, f"rank {self.rank}: {reason}")
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass

    def fatal_reason(self) -> str | None:
        try:
            if self.store.check([FATAL_KEY]):
                return self.store.get(FATAL_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001
            pass
        return None


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise UsageError(f"torch.distributed: {name} is not set (run under torchrun, or use --nproc N)") from None
    except ValueError:
        raise UsageError(f"torch.distributed: {name}={os.environ[name]!r} is not a number") from None


def init_from_env(device: str = "auto") -> DistContext:
    """Join the job torchrun started: NCCL on cuda:LOCAL_RANK where CUDA has that device, else gloo on
    the CPU (`--device cpu` forces gloo). Both process groups get a timeout, so a lost rank ends the job."""
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT")
    try:
        timeout_s = float(os.environ.get(ENV_TIMEOUT, "600"))
    except ValueError:
        raise UsageError(f"{ENV_TIMEOUT} must be seconds") from None
    cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() > local
    if device.startswith("cuda") and not cuda_ok:
        raise UsageError(f"--device {device}: rank {rank} has no CUDA device {local} here")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise UsageError(f"--device {device}: under torchrun use auto, cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    if cuda_ok and device != "cpu":
        dev, backend = torch.device(f"cuda:{local}"), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=timeout_s)
    # the launcher's store (torchrun's agent hosts it; a plain launcher: rank 0 does), as env:// would make it
    master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(addr, port, world, is_master=master, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, CTRL_TIMEOUT_S)))
    return DistContext(rank, world, local, backend, dev, ctrl, dist.PrefixStore("gpuwatch", store), timeout_s)


LEAVE_TIMEOUT_S = 60.0  # how long a rank waits at the end for the others to reach shutdown too


def shutdown(ctx: DistContext | None = None) -> None:
    """Leave the job. With `ctx`, the ranks first meet on the control plane (at most LEAVE_TIMEOUT_S), so no
    rank tears its groups down while another still talks to it: a gloo pair closed under a peer's pending
    work aborts that process (SIGABRT, "terminate called without an active exception", seen in CI)."""
    if not dist.is_initialized():
        return
    if ctx is not None and ctx.world > 1:
        try:
            dist.monitored_barrier(group=ctx.ctrl, timeout=timedelta(seconds=LEAVE_TIMEOUT_S), wait_all_ranks=True)
        except Exception as e:  # noqa: BLE001 - a rank that failed or left does not come; leave anyway
            print(f"gpuwatch: rank {ctx.rank}: leaving without the other ranks ({str(e).splitlines()[0][:160]})",
                  file=sys.stderr, flush=True)
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a failed job's groups may not tear down cleanly
        print(f"gpuwatch: tearing down torch.distributed failed: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}",
              file=sys.stderr, flush=True)


def join(device: str, resume=None, collectives: int | None = None, dp: str | None = None,
         mode: str | None = None) -> DistContext:
    """`stress` under torchrun: check what cannot combine with it, then join the job."""
    flag = "--collectives" if collectives else f"--dp {dp}"
    if not launched() and not under_torchrun():
        raise UsageError(f"{flag} needs several ranks: add --nproc N (or start under torchrun)")
    check_dp(dp, mode)
    if resume is not None:
        raise UsageError("--resume of a data-parallel run is not supported: start it again")
    return init_from_env(device)


def check_dp(dp: str | None, mode: str | None) -> None:
    if dp == "fsdp" and mode != "train":
        raise UsageError(f"--dp fsdp shards training (--mode train), not --mode {mode}")


def relaunch(argv: list[str], nproc: int, dp: str | None = None, mode: str | None = None) -> int:
    """`stress --nproc N ...`: the same command under torchrun (`python -m torch.distributed.run`) with
    N ranks on this host; its exit code is the job's."""
    import subprocess
    import sys

    if launched():
        raise UsageError("--nproc starts torchrun; this process already runs under it")
    check_dp(dp, mode)
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "gpuwatch", *rest]
    return subprocess.call(cmd)
