"""The base of every schema section: unknown keys are errors, types are strict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A job.yaml section. Unknown keys are rejected (with a did-you-mean), values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, validate_default=False)
