"""Garbage collection under the trainer's control (issue 12 item 9): the cyclic collector is off
for the whole loop (so it can never run inside a step or inside `dcp.save`), a full collection
runs right before each checkpoint save, and collection is back on afterwards. One process, in
this process (gc.callbacks see every collection, automatic or explicit)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hpctrain.config import job_from_dict  # noqa: E402
from hpctrain.runtime.distributed import DistEnv  # noqa: E402

from ._entry import make_job  # noqa: E402


def test_collections_only_before_saves_and_never_inside_one(tmp_path, monkeypatch) -> None:
    from hpctrain.runtime.checkpoint import checkpointer as checkpoint_module
    from hpctrain.runtime.trainer import Trainer

    monkeypatch.setenv("HPCTRAIN_FINAL_CHECKPOINT", "0")
    job = job_from_dict(make_job(train={"steps": 4}, checkpoint={"every_steps": 2, "keep_last": 3}))
    trainer = Trainer(job, str(tmp_path), torch.device("cpu"), DistEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    events: list[tuple[int, bool, bool]] = []  # (step, inside a save, gc enabled) per collection
    state: dict[str, Any] = {"saving": False}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            events.append((trainer.step, state["saving"], gc.isenabled()))

    real_save = checkpoint_module.dcp.save

    def observed_save(*args: Any, **kwargs: Any) -> Any:
        # Only marks the window of the real dcp.save; the save itself runs unchanged.
        state["saving"] = True
        try:
            return real_save(*args, **kwargs)
        finally:
            state["saving"] = False

    monkeypatch.setattr(checkpoint_module.dcp, "save", observed_save)
    gc.callbacks.append(on_gc)
    try:
        trainer.train()
    finally:
        gc.callbacks.remove(on_gc)
        trainer.close()
    assert gc.isenabled()
    assert not [e for e in events if e[1]], f"collections inside dcp.save: {events}"
    trainer_collections = [(step, enabled) for step, saving, enabled in events if not saving]
    # One before the loop (step 0), one before each save (steps 2 and 4); none anywhere else.
    assert sorted({step for step, _ in trainer_collections}) == [0, 2, 4], events
    assert not any(enabled for step, enabled in trainer_collections if step > 0), events
