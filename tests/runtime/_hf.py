"""Tiny random Llama models saved with the real `transformers` (offline), and jobs that start from them.

`transformers` takes seconds to import: only the tests that need it import this module's helpers,
and the models are built once per test session (`hf_models`, a session fixture in the test modules).
"""

from __future__ import annotations

import os
from typing import Any

import torch

# 2 layers, hidden 64, 4 query heads over 2 kv heads (GQA): every layout of the tests divides it.
SHAPE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8}
SEQ_LEN = 16
VARIANTS: dict[str, dict[str, Any]] = {
    "untied": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "tied": dict(tie_word_embeddings=True, rope_theta=10000.0),
    # rope_theta 500 and an original context of 8: the scaling changes the angles at these short lengths
    "llama3": dict(tie_word_embeddings=False, rope_theta=500.0, rope_scaling=LLAMA3_SCALING),
}


def save_llama(folder: str, seed: int = 0, max_shard_size: str | None = None, **config: Any) -> str:
    """A random LlamaForCausalLM (norm gains randomised too, so a swapped norm shows) saved in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**SHAPE, **config})
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


_MODELS: dict[str, dict[str, str]] = {}


def saved_models(root: str) -> dict[str, str]:
    """The VARIANTS saved once per test session (test modules share them: saving needs transformers,
    whose import is the slow part)."""
    if not _MODELS:
        _MODELS["folders"] = {name: save_llama(os.path.join(root, name), seed=i, **cfg)
                              for i, (name, cfg) in enumerate(VARIANTS.items())}
    return _MODELS["folders"]


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def tokens(batch: int = 4, seq_len: int = SEQ_LEN, vocab: int = 128, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def hf_job_dict(folder: str, tp: int = 1, pp: int = 1, dp: int = 1, **train: Any) -> dict[str, Any]:
    return {
        "name": "hf-test",
        "placement": {"stage_layers": [], "rank_order": None},
        "model": {"init_from": folder, "seq_len": SEQ_LEN},
        "train": {"global_batch": 4, "micro_batch": 2 if dp == 1 else 1, "precision": "fp32",
                  "activation_checkpointing": "none", "optimizer": {"name": "sgd", "lr": 0.1}, **train},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": tp * pp * dp, "gpu": "cpu"},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "schedule": "1f1b", "virtual_stages": 1, "zero": 3},
    }


def runtime_logits(training: Any, batch: torch.Tensor) -> torch.Tensor | None:
    """The runtime's logits for `batch` through this rank's stage (pipeline stages hand hidden states
    on with send/recv); the full logits on last-stage ranks, None elsewhere. Every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    part = training.model_parts[0]
    part.eval()
    with torch.no_grad():
        if not training.dims.pp_enabled:
            out = part(batch)
        else:
            grid = training.mesh.mesh
            pp, dp, tp = (training.mesh.get_local_rank(n) for n in ("pp", "dp", "tp"))
            if pp == 0:
                h = part(batch)
            else:
                received = torch.empty(batch.shape[0], batch.shape[1], training.args.hidden)
                dist.recv(received, src=int(grid[pp - 1, dp, tp]))
                h = part(received)
            if pp < training.dims.pp - 1:
                h = h.full_tensor() if isinstance(h, DTensor) else h
                dist.send(h.contiguous(), dst=int(grid[pp + 1, dp, tp]))
                return None
            out = h
    return out.full_tensor() if isinstance(out, DTensor) else out


def local_bytes(training: Any) -> int:
    """fp32 bytes of this rank's parameter shards (what it must read from an fp32 folder)."""
    from hpctrain.runtime.parallel.precision import local_tensor

    seen: dict[int, int] = {}
    for part in training.model_parts:
        for p in part.parameters():
            seen[id(p)] = local_tensor(p).numel() * 4
    return sum(seen.values())


def folder_of(root: str, variant: str) -> str:
    return os.path.join(root, variant)
