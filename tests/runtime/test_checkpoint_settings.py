"""runtime/checkpoint/settings.py: each parameter's optimizer settings saved as one DCP entry; checkpoints that
keep one entry per setting (saved before) load as they are."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from hpctrain.config import job_from_dict  # noqa: E402
from hpctrain.runtime.checkpoint import settings  # noqa: E402
from hpctrain.runtime.checkpoint.checkpointer import Checkpointer  # noqa: E402
from hpctrain.runtime.optim import build_optimizers  # noqa: E402
from hpctrain.runtime.parallel.build import build_training  # noqa: E402

from ._entry import make_job  # noqa: E402


def test_group_and_ungroup_are_inverse_and_leave_a_tuple_setting_alone() -> None:
    flat = {"state.w.step": torch.tensor(1.0), "param_groups.layers.0.w.lr": 1e-3,
            "param_groups.layers.0.w.betas": (0.9, 0.95), "param_groups.layers.0.w.foreach": None,
            "param_groups.b.lr": 2e-3}
    grouped = settings.group(flat)
    assert set(grouped) == {"state.w.step", "param_groups.layers.0.w", "param_groups.b"}
    assert grouped["param_groups.layers.0.w"] == (("lr", 1e-3), ("betas", (0.9, 0.95)), ("foreach", None))
    assert settings.ungroup(grouped) == flat
    assert settings.ungroup(flat) == flat  # one entry per setting (betas a tuple of numbers) stays as it is


def _trainer_parts(job: dict) -> tuple:
    resolved = job_from_dict(job)
    training = build_training(resolved, torch.device("cpu"), initialise=True)
    optimizers, _ = build_optimizers(resolved, training.model_parts)
    return resolved, training, optimizers


def _step(training, optimizers) -> None:
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    optimizers.zero_grad()
    training.forward_backward(tokens, tokens)
    optimizers.step()


def _optimizer_state(optimizers) -> list:
    out = []
    for opt in optimizers:
        sd = opt.state_dict()
        out.append(([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
                    {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}))
    return out


def _same(a: list, b: list) -> None:
    for (groups_a, state_a), (groups_b, state_b) in zip(a, b):
        assert groups_a == groups_b
        assert state_a.keys() == state_b.keys()
        for i in state_a:
            assert all(torch.equal(state_a[i][k], state_b[i][k]) for k in state_a[i])


def test_a_save_keeps_one_entry_per_parameter_and_both_forms_load(tmp_path, monkeypatch) -> None:
    job = make_job(train={"optimizer": {"lr": 0.02, "weight_decay": 0.1}})
    resolved, training, optimizers = _trainer_parts(job)
    _step(training, optimizers)
    for group in list(optimizers)[0].param_groups:
        group["lr"] = 0.0123  # what an LR schedule leaves: the checkpoint's value must come back
    want = _optimizer_state(optimizers)
    run = str(tmp_path / "run")
    os.makedirs(run)
    saver = Checkpointer(resolved, run, training.model_parts, optimizers)
    assert saver.save(1, {"data": {}}, force=True)
    monkeypatch.setattr(settings, "group", lambda optim: optim)  # the form saved before settings.py
    assert saver.save(2, {"data": {}}, force=True)
    monkeypatch.undo()
    saver.wait()

    def keys(step: int) -> set:
        path = os.path.join(run, "checkpoints", f"step-{step}")
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)

    names = [name for name, _ in training.model_parts[0].named_parameters()]
    assert {k for k in keys(1) if k.startswith("optim.param_groups.")} == {f"optim.param_groups.{n}" for n in names}
    assert f"optim.param_groups.{names[0]}.lr" in keys(2)

    for step in (1, 2):
        _, fresh, fresh_optimizers = _trainer_parts(job)
        loader = Checkpointer(resolved, run, fresh.model_parts, fresh_optimizers)
        body = loader.load(os.path.join(run, "checkpoints", f"step-{step}"))
        assert body["step"] == step
        _same(_optimizer_state(fresh_optimizers), want)
