"""Tiny resolved jobs and deterministic batches for runtime tests (2 CPU cores: keep them small)."""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.config import job_from_dict

TINY_MODEL: dict[str, Any] = {
    "layers": 4,
    "hidden": 32,
    "heads": 4,
    "kv_heads": 2,
    "ffn_hidden": 64,
    "vocab": 64,
    "seq_len": 16,
}


def tiny_job(
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    cp: int = 1,
    cp_rotate: str = "allgather",
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    zero: int = 0,
    sequence_parallel: bool = False,
    offload_optimizer: bool = False,
    micro_batch: int = 1,
    global_batch: int = 8,
    precision: str = "fp32",
    ac: str = "none",
    optimizer: str = "sgd",
    lr: float = 0.5,
    seed: int = 1234,
    stage_layers: list[list[int]] | None = None,
    train: dict[str, Any] | None = None,
    **model: Any,
) -> Any:
    """A resolved job (no 'auto' left) for the tiny model; `model` overrides TINY_MODEL fields, `train` adds
    train-section fields."""
    placement = {"stage_layers": stage_layers or [], "rank_order": None}
    return job_from_dict(
        {
            "placement": placement,
            "name": "runtime-test",
            "model": {"preset": None, **TINY_MODEL, **model},
            "train": {
                "global_batch": global_batch,
                "micro_batch": micro_batch,
                "precision": precision,
                "activation_checkpointing": ac,
                "optimizer": {"name": optimizer, "lr": lr},
                "seed": seed,
                **(train or {}),
            },
            "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": tp * pp * dp * cp},
            "parallel": {
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "ep": ep,
                "cp": cp,
                "cp_rotate": cp_rotate,
                "schedule": schedule,
                "virtual_stages": virtual_stages,
                "zero": zero,
                "sequence_parallel": sequence_parallel,
                "offload_optimizer": offload_optimizer,
            },
        }
    )


def global_batch(step: int, batch: int = 8, seq_len: int = 16, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the whole global batch for `step`, [batch, seq_len] int64 each."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def dp_slice(tensor: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """This dp rank's contiguous share of the global batch."""
    local = tensor.shape[0] // dp
    return tensor[dp_rank * local : (dp_rank + 1) * local]
