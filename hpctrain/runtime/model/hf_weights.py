"""Hugging Face weights <-> the runtime's parameters: the name mapping and a lazy shard reader.

Families (`family_of`): Llama (`LlamaForCausalLM`), Qwen3 (+ `self_attn.q_norm/k_norm`), and the MoE
decoders Mixtral (`block_sparse_moe.gate`, `block_sparse_moe.experts.E.w1/w2/w3`) and Qwen3-MoE
(`mlp.gate`, `mlp.experts.E.gate_proj/down_proj/up_proj`). The runtime stacks a block's routed experts
into one [experts, out, in] parameter (`feed_forward.experts.w1`); on disk each expert is its own
nn.Linear weight, so one runtime parameter is `experts` file tensors (`expert_hf_names`), and a rank
reads only the experts (and rows) of its own shard.

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
_QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
# The MoE families: the FFN module's name, and the runtime's w1/w2/w3 as each family names an expert's.
MOE_FAMILIES = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def family_of(args: ModelArgs) -> str:
    """The Hugging Face family a runtime model is: llama, qwen3, mixtral or qwen3_moe."""
    if args.moe is not None:
        return "qwen3_moe" if args.qk_norm else "mixtral"
    return "qwen3" if args.qk_norm else "llama"


def _block_names(family: str) -> dict[str, str]:
    names = dict(_BLOCK)
    if family in ("qwen3", "qwen3_moe"):
        names.update(_QK_NORM)
    if family in MOE_FAMILIES:
        names["feed_forward.router.gate.weight"] = f"{MOE_FAMILIES[family][0]}.gate.weight"
    return names


def to_hf_name(name: str, family: str = "llama") -> str:
    """transformers' name of a runtime parameter (full-model name); KeyError if it has none (a stacked
    expert parameter has one per expert: expert_hf_names)."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.match(name)
    block = _block_names(family)
    if match and match.group(2) in block:
        return f"model.layers.{match.group(1)}.{block[match.group(2)]}"
    raise KeyError(f"{name}: no Hugging Face {family} name")


def expert_hf_names(name: str, family: str, experts: int) -> list[str] | None:
    """The file tensors of a stacked expert parameter, expert by expert; None for any other parameter."""
    match = _EXPERTS.match(name)
    if not match or family not in MOE_FAMILIES:
        return None
    module, names = MOE_FAMILIES[family]
    return [f"model.layers.{match.group(1)}.{module}.experts.{e}.{names[match.group(2)]}.weight"
            for e in range(experts)]


def hf_pairs(name: str, tensor: torch.Tensor, family: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A full runtime parameter as the file tensors transformers stores (one per expert when stacked)."""
    per_expert = expert_hf_names(name, family, tensor.shape[0]) if tensor.dim() == 3 else None
    if per_expert is None:
        yield to_hf_name(name, family), tensor
        return
    for e, hf_name in enumerate(per_expert):
        yield hf_name, tensor[e]


def from_hf_name(hf_name: str, family: str = "llama") -> str:
    """The runtime's name of a transformers tensor (not an expert's); KeyError if it has none."""
    if hf_name in _TOP_BACK:
        return _TOP_BACK[hf_name]
    match = _HF_LAYER.match(hf_name)
    back = {v: k for k, v in _block_names(family).items()}
    if match and match.group(2) in back:
        return f"layers.{match.group(1)}.{back[match.group(2)]}"
    raise KeyError(f"{hf_name}: not a {family} weight")


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
        from hpctrain.config.hf_weights_check import WeightsProblem, inside

        try:
            return {name: inside(folder, name, file) for name, file in weight_map.items()}
        except (WeightsProblem, TypeError, AttributeError) as exc:
            raise ConfigError(f"model.init_from: {exc}") from None
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

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32, family: str = "llama") -> None:
        need_safetensors("model.init_from")
        self.folder, self.dtype, self.family = folder, dtype, family
        self.files = weight_files(folder)
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0  # what this rank read, for the tests' "only its shard" check

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def __call__(self, name: str, full_shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        per_expert = expert_hf_names(name, self.family, full_shape[0]) if len(full_shape) == 3 else None
        if per_expert is not None:  # [experts, out, in]: the box's experts, each its own file tensor
            experts = range(*index[0].indices(full_shape[0]))
            return torch.stack([self._read(per_expert[e], name, full_shape[1:], index[1:]) for e in experts])
        return self._read(to_hf_name(name, self.family), name, full_shape, index)

    def _read(self, hf_name: str, name: str, full_shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        if hf_name not in self.files:
            raise ConfigError(f"model.init_from: {self.folder} has no tensor {hf_name} (for {name})")
        try:  # the headers were checked (config/hf_weights_check.py); a file damaged since is still bad input
            part = self._handle(self.files[hf_name]).get_slice(hf_name)
        except Exception as exc:  # safetensors' SafetensorError, OSError
            raise ConfigError(f"model.init_from: cannot read {hf_name} from {self.files[hf_name]} "
                              f"({type(exc).__name__}: {str(exc)[:200]}); re-download or re-save the folder") from None
        shape = tuple(part.get_shape())
        if shape != tuple(full_shape):
            raise ConfigError(f"model.init_from: {hf_name} has shape {list(shape)} in {self.folder}, the model "
                              f"needs {list(full_shape)} for {name}")
        try:
            tensor = part[tuple(index)] if index else part[:]
        except Exception as exc:  # a file truncated or rewritten since the check
            raise ConfigError(f"model.init_from: cannot read {hf_name} from {self.files[hf_name]} "
                              f"({type(exc).__name__}: {str(exc)[:200]}); re-download or re-save the folder") from None
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"model.init_from: {hf_name} in {self.files[hf_name]} holds values that are not finite "
                              "(NaN or inf): the weights are damaged; re-download or re-save the folder")
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(self.dtype)

    def close(self) -> None:
        self._handles.clear()


def exportable(args: ModelArgs) -> None:
    """ConfigError (one line) when no Hugging Face family holds this model exactly."""
    if args.activation != "swiglu":
        raise ConfigError(f"model.activation: got {args.activation!r}; a Hugging Face export needs swiglu")
    moe, family = args.moe, family_of(args)
    if moe is None:
        return
    problems = []
    if moe.shared_ffn_hidden:
        problems.append(f"model.moe.shared_experts: {family} has no shared experts; export needs 0")
    if moe.score != "softmax":
        problems.append(f"model.moe.router.score: got {moe.score!r}; {family} routes with softmax")
    if family == "mixtral" and (moe.dense_layers or not moe.normalize_top_k):
        problems.append("model.moe: Mixtral has no dense blocks and always normalises the top-k scores "
                        "(dense_layers 0, router.normalize_top_k true)")
    if problems:
        raise ConfigError(problems)


def hf_config_dict(model: ModelConfig | ModelArgs, torch_dtype: str = "float32",
                   base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for the model's family (`family_of`: LlamaForCausalLM, Qwen3ForCausalLM,
    MixtralForCausalLM, Qwen3MoeForCausalLM) from a `model:` section (or ModelArgs). `base`: the original
    folder's config.json, whose other keys (token ids, ...) are kept. Written in the transformers 4
    spelling (rope_theta, rope_scaling at the top level), which transformers 4 and 5 both read."""
    shape = model if isinstance(model, ModelArgs) else ModelArgs.from_config(model)  # ints; rope_scaling a tuple
    exportable(shape)
    family = family_of(shape)
    cfg = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "transformers_version")}
    cfg.update({
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "num_hidden_layers": int(shape.layers), "hidden_size": int(shape.hidden),
        "num_attention_heads": int(shape.heads), "num_key_value_heads": int(shape.kv_heads),
        "head_dim": int(shape.head_dim), "intermediate_size": int(shape.ffn_hidden),
        "vocab_size": int(shape.vocab), "hidden_act": "silu", "rms_norm_eps": float(shape.norm_eps),
        "rope_theta": float(shape.rope_theta), "tie_word_embeddings": bool(shape.tie_embeddings),
        "attention_bias": False, "mlp_bias": False,
        "torch_dtype": torch_dtype, "dtype": torch_dtype,  # transformers 4's key and 5's
    })
    cfg.setdefault("max_position_embeddings", int(shape.seq_len))
    cfg["max_position_embeddings"] = max(int(cfg["max_position_embeddings"]), int(shape.seq_len))
    cfg.setdefault("initializer_range", 0.02)
    moe = shape.moe
    if moe is not None:
        cfg.update({"num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k,
                    "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False})
        if family == "mixtral":
            cfg.update({"intermediate_size": moe.expert_ffn_hidden, "sliding_window": None, "router_jitter_noise": 0.0})
        else:  # qwen3_moe; transformers 4 reads num_experts, 5 num_local_experts
            cfg.update({"num_experts": moe.experts, "moe_intermediate_size": moe.expert_ffn_hidden,
                        "mlp_only_layers": list(range(moe.dense_layers)), "decoder_sparse_step": 1,
                        "norm_topk_prob": moe.normalize_top_k, "use_sliding_window": False, "sliding_window": None})
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
    from hpctrain.config.hf_weights_check import check_weights

    check_weights(training.job.model)  # damaged files are bad input (exit 2, not requeued), not a crash
    reader = HfShardReader(folder, family=family_of(training.args))
    try:
        # init.py's sharded fill: each rank reads its shards only (in row blocks); the tied head reads
        # the embedding; LoRA adapters get PEFT's init, not the folder's.
        training.initialise(reader)
    finally:
        reader.close()
    return {"path": folder, "bytes_read": reader.bytes_read, "seconds": round(time.perf_counter() - started, 3)}
