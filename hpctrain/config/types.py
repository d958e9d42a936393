"""Reusable field types: integers that may be "auto", bounded numbers, names, with clean one-line errors.

pydantic reports a union such as ``int | Literal["auto"]`` as one error per branch; these plain
validators report one error with our own wording instead, and keep a precise JSON schema.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

AUTO = "auto"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def auto_int(minimum: int, maximum: int) -> Any:
    """An integer in [minimum, maximum], or the string "auto" (filled in by the planner)."""

    def check(value: Any) -> Union[int, str]:
        if value == AUTO:
            return AUTO
        if not _is_int(value):
            raise PydanticCustomError("auto_int", f"expected an integer >= {minimum} or 'auto'")
        if value < minimum:
            raise PydanticCustomError("auto_int", f"must be >= {minimum} or 'auto'")
        if value > maximum:
            raise PydanticCustomError("auto_int", f"must be <= {maximum} or 'auto'")
        return int(value)

    schema = {"anyOf": [{"type": "integer", "minimum": minimum, "maximum": maximum}, {"const": AUTO}]}
    return Annotated[Union[int, Literal["auto"]], PlainValidator(check), WithJsonSchema(schema)]

ZeroStage = Annotated[
    Union[int, Literal["auto"]],
    PlainValidator(lambda v: _zero_stage(v)),
    WithJsonSchema({"anyOf": [{"enum": [0, 1, 2, 3]}, {"const": AUTO}]}),
]


def _zero_stage(value: Any) -> Union[int, str]:
    if value == AUTO:
        return AUTO
    if _is_int(value) and value in (0, 1, 2, 3):
        return int(value)
    raise PydanticCustomError("zero_stage", "expected one of 0, 1, 2, 3 or 'auto'")


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$|^(\d+)$")


# Slurm stores a time limit in minutes as uint32; a job asking for more than a year is a typo, and
# bounding it keeps every figure derived from it (the py-spy delay, the requeue budget) ordinary.
MAX_SLURM_TIME_S = 366 * 24 * 3600


def slurm_time_seconds(text: str) -> int:
    """Seconds in a Slurm time string ("MINUTES", "HH:MM:SS" or "D-HH:MM:SS")."""
    match = _SLURM_TIME.match(text)
    if not match:
        raise ValueError(text)
    days, hours, minutes, seconds, only_minutes = match.groups()
    if only_minutes is not None:
        return int(only_minutes) * 60
    return ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)


def _slurm_time(value: Any) -> str:
    text = None
    if _is_int(value) and value > 0:
        text = str(value)
    elif isinstance(value, str) and len(value) <= 32 and _SLURM_TIME.match(value):
        _, _, minutes, seconds, _ = _SLURM_TIME.match(value).groups()  # type: ignore[union-attr]
        if minutes is None or (int(minutes) < 60 and int(seconds) < 60):
            text = value
    if text is None:
        raise PydanticCustomError("slurm_time", "expected a Slurm time such as '04:00:00', '2-00:00:00' or minutes")
    if slurm_time_seconds(text) > MAX_SLURM_TIME_S:
        raise PydanticCustomError("slurm_time", "is longer than 366 days")
    return text


SlurmTime = Annotated[
    str,
    PlainValidator(_slurm_time),
    WithJsonSchema({"anyOf": [{"type": "string", "pattern": _SLURM_TIME.pattern, "maxLength": 32},
                              {"type": "integer", "minimum": 1, "maximum": MAX_SLURM_TIME_S // 60}]}),
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

# nccl.env is data: it tunes the communication libraries and must not change which programs or
# libraries run. An ALLOW-list, not a deny-list: bash, glibc, Python, CUDA, MPI and each loader read
# their own names (PATH, LD_PRELOAD, BASH_ENV, ENV, PYTHONPATH, GCONV_PATH, PERL5LIB, ...), and a
# deny-list misses the next one; the prefixes of the libraries this section exists for are a closed set.
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "TP_", "UCX_", "FI_", "NVSHMEM_",
                "CUDA_", "PYTORCH_CUDA_", "MLX5_", "HCOLL_", "SHARP_", "OMP_")
# Names within those prefixes that load code: NCCL's net/tuner/profiler plugins, libfabric's provider
# folder, UCX's module folder, CUDA's injection library, OpenMP tools, NCCL's config file (it can name a
# plugin), and any *_PATH / *_DIR search path.
_LOADS_CODE = re.compile(r"PLUGIN|INJECTION|LIBRAR|CONF_FILE|_TOOL|_PATH$|_DIRS?$|_LIBS?$")
ENV_FIX = ("put it in slurm.setup instead (those lines are shell by design), e.g. "
           "`export NAME=value`; nccl.env takes names starting with " + ", ".join(ENV_PREFIXES))
EnvName = Annotated[str, PlainValidator(lambda v: _env_name(v)), WithJsonSchema({"type": "string", "pattern": _ENV_NAME.pattern})]


def _env_name(value: Any) -> str:
    if not (isinstance(value, str) and _ENV_NAME.match(value)):
        raise PydanticCustomError("env_name", "an environment variable name must match [A-Za-z_][A-Za-z0-9_]* "
                                  "(at most 128 characters)")
    if not value.startswith(ENV_PREFIXES) or _LOADS_CODE.search(value):
        raise PydanticCustomError("env_executes", "is not a communication-library setting, or it chooses code "
                                  "to load (a search path, a plugin); nccl.env values are data")
    return value


_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")
SbatchOption = Annotated[
    str, PlainValidator(lambda v: _sbatch_option(v)), WithJsonSchema({"type": "string", "pattern": _SBATCH_OPTION.pattern})
]


def _sbatch_option(value: Any) -> str:
    if isinstance(value, str) and _SBATCH_OPTION.match(value):
        return value
    raise PydanticCustomError("sbatch_option", "an sbatch option is a long option name without dashes, e.g. 'mail-type'")


def _free_text(value: Any) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("free_text", "expected a string")
    if "\x00" in value:
        raise PydanticCustomError("free_text", "must not contain a NUL character")
    if not value:
        raise PydanticCustomError("free_text", "must not be empty")
    if len(value) > 4096:
        raise PydanticCustomError("free_text", "is longer than 4096 characters")
    return value


Text = Annotated[str, PlainValidator(_free_text), WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 4096})]
