"""The base of every schema section: unknown keys are errors, types are strict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A job.yaml section. Unknown keys are rejected (with a did-you-mean), values are not coerced."""

    # allow_inf_nan=False: a bound such as `gt=0` lets inf through, and NaN compares false to everything.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, validate_default=False,
                              allow_inf_nan=False)


# default_factory for list and dict fields, and `lambda: Section()` rather than `Section` for a section's: pydantic
# reads each factory's signature (whether it takes the validated data), and a plain function's costs nothing,
# where list's and dict's are parsed from text (inspect's tokenizer, ~1.5 ms the first time) and a model
# class's is built from its fields (issue 23 item 8). The values are the same: a new empty list, dict, section.
def new_list() -> list[Any]:
    return []


def new_dict() -> dict[Any, Any]:
    return {}
