"""Config: the job.yaml schema, loading with line-numbered errors, `--set` overrides, JSON schema export."""

from __future__ import annotations

import os
from typing import Any

# Building the schema's ~30 models asks pydantic for its plugins, and its first ask reads the entry points of
# every installed distribution (~5 ms of `hpctrain validate` with this project's environment, more in a
# bigger one; issue 23 item 8). hpctrain's models take no pydantic plugin, so they are built with plugins
# off: pydantic reads PYDANTIC_DISABLE_PLUGINS at each model build, and the variable is put back as it was
# (or removed) before this import returns, so neither later models, os.environ nor a child process sees it.
_PLUGINS_SETTING = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
try:
    from hpctrain.config.job import Job, Problem, cross_field_problems
    from hpctrain.config.loader import job_from_dict, load_job
    from hpctrain.config.model import PRESETS, ModelConfig
finally:
    if _PLUGINS_SETTING is None:
        del os.environ["PYDANTIC_DISABLE_PLUGINS"]
    else:
        os.environ["PYDANTIC_DISABLE_PLUGINS"] = _PLUGINS_SETTING
    del _PLUGINS_SETTING

__all__ = ["Job", "ModelConfig", "PRESETS", "Problem", "cross_field_problems", "dump_job", "job_from_dict",
           "job_to_dict", "json_schema", "load_job"]


def job_to_dict(job: Job) -> dict[str, Any]:
    """Plain data of a job, with YAML key names ("async"), ready to dump or to re-validate."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)


def dump_job(job: Job) -> str:
    """The job as YAML text (the format of job.resolved.yaml)."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # same text, ~4x faster (sweeps dump many jobs)
    return yaml.dump(job_to_dict(job), Dumper=dumper, sort_keys=False, allow_unicode=True, width=120)


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of job.yaml, for editors (yaml-language-server) and checks."""
    import json  # here, not at the top: validate and render never need it

    schema = Job.model_json_schema(by_alias=True, mode="validation")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "hpctrain job"}
    json.dumps(schema)  # fail here, not in a user's editor, if something is not serialisable
    return schema
