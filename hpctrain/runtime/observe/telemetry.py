"""What a run leaves for people and for `hpctrain doctor` (docs/architecture.md: the run directory, the metrics record).

- `metrics.jsonl` (rank 0): one JSON object per logged step, append-only; on (re)start it is cut
  back to the step the run resumes from, so after any number of restarts every step appears once.
- `events.jsonl` (rank 0): lifecycle lines — started, checkpoint saved / skipped, finished, failed.
- `ranks/rank-R.json` (every rank): the time split, peak memory, memory by kind, host.

Fields of a metrics line, and where each comes from:

| field | source |
|---|---|
| step, loss, lr, grad_norm | the step (loss: global-batch mean; lr: the rate this step used) |
| tokens | tokens consumed since step 0, all ranks together |
| step_time_s | wall clock of the step (batch fetch to optimizer step; device synchronised), mean over the steps since the last line |
| tokens_per_s | global tokens of one step / step_time_s |
| tflops_per_gpu | `plan.model_stats.flops_per_token(model, ac)` (recompute included) x tokens/s / world / 1e12 |
| mfu | `flops_per_token(model, "none")` x tokens/s / world / the GPU's dense peak for the precision (catalog); null on CPU |
| peak_memory_bytes | CUDA: torch.cuda.max_memory_allocated; CPU: peak RSS minus the RSS before the model was built |
| time_comm_exposed_s, time_bubble_s | measured waits (comm_timing.py), mean per step: host-blocked time on CPU, the compute stream's stall between CUDA events on a GPU |
| time_compute_s | derived: step_time_s - time_comm_exposed_s - time_bubble_s |
| time_all_to_all_s | parallel.ep > 1 only: the expert-parallel all-to-alls' waits, mean per step (a part of time_comm_exposed_s) |
| time_cp_kv_s | parallel.cp > 1 only: the context-parallel K/V exchanges' waits, mean per step (a part of time_comm_exposed_s) |
| aux_loss, expert_load_max_over_mean, tokens_dropped | model.moe only (runtime/training.py `moe_step_stats`): the balancing loss (when asked for), the worst MoE layer's busiest expert over its mean, tokens over capacity; the step's routing summed over all ranks |
| expert_load_ep<N> | model.moe only, one per N > 1 dividing the experts (runtime/model/moe.py `expert_rank_loads`): the busiest of N expert-parallel ranks' tokens over the mean, mean over the MoE layers; `hpctrain plan --expert-load RUN` prices the layouts with it |
| attention_kernel | train.attention_kernel: the SDPA backend the steps ran under (auto: torch's own choice) |
| fp8_recipe | train.precision fp8 only: train.fp8.recipe, "(emulated)" with train.fp8.emulate |
| attempt | the start's attempt as the launcher counted it from the run directory (HPCTRAIN_ATTEMPT; the logs are named by it), else SLURM_RESTART_COUNT |
| time | Unix time when the line was written (wall-clock progress, gaps between attempts) |
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.observe.comm_timing import (
    ALL_TO_ALL,
    COLLECTIVE,
    CP_KV,
    CUDA_EVENTS,
    HOST,
    P2P,
    CommTimer,
    clock_for,
)

from hpctrain.rundir.events import append_line, now_iso as _now
from hpctrain.rundir.layout import EVENTS_FILE, METRICS_FILE, RANKS_DIR
from hpctrain.rundir.metrics import truncate_metrics
from hpctrain.rundir.ranks import summary_path
from hpctrain.rundir.safe_files import write_atomic

if TYPE_CHECKING:
    from hpctrain.config import Job

__all__ = ["EVENTS_FILE", "METRICS_FILE", "RANKS_DIR", "Telemetry", "append_line", "truncate_metrics"]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _max_rss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


class MemoryTracker:
    """Peak memory of the training: CUDA allocator peak, or peak RSS growth since the baseline."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.baseline_rss_bytes = _rss_bytes()
        self.source = "torch.cuda.max_memory_allocated" if self.cuda else "peak RSS minus RSS before model build"

    def peak_bytes(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        return max(0, _max_rss_bytes() - self.baseline_rss_bytes)


@dataclass
class Throughput:
    """FLOPs per token from the planner's formula and the GPU's peak from its catalog."""

    hardware_flops_per_token: float
    model_flops_per_token: float
    peak_flops_per_s: float | None  # None: no catalog peak for this device (CPU) -> mfu null
    world_size: int

    @classmethod
    def for_job(cls, job: Job, world_size: int, device_type: str) -> Throughput:
        from hpctrain.plan.model_stats import flops_per_token

        ac = job.train.activation_checkpointing
        return cls(
            hardware_flops_per_token=flops_per_token(job.model, ac if ac in ("none", "selective", "full") else "none"),
            model_flops_per_token=flops_per_token(job.model, "none"),
            peak_flops_per_s=gpu_peak_flops_per_s(job) if device_type == "cuda" else None,
            world_size=world_size,
        )

    def tflops_per_gpu(self, tokens_per_s: float) -> float:
        return self.hardware_flops_per_token * tokens_per_s / self.world_size / 1e12

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_flops_per_s:
            return None
        return self.model_flops_per_token * tokens_per_s / self.world_size / self.peak_flops_per_s


def gpu_peak_flops_per_s(job: Job) -> float | None:
    """Dense peak of job.cluster.gpu for the job's precision (catalog or cluster.gpu_spec), or None."""
    try:
        from hpctrain.plan.hardware import resolve_hardware
    except ImportError:
        return None
    try:
        peak = resolve_hardware(job).gpu.peak_flops_per_s(job.train.precision)
    except (ValueError, KeyError, AttributeError):
        return None
    return float(peak) or None


TIMING_METHODS = {
    HOST: "host-blocked time in Work.wait / wait_tensor / pipeline p2p waits; compute = step - waits",
    CUDA_EVENTS: ("compute-stream stall between CUDA events around Work.wait / wait_tensor / pipeline p2p "
                  "waits / FSDP2 unshard and reduce-scatter waits; compute = step - waits"),
}


@dataclass
class StepTimes:
    """Sums over the steps since the last metrics line."""

    steps: int = 0
    step_s: float = 0.0
    comm_s: float = 0.0
    bubble_s: float = 0.0
    all_to_all_s: float = 0.0  # included in comm_s
    cp_kv_s: float = 0.0  # included in comm_s

    def add(self, step_s: float, comm_s: float, bubble_s: float, all_to_all_s: float = 0.0,
            cp_kv_s: float = 0.0) -> None:
        self.steps += 1
        self.cp_kv_s += cp_kv_s
        self.step_s += step_s
        self.comm_s += comm_s
        self.bubble_s += bubble_s
        self.all_to_all_s += all_to_all_s


@dataclass
class Telemetry:
    """One per rank. Rank 0 writes metrics and events; every rank writes its summary."""

    run_dir: str
    rank: int
    world_size: int
    attempt: int
    device: Any
    throughput: Throughput
    tokens_per_step: int
    memory: MemoryTracker
    timer: CommTimer = field(default_factory=CommTimer)
    interval: StepTimes = field(default_factory=StepTimes)
    totals: StepTimes = field(default_factory=StepTimes)  # all steps but the first of this attempt
    extra: dict[str, Any] = field(default_factory=dict)  # static facts for the rank summary
    steps_this_attempt: int = 0
    all_to_all: bool = False  # expert parallelism: log time_all_to_all_s
    context: bool = False  # context parallelism: log time_cp_kv_s

    def __post_init__(self) -> None:
        if self.timer.method == HOST:  # the default clock: CUDA events when the device is a GPU
            self.timer.clock = clock_for(self.device)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, METRICS_FILE)

    def event(self, name: str, **fields: Any) -> None:
        if self.rank == 0:
            append_line(os.path.join(self.run_dir, EVENTS_FILE),
                        {"time": _now(), "event": name, "attempt": self.attempt, **fields})

    def start(self, resumed_step: int) -> None:
        """Cut metrics back to the resumed step and start timing communication."""
        if self.rank == 0:
            truncate_metrics(self.metrics_path, resumed_step)
        self.timer.install()

    def begin_step(self) -> None:
        self.timer.reset()
        self.timer.active = True

    def end_step(self, step_s: float) -> None:
        self.timer.active = False
        waits = self.timer.reset()
        comm = waits[COLLECTIVE] + waits[ALL_TO_ALL] + waits[CP_KV]
        self.interval.add(step_s, comm, waits[P2P], waits[ALL_TO_ALL], waits[CP_KV])
        self.steps_this_attempt += 1
        if self.steps_this_attempt > 1:  # the first step of an attempt warms up (allocations, plans)
            self.totals.add(step_s, comm, waits[P2P], waits[ALL_TO_ALL], waits[CP_KV])

    def log(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, **extra: Any) -> dict[str, Any]:
        """Build the metrics line for `step` from the interval since the last one; rank 0 appends it."""
        t, n = self.interval, max(1, self.interval.steps)
        step_s, comm_s, bubble_s = t.step_s / n, t.comm_s / n, t.bubble_s / n
        tokens_per_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "step_time_s": step_s, "tokens_per_s": tokens_per_s,
            "tflops_per_gpu": self.throughput.tflops_per_gpu(tokens_per_s),
            "mfu": self.throughput.mfu(tokens_per_s),
            "peak_memory_bytes": self.memory.peak_bytes(),
            "time_compute_s": max(0.0, step_s - comm_s - bubble_s),
            "time_comm_exposed_s": comm_s, "time_bubble_s": bubble_s,
            **({"time_all_to_all_s": t.all_to_all_s / n} if self.all_to_all else {}),
            **({"time_cp_kv_s": t.cp_kv_s / n} if self.context else {}),
            "attempt": self.attempt, "time": time.time(), **extra,
        }
        self.interval = StepTimes()
        if self.rank == 0:
            append_line(self.metrics_path, record)
        return record

    def write_rank_summary(self, state_bytes: dict[str, int], status: str) -> None:
        """ranks/rank-R.json: means over this attempt's steps (the first, warm-up step excluded)."""
        t = self.totals
        n = max(1, t.steps)
        summary = {
            "rank": self.rank, "world_size": self.world_size, "host": socket.gethostname(), "pid": os.getpid(),
            "attempt": self.attempt, "device": str(self.device), "status": status, "updated": _now(),
            "steps_timed": t.steps,
            "step_time_s": t.step_s / n,
            "time_compute_s": max(0.0, (t.step_s - t.comm_s - t.bubble_s) / n),
            "time_comm_exposed_s": t.comm_s / n,
            "time_bubble_s": t.bubble_s / n,
            **({"time_all_to_all_s": t.all_to_all_s / n} if self.all_to_all else {}),
            **({"time_cp_kv_s": t.cp_kv_s / n} if self.context else {}),
            "timing_method": TIMING_METHODS[self.timer.method],
            "peak_memory_bytes": self.memory.peak_bytes(),
            "peak_memory_source": self.memory.source,
            **{f"{k}_bytes": v for k, v in state_bytes.items()},
            **self.extra,
        }
        path = str(summary_path(self.run_dir, self.rank))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps(summary, indent=1))

    def close(self) -> None:
        self.timer.uninstall()
