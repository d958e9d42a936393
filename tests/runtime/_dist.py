"""Run a function in N local processes joined by a gloo process group (multi-process runtime tests).

    from ._dist import run_distributed
    results = run_distributed(my_worker, 4, arg1, arg2, timeout_s=120)   # one result per rank

`my_worker(*args)` must be a module-level (picklable) function; it runs in each process with the
default process group initialised (unless `init_process_group=False`: then only the environment
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK is set, for code that initialises the
group itself, such as the runtime entry point). Its return value must be picklable; it is returned
in rank order. An exception in any rank is re-raised here with that rank's traceback; a hang past
`timeout_s` kills the group and fails.

Processes come from a forkserver that has already imported torch, so each group pays torch's
import (~3 s of CPU) once per pytest session rather than once per process. Every process runs
with OMP_NUM_THREADS=1 and one intra-op thread: the CI machine has 2 cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from hpctrain.rundir.ports import free_port

PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.fsdp"]
_context: Any = None


def _get_context() -> Any:
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    timeout_s: float,
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    os.environ.update(env)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
            )
        try:
            value = fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared memory that dies with the process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run fn(*args) on `world_size` gloo ranks; return their results in rank order."""
    ctx = _get_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, rank, world_size, port, init_process_group, timeout_s, env or {}, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(collected) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}): "
                    f"no result after {timeout_s:.0f} s from ranks "
                    f"{sorted(set(range(world_size)) - set(collected))}"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    # A rank died without reporting (segfault, OOM kill): the others would hang.
                    time.sleep(0.5)
                    if results.empty():
                        codes = {i: p.exitcode for i, p in enumerate(procs)}
                        raise RuntimeError(f"a rank died without a result; exit codes {codes}") from None
                continue
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
                break  # the other ranks are probably stuck in a collective
        if failures:
            # The first report is often a peer's "connection closed" after the rank at fault died or raised: collect
            # what the others report within a few seconds, and every exit code, so the cause shows too.
            grace = time.monotonic() + 3.0
            while len(collected) + len(failures) < world_size and time.monotonic() < grace:
                try:
                    rank, ok, value = results.get(timeout=0.2)
                except queue.Empty:
                    continue
                if not ok:
                    failures.append(f"--- rank {rank} ---\n{value}")
            codes = {i: p.exitcode for i, p in enumerate(procs)}
            raise RuntimeError(f"distributed worker failed (exit codes so far {codes}):\n" + "\n".join(failures))
    finally:
        for proc in procs:
            proc.join(timeout=0 if failures else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [collected[rank] for rank in range(world_size)]
