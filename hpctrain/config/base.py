"""The base of every schema section: unknown keys are errors, types are strict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A job.yaml section. Unknown keys are rejected (with a did-you-mean), values are not coerced."""

    # allow_inf_nan=False: a bound such as `gt=0` lets inf through, and NaN compares false to everything.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, validate_default=False,
                              allow_inf_nan=False)
