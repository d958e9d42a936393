"""Config: the job.yaml schema, loading with line-numbered errors, `--set` overrides, JSON schema export.

The modules that define models are written without `from __future__ import annotations`: pydantic would
compile and evaluate each field's annotation string (~200 of them, ~2 % of `hpctrain validate`; issue 23
item 8). Optional sections of their own (kubernetes, entrypoint, model.moe, train.lora) are built on first
use (lazy.py).
"""

from __future__ import annotations

from typing import Any

from hpctrain.config.plugins_off import collector_paused, pydantic_plugins_off, secrets_on_first_use

# The models of the schema are built here, plugins off, `secrets` loaded on first use and the collector paused
# (config/plugins_off.py).
with pydantic_plugins_off(), secrets_on_first_use(), collector_paused():
    from hpctrain.config.job import Job, Problem, cross_field_problems
    from hpctrain.config.loader import job_from_dict, load_job
    from hpctrain.config.model import PRESETS, ModelConfig

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

    from hpctrain.config.lazy import SchemaGenerator

    schema = Job.model_json_schema(by_alias=True, mode="validation", schema_generator=SchemaGenerator)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "hpctrain job"}
    json.dumps(schema)  # fail here, not in a user's editor, if something is not serialisable
    return schema
