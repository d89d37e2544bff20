"""Where training's and scoring's independent pieces run (a session's windows, a fold's fit, a stretch of a
long session's windows): here, in N local processes (joblib's loky), or on a Dask cluster through joblib's
Dask backend (`gpuwatch train --dask ADDRESS`, or `--dask local:N` for a cluster of N worker processes on
this machine). Results always come back in the order the work was given, so the model is the same
whichever runs it.

A cluster's workers need gpuwatch (the same version) and the sessions at the same paths as here (a shared
file system, or object storage: predict/remote.py). dask[distributed] is the optional extra `fleet`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from gpuwatch.errors import UsageError

__all__ = ["cluster", "in_order", "parse_dask"]

_CLIENTS: list[Any] = []  # the Dask client `cluster` opened, while it is open


def parse_dask(text: str) -> str:
    """`--dask`'s value checked: a scheduler address (tcp://host:8786, host:8786) or local:N (N >= 1)."""
    t = text.strip()
    if t.startswith("local:"):
        n = t[6:]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"local:N needs a number of workers >= 1, not {n!r}")
        return f"local:{int(n)}"
    if not t or any(c.isspace() for c in t):
        raise ValueError(f"not a scheduler address: {text!r} (tcp://HOST:PORT, or local:N)")
    return t


@contextmanager
def cluster(address: str | None, timeout_s: float = 30.0) -> Iterator[Any]:
    """While open, `in_order` sends its work to the Dask cluster at `address` (local:N: one started here,
    N single-threaded worker processes, closed on the way out). None: nothing to open."""
    if not address:
        yield None
        return
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise UsageError("--dask needs dask[distributed]: pip install 'gpuwatch[fleet]'") from None
    local = None
    try:
        if address.startswith("local:"):
            import logging

            local = LocalCluster(n_workers=int(address[6:]), threads_per_worker=1, processes=True,
                                 dashboard_address=None, silence_logs=logging.ERROR)
            client = Client(local)
        else:
            client = Client(address, timeout=timeout_s)
    except (OSError, TimeoutError) as e:
        if local is not None:
            local.close()
        raise UsageError(f"--dask {address}: no Dask scheduler there ({str(e).splitlines()[0][:160]})") from None
    _CLIENTS.append(client)
    try:
        yield client
    finally:
        _CLIENTS.remove(client)
        client.close()
        if local is not None:
            local.close()


def in_order(fn: Callable, work: Iterable[tuple], jobs: int = 1) -> Iterable:
    """fn(*args) for each args of `work` (taken lazily), in order: on the open Dask cluster (`cluster`),
    else here where `jobs` <= 1, else in `jobs` processes (loky); each result handed back as soon as it and
    those before it are done."""
    from joblib import Parallel, delayed

    if _CLIENTS:
        return _on_dask(fn, work)
    if jobs <= 1:
        return (fn(*a) for a in work)
    return Parallel(n_jobs=jobs, return_as="generator")(delayed(fn)(*a) for a in work)


def _on_dask(fn: Callable, work: Iterable[tuple]) -> Iterator:
    from joblib import Parallel, delayed, parallel_config

    with parallel_config(backend="dask"):  # every worker of the cluster (n_jobs=-1)
        yield from Parallel(n_jobs=-1, return_as="generator")(delayed(fn)(*a) for a in work)
