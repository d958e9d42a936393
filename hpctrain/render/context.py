"""The flat, validated context of the job script: plain values and pre-checked lines, no Job object.

Templates see only what is built here. Strings are raw data that the template must pass through
the `q` filter; lines that are not shell (#SBATCH arguments, comments) arrive already checked as
typed values (quoting.py); the user's setup lines arrive as ShellByDesign.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

from hpctrain import __version__
from hpctrain.errors import RenderError
from hpctrain.render.binds import container_binds, job_folders
from hpctrain.render.nccl import nccl_environment
from hpctrain.render.quoting import ShellByDesign, comment_lines
from hpctrain.render.sbatch import check_array, sbatch_lines

if TYPE_CHECKING:
    from hpctrain.config import Job

RUNTIME_MODULE = "hpctrain.runtime"
# A job with `entrypoint:` runs the user's program under this per-rank wrapper (launch/entrypoint.py), same argv.
ENTRYPOINT_MODULE = "hpctrain.launch.entrypoint"


def rank_module(job: Job) -> str:
    """The module every rank runs (`PYTHON -m MODULE --job RESOLVED --run-dir DIR`), for every executor:
    the built-in runtime, or the wrapper that runs the job's entrypoint with torchrun's variables."""
    return ENTRYPOINT_MODULE if job.entrypoint is not None else RUNTIME_MODULE
# nvidia-smi --query-gpu fields for the per-node CSV monitor (`nvidia-smi --help-query-gpu`).
NVIDIA_SMI_FIELDS = ("timestamp,index,utilization.gpu,utilization.memory,memory.used,memory.total,"
                     "power.draw,temperature.gpu,clocks.sm,clocks_throttle_reasons.active")


def _time_seconds(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    from hpctrain.config.types import slurm_time_seconds

    return slurm_time_seconds(text)


def check_rank_order(job: Job) -> None:
    """placement.rank_order must cover every slot once: the runtime maps SLURM_PROCID through it.

    Slots are Slurm task ids in block order (slot = node index * gpus_per_node + SLURM_LOCALID), which
    is what `srun --distribution=block:block --ntasks-per-node=<gpus_per_node>` produces; the
    runtime, not srun, turns a slot into its global rank (hpctrain/plan/placement.py).
    """
    order = job.placement.rank_order if job.placement is not None else None
    world = job.world_size
    if order is not None and sorted(order) != list(range(world)):
        raise RenderError(f"placement.rank_order: must be a permutation of 0..{world - 1} for "
                          f"{job.cluster.nodes} node(s) x {job.cluster.gpus_per_node} GPUs (got {len(order)} "
                          "entries); render the job.yaml again so the planner places it for this cluster")


def rank_python(job: Job) -> str:
    """The interpreter each rank runs: runtime.python, else (on the host) the one running hpctrain now,
    which has hpctrain and its dependencies whatever the job's PATH holds; in an image, its python3."""
    configured = job.runtime.python
    if configured is not None:
        return str(configured)
    return "python3" if job.container.image is not None else sys.executable


def script_context(job: Job, *, run_dir: str, array: Optional[str]) -> dict[str, Any]:
    """Everything the job script template needs, validated."""
    if not run_dir:
        raise RenderError("run directory: must not be empty")
    check_array(array)
    check_rank_order(job)
    s, m, c = job.slurm, job.monitor, job.cluster
    profile, nccl = nccl_environment(job)
    time_s = _time_seconds(s.time)
    image = job.container.image
    return {
        "version": __version__,
        "sbatch_lines": sbatch_lines(job, run_dir=run_dir, array=array),
        "name": job.name,
        "run_dir": run_dir,
        "array": array is not None,
        "setup_lines": [ShellByDesign(line) for line in s.setup],
        "nodes": c.nodes,
        "elastic": c.elastic,  # a node range: re-plan for SLURM_JOB_NUM_NODES before the ranks start
        "gpus_per_node": c.gpus_per_node,
        "gpu_per_task": c.gpu != "cpu",  # srun shows each rank its node's GPUs (--gpus-per-node)
        "rank_order": job.placement is not None and job.placement.rank_order is not None,
        "cpus_per_task": s.cpus_per_task or 0,  # 0: share the node's CPUs out at run time
        "requeue": job.restart.requeue,
        "max_requeues": job.restart.max_requeues,
        "signal": job.restart.signal,
        "signal_seconds": job.restart.signal_seconds,
        "nccl_profile": profile,
        "nccl_env": [{"name": v.name, "value": v.value, "why": comment_lines(f"{v.name}: {v.why}"), "under_task_dir": v.under_task_dir}
                     for v in nccl],
        "container": image is not None,
        "container_command": job.container.runtime,
        "image": image or "",
        "binds": container_binds(job, run_dir) if image is not None else [],
        # created on the host before the ranks start: singularity cannot bind a folder that does not exist
        "checkpoint_dir": next((path for field, path in job_folders(job, run_dir) if field == "checkpoint.dir"), "")
        if image is not None else "",
        "python": rank_python(job),
        "runtime_module": rank_module(job),
        "nvidia_smi": m.nvidia_smi,
        "nvidia_smi_fields": NVIDIA_SMI_FIELDS,
        "nvidia_smi_interval_s": m.nvidia_smi_interval_s,
        "nsys": m.nsys,
        "py_spy": m.py_spy and time_s is not None,
        "py_spy_skipped": m.py_spy and time_s is None,
        "py_spy_delay_s": (time_s or 0) - m.py_spy_seconds_before_limit,
        "py_spy_seconds_before_limit": m.py_spy_seconds_before_limit,
    }
