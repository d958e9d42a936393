"""A decoder-only transformer (Llama-style): RMSNorm, RoPE, grouped-query attention through
`F.scaled_dot_product_attention`, a gelu or swiglu MLP, tied or untied embeddings.

Layers live in an `nn.ModuleDict` keyed by the *global* layer index, so a pipeline stage that
holds layers 4..7 still names its parameters `layers.4.attention.wq.weight`: state-dict keys are
the same on every layout, and checkpoints move between layouts.

The model is built on the meta device, parallelised, then materialised with `to_empty` and
`init_weights` (or, on a start that resumes from a checkpoint, with `init_buffers` only: the
checkpoint fills every parameter). Initialisation is sharded and layout independent
(hpctrain/runtime/model/init.py): each rank draws only its own shard of each parameter, tile by tile,
from generators seeded by (seed, parameter name, tile index), so no rank ever holds a full
parameter, and the same seed gives bit-identical full-model weights on one process and on any
TP/PP/DP layout, which is what the parity tests rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.feed_forward import FeedForward
from hpctrain.runtime.model.init import init_parameters, random_fill
from hpctrain.runtime.model.moe import MoE, MoEArgs
from hpctrain.runtime.model.norm import RMSNorm

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelArgs:
    """The model shape; the same fields as `job.model` (all concrete)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    activation: str = "swiglu"
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3 scaling (`model.rope_scaling`): (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or None for plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    head_dim: int = 0  # 0: hidden // heads
    qk_norm: bool = False
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.head_dim:
            if self.hidden % self.heads:
                problems.append(f"model.hidden: got {self.hidden}; must be divisible by heads={self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))
        if self.heads % self.kv_heads:
            problems.append(
                f"model.kv_heads: got {self.kv_heads}; must divide heads={self.heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            problems.append(f"model.head_dim: got {self.head_dim}; RoPE needs an even head size")
        if self.activation not in ("gelu", "swiglu"):
            problems.append(f"model.activation: got {self.activation!r}; valid: 'gelu', 'swiglu'")
        if problems:
            raise ConfigError(problems)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.dense_layers

    @classmethod
    def from_config(cls, model_cfg: Any) -> ModelArgs:
        """From `job.model` (a pydantic model) or anything with the same attributes."""
        special = ("rope_scaling", "head_dim", "qk_norm", "moe")
        names = [name for name in cls.__dataclass_fields__ if name not in special]
        scaling = getattr(model_cfg, "rope_scaling", None)
        if scaling is not None and not isinstance(scaling, tuple):
            scaling = (float(scaling.factor), float(scaling.low_freq_factor), float(scaling.high_freq_factor),
                       int(scaling.original_max_position_embeddings))
        moe = getattr(model_cfg, "moe", None)
        if moe is not None and not isinstance(moe, MoEArgs):
            moe = MoEArgs.from_config(moe, int(model_cfg.ffn_hidden))
        return cls(**{name: getattr(model_cfg, name) for name in names}, rope_scaling=scaling,
                   head_dim=int(getattr(model_cfg, "head_dim", 0) or 0), qk_norm=bool(getattr(model_cfg, "qk_norm", False)),
                   moe=moe)


def param_count(args: ModelArgs) -> int:
    """Closed-form parameter count of the full model (tied embeddings counted once; every expert)."""
    h, d = args.hidden, args.head_dim
    attention = h * args.heads * d + 2 * h * args.kv_heads * d + args.heads * d * h + (2 * d if args.qk_norm else 0)
    dense = (3 if args.activation == "swiglu" else 2) * h * args.ffn_hidden
    total = 0
    for layer in range(args.layers):
        ffn = dense
        if args.is_moe_layer(layer):
            assert args.moe is not None
            ffn = args.moe.experts * (h + 3 * h * args.moe.expert_ffn_hidden) + 3 * h * args.moe.shared_ffn_hidden
        total += attention + ffn + 2 * h
    head = 0 if args.tie_embeddings else args.vocab * h
    return args.vocab * h + total + h + head


def rope_inv_freq(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The RoPE inverse frequencies [head_dim / 2] in fp64, with Llama 3 scaling when set.

    The scaling is transformers' `_compute_llama3_parameters` (modeling_rope_utils.py, transformers
    5.24), step for step: wavelengths below original/high_freq_factor are kept, those above
    original/low_freq_factor divided by `factor`, and those between interpolated smoothly."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if args.rope_scaling is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = args.rope_scaling
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def rope_tables(args: ModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, each [seq_len, head_dim] (rotate-half layout), in fp32."""
    inv_freq = rope_inv_freq(args, device)
    angles = torch.outer(torch.arange(args.seq_len, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [seq, head_dim]."""
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.hidden, args.heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.hidden, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.heads * args.head_dim, args.hidden, bias=False)
        # Qwen3: an RMSNorm over each head's dimensions of q and k, before RoPE.
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        # Context parallelism (runtime/parallel/context.py apply_cp): attention over the whole sequence
        # from this rank's chunks; None: the sequence is all here.
        self.context: Any = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/tp query and kv heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos[:seq], sin[:seq]), apply_rope(k, cos[:seq], sin[:seq])
        if self.context is not None:  # only the kv heads travel (GQA); repeated after the exchange
            return self.wo(self.context.attention(q, k, v).reshape(batch, seq, -1))
        rep = q.shape[2] // k.shape[2]
        if rep > 1:  # explicit repeat keeps every SDPA backend (flash included) available
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block. `ac_mode` is set by `apply_ac`; it changes no parameter names.

    `feed_forward` is the dense FeedForward, or on a MoE block (layer >= model.moe.dense_layers) the MoE."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden, eps=args.norm_eps)
        self.feed_forward: FeedForward | MoE
        if args.is_moe_layer(layer):
            assert args.moe is not None
            self.feed_forward = MoE(args.hidden, args.moe)
        else:
            self.feed_forward = FeedForward(args.hidden, args.ffn_hidden, args.activation == "swiglu")
        self.ac_mode = "none"
        self.ac_context_fn: Any = None

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.ac_mode == "none" or not torch.is_grad_enabled():
            return self._forward(x, cos, sin)
        kwargs = {"context_fn": self.ac_context_fn} if self.ac_context_fn is not None else {}
        return checkpoint(self._forward, x, cos, sin, use_reentrant=False, **kwargs)


class Transformer(nn.Module):
    """The full model, or one pipeline stage of it (absent parts are None / missing layers).

    forward(tokens [b, s] int64) -> logits [b, s, vocab] on a full model; a stage without the
    embedding takes hidden states [b, s, hidden], a stage without the head returns them.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    context: Any = None  # context parallelism: RoPE at this rank's global positions (parallel/context.py)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.layers)})
        self.norm: RMSNorm | None = RMSNorm(args.hidden, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.hidden, args.vocab, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args, device=torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if h.is_floating_point() and torch.is_autocast_enabled(h.device.type):
            # bf16/fp16 without FSDP: autocast computes the matmuls in 16 bits but would leave
            # the residual stream (embedding output, adds, norms) in fp32. Casting it once here
            # keeps every activation 16-bit, as under FSDP's mixed precision; the parameters,
            # the master weights, stay fp32.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        # One 16-bit copy of the RoPE tables per forward, shared by every layer (a per-layer
        # cast would make each layer save its own copies).
        cos, sin = self.rope_cos.to(_compute_dtype(h)), self.rope_sin.to(_compute_dtype(h))
        if self.context is not None:  # this rank's tokens sit at global positions: head and tail chunks
            where = self.context.positions(cos.device)
            cos, sin = cos.index_select(0, where), sin.index_select(0, where)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @property
    def has_tied_copy(self) -> bool:
        """True on a last pipeline stage that holds its own copy of the tied embedding."""
        return (
            self.args.tie_embeddings and self.output is not None and self.tok_embeddings is None
        )

    def tie_weights(self) -> None:
        """Share the embedding with the head (a full model or a single-stage pipeline only).

        `to_empty` turns a shared meta parameter into two separate ones; call this after it."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """Set the RoPE tables (buffers no checkpoint holds) and the MoE routing biases (zero until a
        checkpoint fills them) on the device they live on."""
        cos, sin = rope_tables(self.args, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
            for module in self.modules():
                if isinstance(module, MoE) and module.router.expert_bias is not None:
                    module.router.expert_bias.zero_()

    def init_weights(self, seed: int, device: torch.device | str | None = None) -> None:
        """Fill every parameter's local shard from the seed, and the buffers; see the module docstring.

        `device`: where the values are drawn (default the CPU); the parameters may live elsewhere."""
        self.init_buffers()
        init_parameters(self, random_fill(seed, self.args.layers, device))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    return h.dtype if h.is_floating_point() else torch.float32


def build_model(args: ModelArgs) -> Transformer:
    """The full model on the meta device (no memory); materialise with to_empty + init_weights."""
    with torch.device("meta"):
        return Transformer(args)


def make_stage(whole: Transformer, first_layer: int, last_layer: int, first: bool, last: bool) -> Transformer:
    """A pipeline stage on meta: layers [first_layer, last_layer), embedding/head only at the ends.

    A tied embedding on a multi-stage pipeline becomes two parameters (embedding on the first
    stage, head on the last) that start equal and get the same summed gradient every step.
    """
    import copy

    stage = copy.deepcopy(whole)
    for key in list(stage.layers.keys()):
        if not first_layer <= int(key) < last_layer:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (works on loss-parallel DTensor logits too)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
