"""The #SBATCH lines: every option validated here, then escaped for sbatch's own line parser.

The shell never reads these lines (they are comments to it); sbatch does, with different quoting
rules, so they do not go through the shell-quoting filter. Identifiers (partition, account, qos,
constraint, mem) must look like identifiers; free text (extra option values, the run directory)
is escaped (quoting.sbatch_escape); the job name becomes a safe label (quoting.slurm_job_name).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import RenderError
from hpctrain.render.binds import container_binds
from hpctrain.render.quoting import SbatchLine, sbatch_line, slurm_job_name

if TYPE_CHECKING:
    from hpctrain.config import Job

_NAME_LIST = r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"
_IDENTIFIERS = {
    "partition": (_NAME_LIST, "names of letters, digits, '_', '.', '-', comma-separated"),
    "account": (r"[A-Za-z0-9_.-]+", "letters, digits, '_', '.', '-'"),
    "qos": (_NAME_LIST, "names of letters, digits, '_', '.', '-', comma-separated"),
    "constraint": (r"[A-Za-z0-9_.,:&|()\[\]*=-]+", "features joined by & | , with [ ] ( ) and *count"),
    "mem": (r"[0-9]+[KMGTkmgt]?", "a size such as 0 (all), 500G or 64000M"),
}

# Options hpctrain writes itself, and the job.yaml field that sets each one instead of slurm.extra.
RESERVED = {
    "job-name": "name", "nodes": "cluster.nodes", "ntasks": "cluster.nodes and cluster.gpus_per_node",
    "ntasks-per-node": "cluster.gpus_per_node",
    "mincpus": "cluster.gpus_per_node and slurm.cpus_per_task (elastic jobs)", "gpus-per-node": "cluster.gpus_per_node",
    "cpus-per-task": "slurm.cpus_per_task", "exclusive": "slurm.exclusive", "mem": "slurm.mem",
    "time": "slurm.time", "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos",
    "constraint": "slurm.constraint", "switches": "the planner (placement.switches)",
    "signal": "restart.signal and restart.signal_seconds", "requeue": "restart.requeue",
    "no-requeue": "restart.requeue", "open-mode": "nothing (hpctrain appends across requeues)",
    "output": "nothing (hpctrain writes <run dir>/slurm-%j.out)", "error": "nothing (stderr joins the output)",
    "array": "sweep (hpctrain sweep)", "wrap": "nothing (the script is the job)",
    "chdir": "nothing (the job runs where it was submitted, so relative paths in job.yaml hold)",
    # These change what the job executes (its environment, its root file system), so they are not data:
    "export": "nccl.env (communication settings) or slurm.setup (shell by design, e.g. export NAME=value)",
    "export-file": "nccl.env (communication settings) or slurm.setup (shell by design, e.g. export NAME=value)",
    "get-user-env": "slurm.setup (shell by design)",
    "container": "container.image", "container-id": "container.image",
}
# --gres=gpu:N (or --gpus) in slurm.extra replaces --gpus-per-node, for sites that only accept gres.
_GPU_REQUEST_OPTIONS = ("gres", "gpus", "gpus-per-task")

ARRAY_SPEC = re.compile(r"[0-9]+(-[0-9]+(:[0-9]+)?)?(,[0-9]+(-[0-9]+(:[0-9]+)?)?)*(%[0-9]+)?")


def _identifier(field: str, value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    key = field.rsplit(".", 1)[-1]
    pattern, allowed = _IDENTIFIERS[key]
    if not re.fullmatch(pattern, value):
        raise RenderError(f"{field}: not a valid --{key} value for sbatch (got {value!r:.80}); use {allowed}")
    return value


def output_pattern(run_dir: str, array: bool) -> str:
    """Slurm's --output pattern under run_dir: %j per job, or per array task in its tasks/<id>/ folder."""
    if "\\" in run_dir:
        raise RenderError(f"run directory: a backslash turns off Slurm's %j/%A output patterns and is dropped "
                          f"from the path (got {run_dir!r:.80}); choose a runs_dir without backslashes")
    base = run_dir.rstrip("/") or "/"
    base = base.replace("%", "%%")  # a literal % in the path; %% is Slurm's escape for it
    joined = base if base.endswith("/") else base + "/"
    return joined + ("tasks/%a/slurm-%A_%a.out" if array else "slurm-%j.out")


def sbatch_lines(job: Job, *, run_dir: str, array: Optional[str]) -> list[SbatchLine]:
    """All #SBATCH arguments for the job, in the order a person would write them."""
    s, c = job.slurm, job.cluster
    extra = dict(s.extra)
    for key in extra:
        if key in RESERVED:
            raise _reserved(key, extra[key])
    lines = [sbatch_line("job-name", slurm_job_name(job.name), field="name"), sbatch_line("nodes", c.nodes_spec)]
    if c.elastic:
        # --ntasks-per-node would fix the task count at min_nodes x tasks and Slurm (cons_tres) would then
        # grant only min_nodes; --mincpus asks each node for the CPUs of its ranks instead, so Slurm gives
        # as many nodes of the range as are free, and srun starts the ranks per node itself.
        lines.append(sbatch_line("mincpus", c.gpus_per_node * (s.cpus_per_task or 1)))
    else:
        lines.append(sbatch_line("ntasks-per-node", c.gpus_per_node))
    if not any(key in extra for key in _GPU_REQUEST_OPTIONS) and c.gpu != "cpu":
        lines.append(sbatch_line("gpus-per-node", c.gpus_per_node))
    if s.cpus_per_task is not None:
        lines.append(sbatch_line("cpus-per-task", s.cpus_per_task))
    mem = _identifier("slurm.mem", s.mem)
    if s.exclusive:
        lines.append(sbatch_line("exclusive"))
        mem = "0" if mem is None else mem  # whole nodes: all their memory unless slurm.mem says otherwise
    if mem is not None:
        lines.append(sbatch_line("mem", mem, field="slurm.mem"))
    if s.time is not None:
        lines.append(sbatch_line("time", s.time, field="slurm.time"))
    for key in ("partition", "account", "qos", "constraint"):
        value = _identifier(f"slurm.{key}", getattr(s, key))
        if value is not None:
            lines.append(sbatch_line(key, value, field=f"slurm.{key}"))
    switches = job.placement.switches if job.placement is not None else None
    if switches is not None:
        lines.append(sbatch_line("switches", switches, field="placement.switches"))
    # No "B:" prefix: the signal goes to every task (the ranks), not only to the batch shell.
    r = job.restart
    lines.append(sbatch_line("signal", f"{r.signal}@{r.signal_seconds}", field="restart.signal"))
    lines.append(sbatch_line("requeue" if r.requeue else "no-requeue"))
    lines.append(sbatch_line("open-mode", "append"))
    lines.append(sbatch_line("output", output_pattern(run_dir, array is not None), field="run directory"))
    if array is not None:
        lines.append(sbatch_line("array", array, field="array"))
    for key, option in extra.items():
        if option is False:
            continue
        lines.append(sbatch_line(key, None if option is True else option, field=f"slurm.extra.{key}"))
    return lines


def _reserved(key: str, value: object) -> RenderError:
    return RenderError(f"slurm.extra.{key}: hpctrain writes --{key} itself or refuses it (got {value!r:.80}); "
                       f"set it through {RESERVED[key]}")


def _raise(error: RenderError) -> None:
    raise error


def sbatch_problems(job: Job) -> list[str]:
    """Every problem sbatch_lines (render, submit) would refuse, one line per field, without rendering.

    `validate` runs this, so a value that render refuses never validates. Each check is the one
    sbatch_lines makes (same functions, same messages); they are only collected instead of raised.
    """
    s = job.slurm
    checks: list[Any] = [lambda: sbatch_line("job-name", slurm_job_name(job.name), field="name"),
                         lambda: container_binds(job, "")]
    if s.time is not None:
        checks.append(lambda: sbatch_line("time", s.time, field="slurm.time"))
    for key in ("partition", "account", "qos", "constraint", "mem"):
        value = getattr(s, key)
        if value is not None:
            checks.append(lambda key=key, value=value: sbatch_line(key, _identifier(f"slurm.{key}", value),
                                                                   field=f"slurm.{key}"))
    for key, value in s.extra.items():
        if key in RESERVED:
            checks.append(lambda key=key, value=value: _raise(_reserved(key, value)))
        elif value is not False:
            checks.append(lambda key=key, value=value: sbatch_line(key, None if value is True else value,
                                                                   field=f"slurm.extra.{key}"))
    problems: list[str] = []
    for check in checks:
        try:
            check()
        except RenderError as exc:
            problems += exc.problems
    return problems


def check_array(array: Optional[str]) -> Optional[str]:
    """An sbatch --array spec such as '0-7%4' or '0,2,5', or RenderError."""
    if array is not None and not ARRAY_SPEC.fullmatch(array):
        raise RenderError(f"array: not an sbatch --array spec (got {array!r:.80}); use e.g. '0-7%4' or '0,2,5'")
    return array
