"""DCP's save planner, serialising each distinct plain value once.

The flattened optimizer state dict (checkpointer.OPTIONS) holds, beside the tensors, every parameter
group setting once per parameter: `param_groups.<name>.lr`, `.betas`, `.eps`, `.weight_decay`, ... (12 for
AdamW), three quarters of the items of a save. DCP's DefaultSavePlanner turns each such value into bytes
with its own `torch.save` (default_planner.py `transform_object`, the documented extension point), ~40 us
apiece: ~20 ms of the 4-layer benchmark's ~90 ms `dcp.save` (bench/torchtitan_compare.py ckpt-1, issue 23
item 8), and more on a model with more parameters. Here equal values (the same type and repr) share one
`torch.save` output: the bytes written, the index and the way they load are the ones the default planner
gives.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

_SCALARS = (bool, int, float, str, type(None))


def _memo_key(value: Any) -> tuple[type, str] | None:
    """(type, repr) of a plain scalar or a flat tuple/list of them (repr tells 1, 1.0 and True apart); None
    for anything else, which is serialised as the default planner does."""
    if type(value) in _SCALARS or (type(value) in (tuple, list) and all(type(v) in _SCALARS for v in value)):
        return type(value), repr(value)
    return None


class SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with each distinct plain value serialised once per save (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._serialised: dict[tuple[type, str], bytes] = {}

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's own name
        key = _memo_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        if key not in self._serialised:
            self._serialised[key] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(self._serialised[key])
