"""A sync save blocks training for the DCP write only; its finalize (manifest, metadata, rename,
prune) runs in a thread, completed at the next save or at `wait()` (issue 12 item 9). Until then the
previous checkpoint stays the latest valid one; a finalize that fails raises at `wait()`."""

from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hpctrain.runtime.checkpoint.checkpointer as checkpoint
from hpctrain.runtime.checkpoint.checkpointer import CheckpointSaveError, Checkpointer, read_metadata, scan


def _checkpointer(tmp_path: Any, events: list[tuple[str, dict[str, Any], str]]) -> Checkpointer:
    model = torch.nn.Linear(4, 4)
    job = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path / "ckpt"), every_steps=1, keep_last=1,
                                                     async_=False))
    return Checkpointer(job, str(tmp_path), [model], [torch.optim.SGD(model.parameters(), lr=0.1)],
                        event=lambda name, **f: events.append((name, f, threading.current_thread().name)))


def test_until_the_finalize_completes_the_previous_checkpoint_is_the_latest(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, dict[str, Any], str]] = []
    ckpt = _checkpointer(tmp_path, events)
    assert ckpt.save(1, {"n": 1})
    ckpt.wait()
    # Hold the finalize of step 2 just before its metadata is written (a crash there cannot be placed
    # on demand otherwise): what a crash between the data write and the finalize leaves on disk.
    release, held = threading.Event(), threading.Event()
    write_metadata = checkpoint.write_metadata

    def held_write(folder: str, body: dict[str, Any]) -> None:
        held.set()
        assert release.wait(10)
        write_metadata(folder, body)

    monkeypatch.setattr(checkpoint, "write_metadata", held_write)
    assert ckpt.save(2, {"n": 2})  # returns while the finalize is held
    assert held.wait(10)
    found = scan(ckpt.folder)
    assert [step for step, _ in found.complete] == [1]
    assert [os.path.basename(path) for path, _ in found.rejected] == ["step-2.partial"]
    assert [name for name, _, _ in events] == ["checkpoint saved"]  # step 1's only
    release.set()
    ckpt.wait()
    assert [step for step, _ in scan(ckpt.folder).complete] == [2]  # step 1 pruned after step 2 completed
    assert read_metadata(os.path.join(ckpt.folder, "step-2"))["n"] == 2
    name, fields, thread = events[-1]
    assert (name, fields["step"], thread) == ("checkpoint saved", 2, threading.current_thread().name)
    assert fields["duration_s"] == fields["blocking_s"] <= fields["finalized_after_s"]


def test_a_finalize_that_fails_raises_once_at_wait(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, dict[str, Any], str]] = []
    ckpt = _checkpointer(tmp_path, events)

    def full_disk(folder: str, body: dict[str, Any]) -> None:  # a full disk cannot be had on demand
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_metadata", full_disk)
    assert ckpt.save(1, {"n": 1})
    with pytest.raises(CheckpointSaveError, match=r"^no space left on device while saving checkpoint step 1 to "):
        ckpt.wait()
    assert os.listdir(ckpt.folder) == []  # the partial folder removed, nothing counted as complete
    assert [(name, thread) for name, _, thread in events] == [("checkpoint failed", threading.current_thread().name)]
    ckpt.wait()  # raised once: the next save starts clean
