"""Measure how long the training thread is blocked on communication, split by kind.

Every blocking point of the distributed stack passes through one of three Python-level functions,
which `CommTimer.install()` wraps with a clock:

- `torch._C._distributed_c10d.Work.wait` — the waits of synchronous collectives (torch.distributed
  calls `work.wait()` itself), of FSDP2's all-gathers and reduce-scatters, and of the pipeline's
  send/recv handles;
- `torch.distributed._functional_collectives.wait_tensor` — the waits of DTensor (tensor parallel)
  collectives, issued when an AsyncCollectiveTensor is first used;
- `torch.distributed.pipelining.schedules._wait_batch_p2p` — the pipeline schedule waiting for a
  neighbouring stage's activations or gradients.

Waits inside `_wait_batch_p2p` count as **pipeline wait** (reported as `time_bubble_s`: the bubble
plus the point-to-point transfer time that is not hidden); all other waits count as **exposed
communication**. Nested waits are counted once, by the outermost wrapper. Only time inside an
active step is kept (checkpoint saves and start-up collectives are not).

What this measures: host (CPU) time blocked. On CPU/gloo, where compute runs synchronously on the
same thread, that is exactly the communication the step does not hide. On CUDA, kernels and NCCL
run asynchronously: a wait returns once the stream dependency is queued, so the figures are a lower
bound of the exposed time (a profiler trace of the kernel timeline is the way to see the GPU-side
split; see the rank summary's `timing_method`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

COLLECTIVE = "collective"
P2P = "p2p"


class CommTimer:
    """Accumulates blocked seconds per kind while `active`; one per process."""

    def __init__(self) -> None:
        self.seconds = {COLLECTIVE: 0.0, P2P: 0.0}
        self.active = False
        self._local = threading.local()
        self._restore: list[tuple[Any, str, Any]] = []

    def reset(self) -> dict[str, float]:
        """Return the accumulated seconds and start again from zero."""
        out, self.seconds = self.seconds, {COLLECTIVE: 0.0, P2P: 0.0}
        return out

    def _timed(self, kind: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn wrapped: time the outermost call; `kind=None` means 'collective unless inside p2p'."""
        local, timer = self._local, self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            if depth or not timer.active or threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            local.depth = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.seconds[kind or COLLECTIVE] += time.perf_counter() - start
                local.depth = 0

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> None:
        """Wrap the three wait points (idempotent)."""
        if self._restore:
            return
        import torch.distributed as dist

        if not dist.is_available():
            return
        import torch.distributed._functional_collectives as funcol
        from torch._C._distributed_c10d import Work

        targets: list[tuple[Any, str, str | None]] = [(Work, "wait", None), (funcol, "wait_tensor", None)]
        try:
            from torch.distributed.pipelining import schedules

            if hasattr(schedules, "_wait_batch_p2p"):
                targets.append((schedules, "_wait_batch_p2p", P2P))
        except ImportError:  # pragma: no cover - pipelining ships with torch >= 2.4
            pass
        for owner, name, kind in targets:
            original = getattr(owner, name)
            setattr(owner, name, self._timed(kind, original))
            self._restore.append((owner, name, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
