"""`entrypoint:` — the user's own training program instead of the built-in transformer (issue 28).

`{script: train.py, args: [...]}` or `{module: pkg.train, args: [...]}`: every rank runs that program
with torchrun's variables (hpctrain/launch/entrypoint.py). hpctrain runs nothing else from this section:
the args are an argv list, never a shell line; `{tp}`-style placeholders in them are filled from the
resolved job. Without `model:` nothing is planned: the degrees are the fixed ones (auto -> tp 1, pp 1,
dp the rest) and reach the script as HPCTRAIN_TP/PP/DP and the placeholders.
"""

from typing import TYPE_CHECKING, Any, Optional

from pydantic import Field

import hpctrain.config.limits as L
from hpctrain.config.base import Section, new_list
from hpctrain.config.problem import Problem
from hpctrain.config.types import Text

if TYPE_CHECKING:
    from hpctrain.config.job import Job

PLACEHOLDERS = ("tp", "pp", "dp", "world_size", "run_dir", "checkpoint_dir")


class EntrypointConfig(Section):
    """The program every rank runs (instead of the built-in model): a script file or a module, and its argv."""

    script: Optional[Text] = Field(None, description="A Python file each rank runs (`python SCRIPT ARGS...`), "
                                   "relative to the job file's folder. Exactly one of script and module.")
    module: Optional[Text] = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
                                   description="A module each rank runs (`python -m MODULE ARGS...`). Exactly one "
                                   "of script and module.")
    args: list[Text] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS, description="The program's "
                             "arguments, one item each (never a shell line). Placeholders filled from the resolved "
                             "job: {tp} {pp} {dp} {world_size} {run_dir} {checkpoint_dir}; {{ and }} are literal "
                             "braces.")


def placeholders(arg: str) -> list[str]:
    """The {names} in one argument (ValueError on an unmatched brace)."""
    import string  # only for a job with entrypoint.args

    return [name for _, name, _, _ in string.Formatter().parse(arg) if name is not None]


def entrypoint_problems(job: "Job") -> list[Problem]:
    e = job.entrypoint
    if e is None:
        return []
    if (e.script is None) == (e.module is None):
        return [Problem("entrypoint", "needs exactly one of script and module", "both" if e.script else "neither",
                        "write entrypoint: {script: train.py} or entrypoint: {module: pkg.train}")]
    out = []
    for i, arg in enumerate(e.args):
        try:
            names = placeholders(arg)
        except ValueError:
            out.append(Problem(f"entrypoint.args[{i}]", "has an unmatched brace", arg,
                               "write {{ or }} for a literal brace"))
            continue
        unknown = [n for n in names if n not in PLACEHOLDERS]
        if unknown:
            out.append(Problem(f"entrypoint.args[{i}]", f"unknown placeholder {{{unknown[0]}}}", arg,
                               f"use one of {', '.join('{' + p + '}' for p in PLACEHOLDERS)} (or {{{{ }}}} for braces)"))
    return out


def fill_args(args: list[str], values: dict[str, Any]) -> list[str]:
    """The argv items with their placeholders filled (validated already: only PLACEHOLDERS occur)."""
    return [arg.format(**values) for arg in args]


def layout_without_model(job: "Job") -> "Job":
    """A job without `model:` is not planned: an `auto` degree takes what the fixed ones leave of the GPUs
    (dp first, else tp, else pp), the other autos are 1; the built-in runtime's other `auto` knobs get
    their plain values (the script ignores them)."""
    p, t = job.parallel, job.train

    def fixed(value: Any, default: int) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    world = job.world_size
    tp0, pp0, dp0 = (fixed(v, 0) or None for v in (p.tp, p.pp, p.dp))
    if dp0 is None:
        tp, pp = tp0 or 1, pp0 or 1
        dp = max(1, world // (tp * pp))
    elif tp0 is None:
        pp, dp = pp0 or 1, dp0
        tp = max(1, world // (pp * dp))
    else:
        tp, dp = tp0, dp0
        pp = pp0 or max(1, world // (tp * dp))
    parallel = p.model_copy(update={"tp": tp, "pp": pp, "dp": dp, "zero": fixed(p.zero, 0),
                                    "schedule": "1f1b" if p.schedule == "auto" else p.schedule,
                                    "virtual_stages": fixed(p.virtual_stages, 1)})
    train = t.model_copy(update={"micro_batch": fixed(t.micro_batch, 1),
                                 "activation_checkpointing": ("none" if t.activation_checkpointing == "auto"
                                                              else t.activation_checkpointing)})
    return job.model_copy(update={"parallel": parallel, "train": train})
