"""train.embedding_on_cpu and train.attention_kernel in the runtime (issue 27 items 2 and 3).

The dp4 host-embedding layout's parity with the on-device single process runs with the fp8 layouts
(test_fp8.py, one 4-process group). Device memory: on a CUDA machine MemTracker's device snapshot must drop by
the table's parameters + gradients + AdamW states; on a CPU-only machine host and device are the same memory,
so there the test checks where each of those tensors lives and the planner's count (tests/plan).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpctrain.runtime.parallel.build import build_training

from ._entry import losses, make_job, metrics, run_entry
from ._jobs import global_batch, tiny_job

VOCAB = 1024


def _train(job: Any, device: torch.device, steps: int = 4) -> tuple[list[float], Any, Any]:
    training = build_training(job, device)
    optimizer = torch.optim.AdamW(training.parameters(), lr=1e-2, foreach=False)
    got = []
    for step in range(steps):
        inputs, labels = global_batch(step, vocab=VOCAB)
        optimizer.zero_grad()
        got.append(training.train_step(inputs, labels))
        training.optimizer_step(optimizer)
    return got, training, optimizer


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_host_embedding_trains_like_the_device_one(precision) -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    job = tiny_job(vocab=VOCAB, precision=precision, optimizer="adamw", lr=1e-2)
    host_job = tiny_job(vocab=VOCAB, precision=precision, optimizer="adamw", lr=1e-2, train={"embedding_on_cpu": True})
    want, _, _ = _train(job, device)
    got, training, optimizer = _train(host_job, device)
    assert max(abs(a - b) for a, b in zip(want, got)) <= 1e-5, (want, got)
    table = training.model_parts[0].tok_embeddings.weight
    state = optimizer.state[table]
    assert {t.device.type for t in (table, table.grad, state["exp_avg"], state["exp_avg_sq"])} == {"cpu"}
    others = {p.device for n, p in training.model_parts[0].named_parameters() if not n.startswith("tok_embeddings")}
    assert others == {device}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: on the CPU, host and device memory "
                    "are one (the planner's count of the drop is tested in tests/plan/test_memory_levers.py)")
def test_host_embedding_frees_its_states_from_the_device() -> None:  # pragma: no cover - GPU machines only
    from torch.distributed._tools.mem_tracker import MemTracker

    device = torch.device("cuda", 0)

    def after_step(host: bool) -> dict[str, int]:
        job = tiny_job(vocab=VOCAB, optimizer="adamw", train={"embedding_on_cpu": host})
        _, training, optimizer = _train(job, device, steps=1)
        tracker = MemTracker()
        tracker.track_external(*training.model_parts, optimizer)
        with tracker:
            pass
        snapshot = tracker.get_tracker_snapshot()
        return {str(getattr(k, "name", k)): v for k, v in snapshot.get(device, {}).items()}

    on_device, on_host = after_step(False), after_step(True)
    table_bytes = VOCAB * 32 * 4
    assert on_device["PARAM"] - on_host["PARAM"] == table_bytes
    assert on_device["GRAD"] - on_host["GRAD"] == table_bytes
    assert on_device["OPT"] - on_host["OPT"] == 2 * table_bytes


def test_math_and_flash_attention_agree_and_are_recorded(tmp_path) -> None:
    runs = {}
    for kernel in ("math", "flash"):
        run = str(tmp_path / kernel)
        assert run_entry(make_job(train={"steps": 4, "attention_kernel": kernel}), run) == [0]
        runs[kernel] = run
        assert {m["attention_kernel"] for m in metrics(run)} == {kernel}
    want, got = losses(runs["math"]), losses(runs["flash"])
    assert max(abs(a - b) for a, b in zip(want, got)) <= 1e-4, (want, got)


def test_attention_kernel_selects_the_sdpa_backend(monkeypatch) -> None:
    """The kernel the job names is the one SDPA may use: math alone lets no fused kernel run."""
    import torch.nn.functional as F

    seen: list[bool] = []
    original = F.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for kernel, flash_allowed in (("math", False), ("flash", True)):
        seen.clear()
        job = tiny_job(precision="bf16", train={"attention_kernel": kernel})
        training = build_training(job, torch.device("cpu"))
        training.train_step(*global_batch(0))
        assert seen and set(seen) == {flash_allowed}, kernel
