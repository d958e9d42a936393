"""`model.init_from`: a local Hugging Face folder's config.json, read as plain JSON (no torch, no transformers).

The folder gives the model's shape. Every `model:` field the job sets itself (or through a preset) must
agree with config.json, and a field it leaves out is taken from config.json; `seq_len` (the training
length, not the checkpoint's maximum) is always the job's. A mismatch is one problem naming the field,
both values and the fix. Supported: Llama-architecture decoders (`model_type` llama or mistral without a
sliding window): RMSNorm, RoPE with `rope_theta` and optionally Llama 3 scaling, grouped-query attention,
SwiGLU (`hidden_act: silu`), no biases, tied or untied embeddings; Qwen3 (`qwen3`: the same plus q/k
RMSNorm and a free head_dim); and the Mixture-of-Experts decoders Mixtral (`mixtral`: 8 experts, top-2,
normalised) and Qwen3-MoE (`qwen3_moe`: q/k norm, head_dim, `norm_topk_prob`, dense blocks only as the
first N of `mlp_only_layers`), whose MoE fields become `model.moe`.

config.json comes in two spellings: transformers 4 writes `rope_theta` and `rope_scaling` at the top
level (most published checkpoints), transformers 5 writes both inside `rope_parameters`. Both are read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen3_moe")
MAX_CONFIG_BYTES = 16 << 20  # published config.json files are under 10 kB
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class HfModel:
    """What a Hugging Face config.json says, in `model:` field names (plus what only it knows)."""

    fields: dict[str, Any]
    max_positions: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)


class HfConfigProblem(Exception):
    """config.json cannot be used; the message is one line, `field: what; fix` style."""


def _number(cfg: dict[str, Any], key: str, kind: type = int) -> Any:
    value = cfg.get(key)
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise HfConfigProblem(f"{CONFIG_FILE} has no positive integer {key} (got {value!r:.80})")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
        raise HfConfigProblem(f"{CONFIG_FILE} has no positive number {key} (got {value!r:.80})")
    return _float(value, key) if kind is float else value


def _float(value: Any, key: str) -> float:
    """A JSON number as a float; an integer too large for one (10**400) is one problem, not OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise HfConfigProblem(f"{CONFIG_FILE} has {key} {value!r:.40}...; expected a number a float can hold") from None


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling in `model.rope_scaling` form or None) from either spelling."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    theta = 10000.0 if theta is None else theta  # transformers' default_theta for Llama
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise HfConfigProblem(f"{CONFIG_FILE} has rope_theta {theta!r}; expected a positive number")
    theta = _float(theta, "rope_theta")
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise HfConfigProblem(f"{CONFIG_FILE} has rope_scaling {scaling!r:.80}; expected an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HfConfigProblem(f"{CONFIG_FILE} uses RoPE scaling {kind!r}; supported: none or 'llama3'")
    out: dict[str, Any] = {"rope_type": "llama3"}
    for key in _ROPE_SCALING_KEYS:
        value = scaling.get(key, cfg.get("max_position_embeddings") if key.startswith("original") else None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise HfConfigProblem(f"{CONFIG_FILE} rope scaling has no number {key} (got {value!r})")
        out[key] = int(value) if key.startswith("original") else _float(value, key)
    return theta, out


def read_hf_config(folder: str) -> HfModel:
    """The shape a Hugging Face folder describes; HfConfigProblem (one line) when it is unusable."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isdir(folder):
        raise HfConfigProblem("no such folder")
    if not os.path.isfile(path):
        raise HfConfigProblem(f"no {CONFIG_FILE} in the folder")
    if not (os.path.isfile(os.path.join(folder, WEIGHTS_FILE)) or os.path.isfile(os.path.join(folder, INDEX_FILE))):
        raise HfConfigProblem(f"no {WEIGHTS_FILE} or {INDEX_FILE} in the folder (only safetensors weights are read)")
    from hpctrain.errors import ConfigError
    from hpctrain.userfiles import read_regular_file

    try:  # bounded and regular files only; a config.json is a few kB
        cfg = json.loads(read_regular_file(path, MAX_CONFIG_BYTES, CONFIG_FILE).decode("utf-8"))
    except ConfigError as exc:
        raise HfConfigProblem(str(exc).split(": ", 1)[-1]) from None
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise HfConfigProblem(f"{CONFIG_FILE} is unreadable ({reason})") from None
    if not isinstance(cfg, dict):
        raise HfConfigProblem(f"{CONFIG_FILE} is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HfConfigProblem(f"{CONFIG_FILE} has model_type {model_type!r}; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-architecture decoders and their MoE)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HfConfigProblem(f"{CONFIG_FILE} has hidden_act {cfg.get('hidden_act')!r}; supported: 'silu' (SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise HfConfigProblem(f"{CONFIG_FILE} has {flag}: true; the runtime's projections have no biases")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True):
        raise HfConfigProblem(f"{CONFIG_FILE} has sliding_window {cfg['sliding_window']!r}; only full attention "
                              "is supported")
    hidden, heads = _number(cfg, "hidden_size"), _number(cfg, "num_attention_heads")
    head_dim = _number(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
    theta, scaling = _rope(cfg)
    fields = {
        "layers": _number(cfg, "num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _number(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads,
        "ffn_hidden": _number(cfg, "intermediate_size"),
        "vocab": _number(cfg, "vocab_size"),
        "activation": "swiglu",
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_eps": _number(cfg, "rms_norm_eps", float),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "head_dim": head_dim,
        "qk_norm": model_type in QK_NORM_TYPES,
        "moe": _moe(cfg, model_type) if model_type in MOE_TYPES else None,
    }
    max_positions = cfg.get("max_position_embeddings")
    return HfModel(fields, max_positions if isinstance(max_positions, int) else None, cfg)


def _moe(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`model.moe`'s shape fields from a Mixtral or Qwen3-MoE config.json."""
    experts = _number(cfg, "num_local_experts" if "num_local_experts" in cfg else "num_experts")
    top_k = _number(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise HfConfigProblem(f"{CONFIG_FILE} has num_experts_per_tok {top_k} > {experts} experts")
    if model_type == "mixtral":  # every block sparse, top-k normalised, experts intermediate_size wide
        return {"experts": experts, "top_k": top_k, "expert_ffn_hidden": _number(cfg, "intermediate_size"),
                "shared_experts": 0, "dense_layers": 0, "router": {"score": "softmax", "normalize_top_k": True}}
    step = cfg.get("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if step != 1:
        raise HfConfigProblem(f"{CONFIG_FILE} has decoder_sparse_step {step!r}; supported: 1 (dense blocks only "
                              "as the first N layers)")
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        raise HfConfigProblem(f"{CONFIG_FILE} has mlp_only_layers {dense!r}; supported: the first N layers "
                              "([0, 1, ..., N-1])")
    return {"experts": experts, "top_k": top_k, "expert_ffn_hidden": _number(cfg, "moe_intermediate_size"),
            "shared_experts": 0, "dense_layers": len(dense),
            "router": {"score": "softmax", "normalize_top_k": bool(cfg.get("norm_topk_prob", False))}}


def same(ours: Any, theirs: Any) -> bool:
    """Equal as config values: numbers within float rounding, mappings key by key."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(same(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(ours, bool):
        return math.isclose(float(ours), float(theirs), rel_tol=1e-9)
    return bool(ours == theirs)
