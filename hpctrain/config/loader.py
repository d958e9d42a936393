"""Load a job: YAML (or a dict) + overrides -> validated Job, or one ConfigError line per problem."""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence

from pydantic import BaseModel, ValidationError

from hpctrain.config.infra import RESTART_ALIASES
from hpctrain.config.job import Job, Problem, cross_field_problems
from hpctrain.config.lazy import lazy_model
from hpctrain.config.overrides import apply_overrides
from hpctrain.config.paths import resolve_data_paths
from hpctrain.config.types import ENV_FIX
from hpctrain.config.yaml_source import Path, Source, read_yaml_file
from hpctrain.errors import ConfigError


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(path: Path) -> Optional[type[BaseModel]]:
    """The schema section at a dotted path (to list its valid keys), or None."""
    model: Any = Job
    for part in path:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            by_alias = [f for f in model.model_fields.values() if f.alias == part] if model else []
            field = by_alias[0] if by_alias else None
        if field is None:
            return None
        model = _section_type(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _section_type(annotation: Any) -> Any:
    lazy = lazy_model(annotation)  # a section built on first use (config/lazy.py)
    if lazy is not None:
        return lazy
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


_FIXES = {
    "missing": "add it",
    "int_type": "write a whole number",
    "float_type": "write a number",
    "bool_type": "write true or false",
    "string_type": "write a string (quote it)",
    "list_type": "write a YAML list",
    "dict_type": "write a mapping",
    "model_type": "write a mapping of keys",
    "model_attributes_type": "write a mapping of keys",
    "too_short": "add items",
    "too_long": "remove items",
    "int_parsing": "write a whole number",
    "float_parsing": "write a number",
    "auto_int": "write a whole number or auto",
    "node_count": "write e.g. 4, or a range such as '4-8'",
    "zero_stage": "write 0, 1, 2, 3 or auto",
    "slurm_time": "write e.g. '04:00:00'",
    "env_name": "rename the variable",
    "env_executes": ENV_FIX,
    "sbatch_option": "write the option name only, e.g. mail-type",
    "free_text": "write a non-empty string",
    "lora_target": "use wq wk wv wo w1 w2 w3 (or q_proj k_proj v_proj o_proj gate_proj down_proj up_proj)",
}


def _describe(err: Mapping[str, Any], path: Path) -> tuple[str, str]:
    """(what is wrong, how to fix) for one pydantic error."""
    import difflib  # only for an error's did-you-mean: a valid job never loads it

    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        model = _model_at(path[:-1])
        valid = _keys_of(model) if model else []
        close = difflib.get_close_matches(path[-1], valid, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
        return "unknown key", hint
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        close = difflib.get_close_matches(str(err.get("input")), [s.strip(" '") for s in
                                          expected.replace(" or ", ",").split(",")], n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return "not one of the allowed values", f"{hint}use one of: {expected}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return err["msg"].replace("Input should be", "must be"), "change the value to fit the range"
    if kind == "missing":
        return "is required", f"add `{path[-1]}:`"
    return err["msg"].rstrip(".").replace("Input should be", "must be"), _FIXES.get(kind, "see `hpctrain schema` for the expected type")


def _format(source: Source, path: Path, message: str, got: Any, fix: str, with_got: bool = True) -> str:
    dotted = ".".join(path) if path else "(document)"
    got_text = f" (got {_short(got)})" if with_got else ""
    return f"{source.locate(path)}: {dotted}: {message}{got_text}; {fix}"


def _pydantic_lines(exc: ValidationError, source: Source) -> list[str]:
    located = []
    for err in exc.errors(include_url=False):
        path = tuple(str(p) for p in err["loc"])
        message, fix = _describe(err, path)
        located.append((_line_of(source, path), _format(source, path, message, err.get("input"), fix,
                                                         err["type"] != "missing")))
    return [line for _, line in sorted(located, key=lambda item: item[0])]


def _line_of(source: Source, path: Path) -> int:
    where = source.locate(path)
    return int(where.rsplit(":", 1)[1]) if not where.startswith("--set") and where.rsplit(":", 1)[1].isdigit() else 1 << 30


def _problem_line(problem: Problem, source: Source) -> str:
    path = tuple(problem.path.split("."))
    return _format(source, path, problem.message, problem.got, problem.fix)


def schema_problems(data: dict[str, Any], source: Source) -> list[str]:
    """The schema's (pydantic's) problems alone, without the cross-field rules: [] when the data fits."""
    try:
        Job.model_validate(data)
    except ValidationError as exc:
        return _pydantic_lines(exc, source)
    return []


def validate_data(data: dict[str, Any], source: Source) -> Job:
    """Validate plain data against the schema and the cross-field rules."""
    try:
        job = Job.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_lines(exc, source) + _problems_besides_unknown_keys(data, exc, source)) from None
    job = restart_aliases(job, source)
    problems = cross_field_problems(job)
    if problems:
        raise ConfigError([_problem_line(p, source) for p in problems])
    return job


def _problems_besides_unknown_keys(data: dict[str, Any], exc: ValidationError, source: Source) -> list[str]:
    """When unknown keys (typos) are the schema's only complaint, the cross-field problems (the layout:
    tp and heads, the batch, ...) of the job without them, so that one run of `validate` shows both."""
    errors = exc.errors(include_url=False)
    if not errors or any(err["type"] != "extra_forbidden" for err in errors):
        return []
    import copy

    rest = copy.deepcopy(data)
    for err in errors:
        node: Any = rest
        for part in err["loc"][:-1]:
            node = node.get(str(part)) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(str(err["loc"][-1]), None)
    try:
        job = restart_aliases(Job.model_validate(rest), source)
    except (ValidationError, ConfigError):
        return []
    return [_problem_line(p, source) for p in cross_field_problems(job)]


_NOTICED: set[str] = set()  # each notice once per process (a command loads its job more than once)


def restart_aliases(job: Job, source: Source) -> Job:
    """slurm.requeue / max_requeues / signal / signal_seconds, the restart policy's old names: read as
    restart.*, each with a one-line notice on stderr; both names with different values is a ConfigError."""
    moved: dict[str, Any] = {}
    moved_by_set: list[str] = []
    for name in RESTART_ALIASES:
        old = getattr(job.slurm, name)
        if old is None:
            continue
        new = getattr(job.restart, name)
        if ("restart", name) in source.overrides and ("slurm", name) not in source.overrides:
            moved_by_set.append(name)  # `--set restart.NAME=...` overrides the file's old name
            continue
        if name in job.restart.model_fields_set and new != old:
            raise ConfigError(f"{source.locate(('slurm', name))}: slurm.{name}={old} and restart.{name}={new} "
                              f"disagree: slurm.{name} is the old name of restart.{name}; keep restart.{name} only")
        moved[name] = old
        notice = f"notice: slurm.{name} is now restart.{name} (read as restart.{name}={old})"
        if notice not in _NOTICED:
            _NOTICED.add(notice)
            print(notice, file=sys.stderr, flush=True)
    if not moved and not moved_by_set:
        return job
    restart = job.restart.model_copy(update=moved)
    slurm = job.slurm.model_copy(update={name: None for name in [*moved, *moved_by_set]})
    return job.model_copy(update={"restart": restart, "slurm": slurm})


def load_job(path: str, overrides: Sequence[str] = ()) -> Job:
    """Read job.yaml, apply `--set` overrides, make its paths absolute (config/paths.py says against which
    folder), validate. Raises ConfigError (exit 2) listing every problem."""
    return load_job_with_source(path, overrides)[0]


def load_job_with_source(path: str, overrides: Sequence[str] = ()) -> tuple[Job, Source]:
    """load_job, plus where each value came from (to place later checks' messages at a line)."""
    data, source = read_yaml_file(path)
    apply_overrides(data, list(overrides), source)
    resolve_data_paths(data, path, source.overrides)
    return validate_data(data, source), source


def locate_problem(line: str, source: Source) -> str:
    """Prefix a `dotted.path: message` line from a later stage with its FILE:LINE (or --set)."""
    dotted = line.split(":", 1)[0]
    return f"{source.locate(tuple(dotted.split('.')))}: {line}"


def job_from_dict(data: dict[str, Any], overrides: Sequence[str] = (), origin: str = "<dict>") -> Job:
    """Validate a job given as a dict (tests, sweeps). Same rules and messages as load_job."""
    import copy

    source = Source(origin)
    data = apply_overrides(copy.deepcopy(data), list(overrides), source)
    return validate_data(data, source)
