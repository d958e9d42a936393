"""Measure how long training waits for communication, split by kind, on the CPU and on a GPU.

Every blocking point of the distributed stack passes through one of three Python-level functions,
which `CommTimer.install()` wraps with a clock:

- `torch._C._distributed_c10d.Work.wait` — the waits of synchronous collectives (torch.distributed
  calls `work.wait()` itself), of FSDP2's all-gathers and reduce-scatters, and of the pipeline's
  send/recv handles;
- `torch.distributed._functional_collectives.wait_tensor` — the waits of DTensor (tensor parallel)
  collectives, issued when an AsyncCollectiveTensor is first used;
- `torch.distributed.pipelining.schedules._wait_batch_p2p` — the pipeline schedule waiting for a
  neighbouring stage's activations or gradients.

Expert parallelism's all-to-alls (runtime/parallel/expert.py) wait through a fourth,
`expert.wait_all_to_all`, timed as **all-to-all**: exposed communication too, also reported on its
own (`time_all_to_all_s`), forward and backward (the dispatch's backward exchanges wait through it as well).

Context parallelism's K/V exchanges (runtime/parallel/context.py: the all-gather in forward, the
reduce-scatter of the K/V gradients in backward; or, with `parallel.cp_rotate: ring`, the point-to-point K/V
and dK/dV transfers of runtime/parallel/ring_attention.py, waited after the block they overlap) wait through
`context.wait_kv` (the ring: `ring_attention.wait_ring`), timed as **cp_kv**: exposed communication too, also reported on its own (`time_cp_kv_s`).

Waits inside `_wait_batch_p2p` count as **pipeline wait** (reported as `time_bubble_s`: the bubble
plus the point-to-point transfer time that is not hidden); all other waits count as **exposed
communication**. Nested waits are counted once, by the outermost wrapper. Only time inside an
active step is kept (checkpoint saves and start-up collectives are not).

What this measures depends on the device (`clock_for`):

- CPU/gloo (`host`): host time blocked in the wait. Compute runs synchronously on the same
  thread, so that is exactly the communication the step does not hide.
- CUDA/NCCL (`cuda-events`): a wait only queues a stream dependency and returns at once, so host
  time says nothing. Instead a CUDA event is recorded on the current (compute) stream just before
  and just after each wait: the stream reaches the first when its work up to the wait is done, and
  passes the second only once the communication it now depends on has finished. The GPU time
  between them is the compute stream's stall on communication, i.e. the exposed communication (or
  pipeline wait), measured on the device. On CUDA FSDP2's own stream-level waits are timed too
  (`FSDPParamGroup.wait_for_unshard`: the all-gather, with its copy-out;
  `FSDPParamGroup.finalize_backward`: the last reduce-scatters), since FSDP2 makes the compute
  stream wait on its all-gather/reduce-scatter streams' events without calling `Work.wait`.
  The events are read once per step, after the step's one host synchronisation (no extra sync).

Both clocks are one `EventClock` with a different event type (`HostEvent` on the CPU, the CUDA
event on a GPU), so the bookkeeping the GPU path relies on is the one the CPU tests exercise.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

COLLECTIVE = "collective"
P2P = "p2p"
ALL_TO_ALL = "all_to_all"  # expert parallelism's dispatch; part of the exposed communication
CP_KV = "cp_kv"  # context parallelism's K/V exchanges (all-gather or ring) and their gradients'; part of it too


HOST = "host"
CUDA_EVENTS = "cuda-events"


class HostEvent:
    """The CPU stand-in for `torch.cuda.Event(enable_timing=True)`: the same three methods."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass  # recorded synchronously

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report


class EventClock:
    """Timed intervals as (start, end) event pairs per kind, summed when collected."""

    def __init__(self, new_event: Callable[[], Any], method: str) -> None:
        self.new_event, self.method = new_event, method
        self._pairs: list[tuple[str, Any, Any]] = []

    def begin(self) -> Any:
        event = self.new_event()
        event.record()
        return event

    def end(self, kind: str, start: Any) -> None:
        event = self.new_event()
        event.record()
        self._pairs.append((kind, start, event))

    def collect(self) -> dict[str, float]:
        """Seconds per kind since the last collect. On CUDA this waits for the last event, which
        the step's own host synchronisation has already passed (finish_step)."""
        pairs, self._pairs = self._pairs, []
        out = {COLLECTIVE: 0.0, P2P: 0.0, ALL_TO_ALL: 0.0, CP_KV: 0.0}
        if pairs:
            pairs[-1][2].synchronize()
        for kind, start, end in pairs:
            out[kind] += start.elapsed_time(end) / 1e3
        return out


def clock_for(device: Any) -> EventClock:
    """CUDA events on a CUDA device, the host clock otherwise (see the module docstring)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        if torch.cuda.is_available():
            return EventClock(lambda: torch.cuda.Event(enable_timing=True), CUDA_EVENTS)
    return EventClock(HostEvent, HOST)


class CommTimer:
    """Accumulates waited seconds per kind while `active`; one per process."""

    def __init__(self, clock: EventClock | None = None) -> None:
        self.clock = clock or EventClock(HostEvent, HOST)
        self.active = False
        self._local = threading.local()
        self._restore: list[tuple[Any, str, Any]] = []

    @property
    def method(self) -> str:
        return self.clock.method

    def reset(self) -> dict[str, float]:
        """Return the seconds accumulated since the last reset, and start again from zero."""
        return self.clock.collect()

    def _timed(self, kind: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn wrapped: time the outermost call; `kind=None` means 'collective unless inside p2p'."""
        local, timer = self._local, self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            if depth or not timer.active or threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            local.depth = 1
            start = timer.clock.begin()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.clock.end(kind or COLLECTIVE, start)
                local.depth = 0

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> None:
        """Wrap the wait points (idempotent); on CUDA FSDP2's stream-level waits as well."""
        if self._restore:
            return
        import torch.distributed as dist

        if not dist.is_available():
            return
        import torch.distributed._functional_collectives as funcol
        from torch._C._distributed_c10d import Work

        from hpctrain.runtime.parallel import context, expert, ring_attention

        targets: list[tuple[Any, str, str | None]] = [(Work, "wait", None), (funcol, "wait_tensor", None),
                                                      (expert, "wait_all_to_all", ALL_TO_ALL),
                                                      (context, "wait_kv", CP_KV),
                                                      (ring_attention, "wait_ring", CP_KV)]
        try:
            from torch.distributed.pipelining import schedules

            if hasattr(schedules, "_wait_batch_p2p"):
                targets.append((schedules, "_wait_batch_p2p", P2P))
        except ImportError:  # pragma: no cover - pipelining ships with torch >= 2.4
            pass
        if self.clock.method == CUDA_EVENTS:
            targets += _fsdp_stream_waits()
        for owner, name, kind in targets:
            original = getattr(owner, name)
            setattr(owner, name, self._timed(kind, original))
            self._restore.append((owner, name, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()


def _fsdp_stream_waits() -> list[tuple[Any, str, str | None]]:
    """FSDP2's methods that make the compute stream wait for its communication streams (they
    exist from torch 2.6 on; a torch without them is timed through Work.wait alone)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # pragma: no cover - private module, present in torch 2.6 .. 2.13
        return []
    return [(FSDPParamGroup, name, None) for name in ("wait_for_unshard", "finalize_backward")
            if hasattr(FSDPParamGroup, name)]
