"""Hugging Face Llama weights <-> the runtime's parameters: the name mapping and a lazy shard reader.

Names: the runtime's full-model names (transformer.py: `layers.3.attention.wq.weight`) map one to one onto
`LlamaForCausalLM`'s (`model.layers.3.self_attn.q_proj.weight`). No tensor is transposed or permuted:
both keep nn.Linear's [out, in] layout, and both rotate q/k with the rotate-half RoPE layout (the first
half of each head's dimensions pairs with the second half), which is the layout transformers' Llama
weights are stored in (its conversion script permutes Meta's interleaved checkpoints into it once).
tests/runtime/test_hf_weights.py checks that by comparing logits with transformers.

Reading: `HfShardReader` is an init.py ShardFill, `fill(name, full_shape, index) -> Tensor`: it opens
the folder's safetensors file(s) lazily (`safe_open(...).get_slice(name)[index]`), so a rank reads only
the bytes of its own TP / FSDP shard of its own pipeline stages, never a full tensor it does not hold
(init.init_parameters asks for each shard in row blocks of a few MiB: no shard-sized read buffer).
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Iterator

import torch

from hpctrain.config.hf_config import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
from hpctrain.errors import ConfigError
from hpctrain.runtime.model.transformer import ModelArgs

if TYPE_CHECKING:
    from hpctrain.config.model import ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Inside a block: ours -> transformers'.
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def to_hf_name(name: str) -> str:
    """transformers' name of a runtime parameter (full-model name); KeyError if it has none."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
    raise KeyError(f"{name}: no Hugging Face Llama name")


def from_hf_name(hf_name: str) -> str:
    """The runtime's name of a transformers Llama tensor; KeyError if it has none."""
    if hf_name in _TOP_BACK:
        return _TOP_BACK[hf_name]
    match = _HF_LAYER.match(hf_name)
    if match and match.group(2) in _BLOCK_BACK:
        return f"layers.{match.group(1)}.{_BLOCK_BACK[match.group(2)]}"
    raise KeyError(f"{hf_name}: not a Llama weight")


def need_safetensors(what: str) -> None:
    """A missing package is the user's setup, not a crash: one line, exit 2."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs the safetensors package: pip install 'hpctrain[hf]'") from None


def weight_files(folder: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"model.init_from: {index} is unreadable ({type(exc).__name__}: {exc})") from None
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(single):
        raise ConfigError(f"model.init_from: no {WEIGHTS_FILE} or {INDEX_FILE} in {folder}")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


class HfShardReader:
    """A ShardFill over a Hugging Face folder: `reader(name, full_shape, index)` returns this rank's
    slice `index` (a tuple of slices, global coordinates) of parameter `name`, read lazily, in fp32
    (the runtime's master-weight dtype; init copies it into the parameter's own dtype)."""

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32) -> None:
        need_safetensors("model.init_from")
        self.folder, self.dtype = folder, dtype
        self.files = weight_files(folder)
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0  # what this rank read, for the tests' "only its shard" check

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def __call__(self, name: str, full_shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        hf_name = to_hf_name(name)
        if hf_name not in self.files:
            raise ConfigError(f"model.init_from: {self.folder} has no tensor {hf_name} (for {name})")
        part = self._handle(self.files[hf_name]).get_slice(hf_name)
        shape = tuple(part.get_shape())
        if shape != tuple(full_shape):
            raise ConfigError(f"model.init_from: {hf_name} has shape {list(shape)} in {self.folder}, the model "
                              f"needs {list(full_shape)} for {name}")
        tensor = part[tuple(index)] if index else part[:]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(self.dtype)

    def close(self) -> None:
        self._handles.clear()


def hf_config_dict(model: ModelConfig | ModelArgs, torch_dtype: str = "float32",
                   base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `LlamaForCausalLM` from a `model:` section (or ModelArgs). `base`: the original
    folder's config.json, whose other keys (token ids, ...) are kept. Written in the transformers 4
    spelling (rope_theta, rope_scaling at the top level), which transformers 4 and 5 both read."""
    shape = ModelArgs.from_config(model)  # the resolved ints; rope_scaling as a tuple
    cfg = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "transformers_version")}
    cfg.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": int(shape.layers), "hidden_size": int(shape.hidden),
        "num_attention_heads": int(shape.heads), "num_key_value_heads": int(shape.kv_heads),
        "head_dim": int(shape.hidden) // int(shape.heads), "intermediate_size": int(shape.ffn_hidden),
        "vocab_size": int(shape.vocab), "hidden_act": "silu", "rms_norm_eps": float(shape.norm_eps),
        "rope_theta": float(shape.rope_theta), "tie_word_embeddings": bool(shape.tie_embeddings),
        "attention_bias": False, "mlp_bias": False,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,  # transformers 4's key and 5's
    })
    cfg.setdefault("max_position_embeddings", int(shape.seq_len))
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), int(shape.seq_len))
    cfg.setdefault("initializer_range", 0.02)
    scaling = shape.rope_scaling
    if scaling is None:
        cfg.pop("rope_scaling", None)
    else:
        factor, low, high, original = scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": float(low),
                               "high_freq_factor": float(high), "original_max_position_embeddings": int(original)}
    return cfg


def read_base_config(folder: str | None) -> dict[str, Any]:
    """init_from's config.json as a dict ({} when there is none or it is unreadable)."""
    if not folder:
        return {}
    try:
        with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def iter_hf_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face folder, (hf_name, tensor), one at a time (tests, tools)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, path in weight_files(folder).items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for name in names:
                yield name, handle.get_tensor(name)


def load_init_from(training: Any) -> dict[str, Any]:
    """Initialise every model part of a `Training` (runtime/training.py, built with initialise=False) from
    `job.model.init_from`; returns what this rank read ({"path", "bytes_read", "seconds"}), for the
    `weights loaded` event."""
    import time

    started = time.perf_counter()
    folder = os.path.expanduser(str(training.job.model.init_from))
    reader = HfShardReader(folder)
    try:
        # init.py's sharded fill: each rank reads its shards only (in row blocks); the tied head reads
        # the embedding; LoRA adapters get PEFT's init, not the folder's.
        training.initialise(reader)
    finally:
        reader.close()
    return {"path": folder, "bytes_read": reader.bytes_read, "seconds": round(time.perf_counter() - started, 3)}
