"""The `model:` section: the transformer's shape, from a preset with per-field overrides or in full."""

import os
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from hpctrain.config import limits as L
from hpctrain.config.base import Section, new_list
from hpctrain.config.lazy import LazySection
from hpctrain.config.types import Text

if TYPE_CHECKING:
    from hpctrain.config.moe import MoEConfig as MoESection
else:  # built on first use (config/lazy.py)
    MoESection = Annotated[Any, LazySection("hpctrain.config.moe", "MoEConfig")]

# Shapes from the model cards / papers: GPT-3 (Brown et al. 2020, Table 2.1), Llama 2 (Touvron et al.
# 2023, Table 1 and params.json), Llama 3 / 3.2 (Meta's model cards and params.json).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=172, vocab=256, seq_len=128,
                 activation="swiglu", tie_embeddings=False),
    "llama3-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab=128256,
                      seq_len=8192, activation="swiglu", tie_embeddings=True, rope_theta=500000.0),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                      seq_len=8192, activation="swiglu", tie_embeddings=False, rope_theta=500000.0),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                       seq_len=8192, activation="swiglu", tie_embeddings=False, rope_theta=500000.0),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                      seq_len=4096, activation="swiglu", tie_embeddings=False),
    "gpt3-13b": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=20480, vocab=50257,
                     seq_len=2048, activation="gelu", tie_embeddings=True),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=50257,
                      seq_len=2048, activation="gelu", tie_embeddings=True),
    # Mixture-of-Experts, from each model's config.json on the Hugging Face Hub (mistralai/Mixtral-8x7B-v0.1,
    # mistralai/Mixtral-8x22B-v0.1, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): seq_len is
    # max_position_embeddings; Mixtral normalises the top-2 scores, Qwen3-MoE's norm_topk_prob is true;
    # aux_loss_coeff is router_aux_loss_coef. Qwen3's head_dim (128) is not hidden/heads.
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                         seq_len=32768, activation="swiglu", tie_embeddings=False, rope_theta=1e6,
                         moe=dict(experts=8, top_k=2, router=dict(aux_loss_coeff=0.02))),
    "mixtral-8x22b": dict(layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384, vocab=32768,
                          seq_len=65536, activation="swiglu", tie_embeddings=False, rope_theta=1e6,
                          moe=dict(experts=8, top_k=2, router=dict(aux_loss_coeff=0.001))),
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, qk_norm=True,
                          ffn_hidden=6144, vocab=151936, seq_len=40960, activation="swiglu", tie_embeddings=False,
                          rope_theta=1e6, norm_eps=1e-6,
                          moe=dict(experts=128, top_k=8, expert_ffn_hidden=768, router=dict(aux_loss_coeff=0.001))),
    "qwen3-235b-a22b": dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, qk_norm=True,
                            ffn_hidden=12288, vocab=151936, seq_len=40960, activation="swiglu",
                            tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6,
                            moe=dict(experts=128, top_k=8, expert_ffn_hidden=1536,
                                     router=dict(aux_loss_coeff=0.001))),
}

PresetName = Literal["tiny", "llama3-1b", "llama3-8b", "llama3-70b", "llama2-7b", "gpt3-13b", "gpt3-175b",
                     "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b"]
_SHAPE_FIELDS = ("layers", "hidden", "heads", "vocab", "seq_len")


def default_ffn_hidden(hidden: int, activation: str) -> int:
    """4h for GELU; for SwiGLU 2/3 of 4h rounded up to a multiple of 256 (Llama's rule, keeps FLOPs ~equal)."""
    if activation == "gelu":
        return 4 * hidden
    return -(-int(8 * hidden / 3) // 256) * 256


class RopeScaling(Section):
    """Llama 3 RoPE frequency scaling (Llama 3.1 and later): transformers' `rope_type: llama3`."""

    rope_type: Literal["llama3"] = Field("llama3", description="The scaling rule; only llama3.")
    factor: float = Field(..., gt=0, le=1e6, description="Divides the low frequencies (8 in Llama 3.1).")
    low_freq_factor: float = Field(..., gt=0, le=1e6, description="Wavelengths above original/low_freq_factor "
                                   "are divided by factor (1 in Llama 3.1).")
    high_freq_factor: float = Field(..., gt=0, le=1e6, description="Wavelengths below original/high_freq_factor "
                                    "are kept; between the two they are interpolated (4 in Llama 3.1).")
    original_max_position_embeddings: int = Field(..., ge=1, le=L.MAX_SEQ_LEN, description="The pretraining "
                                                  "context length (8192 in Llama 3.1).")


# The fields init_from's config.json fills (seq_len, the training length, is always the job's own).
HF_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "activation", "tie_embeddings",
             "norm_eps", "rope_theta", "rope_scaling", "head_dim", "qk_norm", "moe")
# model.moe fields config.json fixes (the rest, the router's balancing and capacity, are the job's choice).
HF_MOE_FIELDS = ("experts", "top_k", "expert_ffn_hidden", "shared_experts", "dense_layers")
HF_ROUTER_FIELDS = ("score", "normalize_top_k")
# config.json's names for them, for the messages.
HF_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
           "kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size", "vocab": "vocab_size",
           "norm_eps": "rms_norm_eps", "moe.experts": "num_experts", "moe.top_k": "num_experts_per_tok",
           "moe.expert_ffn_hidden": "moe_intermediate_size"}


class ModelConfig(Section):
    """The decoder-only transformer to train."""

    preset: Optional[PresetName] = Field(None, description="Start from a known shape; other fields override it.")
    layers: Optional[int] = Field(None, ge=1, le=L.MAX_LAYERS, description="Number of transformer blocks.")
    hidden: Optional[int] = Field(None, ge=1, le=L.MAX_HIDDEN, description="Model width (embedding size).")
    heads: Optional[int] = Field(None, ge=1, le=L.MAX_HEADS, description="Attention (query) heads.")
    kv_heads: Optional[int] = Field(None, ge=1, le=L.MAX_HEADS, description="Key/value heads (GQA); defaults to heads.")
    head_dim: Optional[int] = Field(None, ge=2, le=L.MAX_HIDDEN, description="Width of one attention head; "
                                    "null: hidden/heads (Qwen3: 128 whatever the width).")
    qk_norm: bool = Field(False, description="RMSNorm over each query and key head before RoPE (Qwen3).")
    ffn_hidden: Optional[int] = Field(None, ge=1, le=L.MAX_FFN_HIDDEN, description="FFN inner width; default 4h (gelu) or ~8h/3 (swiglu).")
    vocab: Optional[int] = Field(None, ge=2, le=L.MAX_VOCAB, description="Vocabulary size.")
    seq_len: Optional[int] = Field(None, ge=1, le=L.MAX_SEQ_LEN, description="Training sequence length in tokens.")
    activation: Literal["gelu", "swiglu"] = Field("swiglu", description="FFN activation.")
    tie_embeddings: bool = Field(False, description="Share the input embedding with the output head.")
    norm_eps: float = Field(1e-5, gt=0, le=1, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, le=L.MAX_ROPE_THETA, description="RoPE base frequency.")
    rope_scaling: Optional[RopeScaling] = Field(None, description="Llama 3 RoPE scaling; none by default.")
    moe: Optional[MoESection] = Field(None, description="Mixture-of-Experts FFN (routed and shared experts); "
                                     "none: every block is dense.")
    init_from: Optional[Text] = Field(None, description="A local Hugging Face folder (config.json and "
                                      "model.safetensors or its sharded index) to start from: its config.json "
                                      "gives every shape field the job leaves out and must agree with those it "
                                      "sets; seq_len stays the job's. Ignored when resuming from a checkpoint.")
    # Problems found reading init_from, as (field, message, got, fix): reported with the cross-field checks.
    _init_problems: list[tuple[str, str, Any, str]] = PrivateAttr(default_factory=new_list)

    @model_validator(mode="before")
    @classmethod
    def _merge_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("preset"), str) and data["preset"] in PRESETS:
            preset = PRESETS[data["preset"]]
            merged = {**preset, **data}
            if isinstance(preset.get("moe"), dict) and isinstance(data.get("moe"), dict):
                merged["moe"] = {**preset["moe"], **data["moe"]}  # model.moe.top_k: 1 keeps the preset's experts
                if isinstance(preset["moe"].get("router"), dict) and isinstance(data["moe"].get("router"), dict):
                    merged["moe"]["router"] = {**preset["moe"]["router"], **data["moe"]["router"]}
            return merged
        return data

    @model_validator(mode="after")
    def _fill_defaults(self) -> "ModelConfig":
        if self.init_from is not None:
            self._fill_from_hf(self.init_from)
        if self.kv_heads is None and self.heads is not None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None and self.hidden is not None:
            self.ffn_hidden = default_ffn_hidden(self.hidden, self.activation)
        return self

    def _fill_from_hf(self, folder: str) -> None:
        """Take the shape from init_from's config.json (hf_config.py says the rules)."""
        from hpctrain.config.hf_config import HfConfigProblem, read_hf_config, same

        try:
            hf = read_hf_config(os.path.expanduser(folder))
        except HfConfigProblem as exc:
            self._init_problems.append(("model.init_from", str(exc), folder,
                                        "give a folder written by transformers' save_pretrained"))
            return
        if self._hf_out_of_bounds(hf.fields):
            return
        given = self.model_fields_set
        for name in HF_FIELDS:
            theirs = hf.fields[name]
            ours = getattr(self, name)
            if name == "moe":
                self._take_hf_moe(theirs, name in given)
                continue
            if isinstance(ours, RopeScaling):
                ours = ours.model_dump()
            if name in given:
                if not same(ours, theirs):
                    self._init_problems.append((f"model.{name}", f"differs from init_from's config.json "
                                                f"({theirs!r})", ours, f"remove model.{name} (it comes from "
                                                "config.json) or use the folder's value"))
            elif name == "rope_scaling":
                self.rope_scaling = None if theirs is None else RopeScaling.model_validate(theirs)
            else:
                setattr(self, name, theirs)
        if self.seq_len is None:
            limit = f" (config.json's max_position_embeddings is {hf.max_positions})" if hf.max_positions else ""
            self._init_problems.append(("model.seq_len", f"is required with model.init_from{limit}", None,
                                        "set model.seq_len, the training sequence length"))

    def _hf_out_of_bounds(self, fields: dict[str, Any]) -> bool:
        """config.json's numbers meet the bounds job.yaml's fields have (limits.out_of_bounds); True if not."""
        checks: list[tuple[str, Any, list[Any]]] = []
        for name in HF_FIELDS:
            value = fields.get(name)
            if name == "moe" and isinstance(value, dict):
                from hpctrain.config.moe import MoEConfig

                checks += [(f"moe.{k}", v, MoEConfig.model_fields[k].metadata) for k, v in value.items()
                           if k in MoEConfig.model_fields]
            elif name == "rope_scaling" and isinstance(value, dict):
                checks += [(f"rope_scaling.{k}", v, RopeScaling.model_fields[k].metadata) for k, v in value.items()
                           if k in RopeScaling.model_fields]
            else:
                checks.append((name, value, type(self).model_fields[name].metadata))
        for name, value, metadata in checks:
            reason = L.out_of_bounds(value, metadata)
            if reason is not None:
                self._init_problems.append(("model.init_from", f"config.json's {HF_KEYS.get(name, name)} (model."
                                            f"{name}) {reason}", value, "correct config.json (a damaged or "
                                            "hand-edited file?) or give a folder written by save_pretrained"))
        return bool(self._init_problems)

    def _take_hf_moe(self, theirs: dict[str, Any] | None, given: bool) -> None:
        """model.moe from config.json: its shape fields must agree with the job's, the rest stay the job's."""
        from hpctrain.config.hf_config import same

        ours = self.moe
        if theirs is None or ours is None:
            if theirs is None and ours is not None:
                self._init_problems.append(("model.moe", "is set but init_from's config.json is a dense model",
                                            "set", "remove model.moe"))
            elif theirs is not None:
                from hpctrain.config.moe import MoEConfig

                self.moe = MoEConfig.model_validate(theirs)
            return
        mine: dict[str, Any] = {k: getattr(ours, k) for k in HF_MOE_FIELDS}
        mine.update({f"router.{k}": getattr(ours.router, k) for k in HF_ROUTER_FIELDS})
        if mine["expert_ffn_hidden"] is None:
            mine["expert_ffn_hidden"] = theirs["expert_ffn_hidden"]
        wanted = {k: theirs[k] for k in HF_MOE_FIELDS}
        wanted.update({f"router.{k}": theirs["router"][k] for k in HF_ROUTER_FIELDS})
        set_here = ours.model_fields_set | {f"router.{k}" for k in ours.router.model_fields_set}
        updates: dict[str, Any] = {}
        router_updates: dict[str, Any] = {}
        for key, value in wanted.items():
            if key in set_here and not same(mine[key], value):
                self._init_problems.append((f"model.moe.{key}", f"differs from init_from's config.json ({value!r})",
                                            mine[key], f"remove model.moe.{key} (it comes from config.json)"))
            elif key.startswith("router."):
                router_updates[key[len("router."):]] = value
            else:
                updates[key] = value
        self.moe = ours.model_copy(update={**updates, "router": ours.router.model_copy(update=router_updates)})

    @property
    def init_problems(self) -> list[tuple[str, str, Any, str]]:
        return list(self._init_problems)

    def missing_fields(self) -> list[str]:
        return [name for name in _SHAPE_FIELDS if getattr(self, name) is None]
