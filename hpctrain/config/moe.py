"""The `model.moe:` section: a Mixture-of-Experts feed-forward in place of the dense one.

A block's FFN becomes `experts` routed SwiGLU experts of width `expert_ffn_hidden`, of which each
token uses `top_k`, plus `shared_experts` always-on experts (DeepSeek's shared experts, Dai et al.
2024, DeepSeekMoE section 3.2), summed. The first `dense_layers` blocks keep the dense FFN of width
`model.ffn_hidden` (DeepSeek-V3 keeps 3, Liu et al. 2024, section 4.2). The router is a linear layer
scored in fp32 (softmax, as Mixtral and Qwen3-MoE, or sigmoid, as DeepSeek-V3).

Balancing: `router.aux_loss_coeff` adds the Switch Transformer load-balancing loss (Fedus et al. 2021,
equations 4-6: E * sum_i f_i * P_i per MoE layer, averaged over layers) to the loss's gradient; it is
logged as `aux_loss`, never folded into `loss`. `router.bias_update_rate` turns on DeepSeek-V3's
auxiliary-loss-free balancing (section 2.1.2): a per-expert bias added to the scores for the top-k
choice only, moved by `bias_update_rate` times sign(mean load - expert load) after every step.
`router.capacity_factor`: null routes every token (dropless); a number caps each expert at
ceil(capacity_factor * tokens * top_k / experts) tokens per micro-batch, the later tokens dropped.
"""

from typing import Literal, Optional

from pydantic import Field

from hpctrain.config import limits as L
from hpctrain.config.base import Section

MAX_EXPERTS = 1 << 14  # DeepSeek-V3 has 256 routed experts; 16,384 is far past any published model


class RouterConfig(Section):
    """How tokens choose their experts."""

    score: Literal["softmax", "sigmoid"] = Field("softmax", description="Score function over the experts' logits "
                                                 "(fp32): softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3).")
    normalize_top_k: bool = Field(True, description="Divide the chosen experts' scores by their sum (Mixtral "
                                  "always; Qwen3-MoE's norm_topk_prob).")
    aux_loss_coeff: float = Field(0.0, ge=0, le=1e3, description="Weight of the load-balancing loss in the "
                                  "gradient (Mixtral 0.02, Qwen3-MoE 0.001); 0 turns it off. Logged as aux_loss.")
    bias_update_rate: Optional[float] = Field(None, gt=0, le=1.0, description="Auxiliary-loss-free balancing "
                                              "(DeepSeek-V3: 0.001): the per-expert routing bias moves by this "
                                              "much per step; null turns it off.")
    capacity_factor: Optional[float] = Field(None, gt=0, le=1e3, description="Tokens an expert takes per "
                                             "micro-batch, as a multiple of an even share; null = dropless.")


class MoEConfig(Section):
    """Routed (and shared) experts in place of the dense FFN."""

    experts: int = Field(..., ge=1, le=MAX_EXPERTS, description="Routed experts per MoE block.")
    top_k: int = Field(..., ge=1, le=MAX_EXPERTS, description="Experts each token is sent to.")
    expert_ffn_hidden: Optional[int] = Field(None, ge=1, le=L.MAX_FFN_HIDDEN, description="Inner width of one "
                                             "routed expert (SwiGLU); defaults to model.ffn_hidden.")
    shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="Always-used experts, as one SwiGLU of "
                                "shared_experts x shared_ffn_hidden.")
    shared_ffn_hidden: Optional[int] = Field(None, ge=1, le=L.MAX_FFN_HIDDEN, description="Inner width of one "
                                             "shared expert; defaults to expert_ffn_hidden.")
    dense_layers: int = Field(0, ge=0, le=L.MAX_LAYERS, description="The first N blocks keep the dense FFN "
                              "(model.ffn_hidden wide).")
    router: RouterConfig = Field(default_factory=lambda: RouterConfig(), description="The router.")


def expert_width(moe: MoEConfig, ffn_hidden: int) -> int:
    return int(moe.expert_ffn_hidden or ffn_hidden)


def shared_width(moe: MoEConfig, ffn_hidden: int) -> int:
    """The width of the one SwiGLU the shared experts form (0: none)."""
    return moe.shared_experts * int(moe.shared_ffn_hidden or expert_width(moe, ffn_hidden))
