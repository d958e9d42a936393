"""DCP loading that never runs code from the checkpoint folder (issue 18 finding 4, the same class).

torch.distributed.checkpoint reads its index `.metadata` with a plain `pickle.load`, and the default
load planner reads the non-tensor entries (the optimizer's lr, betas, ...) with
`torch.load(weights_only=False)`. A checkpoint folder may be shared and writable by others, so both
go through restricted loaders here: the index may hold only DCP's own metadata classes, torch sizes,
dtypes and layouts and paths; the entries only what `weights_only=True` accepts.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hpctrain.rundir.checkpoints import DCP_METADATA_FILE

_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict")}


class UnsafeIndex(Exception):
    """A DCP index that holds something other than checkpoint metadata."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _CLASS_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # DCP's dataclasses and enums, never one of its functions
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                             torch.memory_format)):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeIndex(f"the DCP index {DCP_METADATA_FILE} refers to {module}.{name}, which is not "
                          "checkpoint metadata")


def read_index(path: str) -> Metadata:
    """The DCP index of checkpoint folder path, unpickled with the allow-list; UnsafeIndex otherwise."""
    with open(os.path.join(path, DCP_METADATA_FILE), "rb") as handle:
        try:
            metadata = _IndexUnpickler(handle).load()
        except UnsafeIndex:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged index, whatever the unpickler says
            raise UnsafeIndex(f"the DCP index {DCP_METADATA_FILE} is unreadable ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeIndex(f"the DCP index {DCP_METADATA_FILE} is not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank index files: not written by hpctrain's saves
            raise UnsafeIndex("per-rank DCP index files are not supported")
        metadata = read_index(str(self.path))
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
