"""The Mixture-of-Experts feed-forward (`model.moe`, hpctrain/config/moe.py says the fields).

    x [b, s, h] -> router (fp32) -> top-k experts per token -> tokens sorted by expert ->
    one grouped GEMM per projection over the local experts -> weighted scatter-add back -> + shared

Parameters (names are the same on every layout; checkpoints and Hugging Face interop rely on them):
  `router.gate.weight` [experts, h]; `experts.w1`, `experts.w3` [experts, f, h] and `experts.w2`
  [experts, h, f] (each expert an nn.Linear-layout SwiGLU: w2(silu(w1 x) * w3 x)); `shared.w1/w2/w3`
  (a dense FeedForward of shared_experts x shared width) when there are shared experts; the buffer
  `router.expert_bias` [experts] (fp32, checkpointed) with auxiliary-loss-free balancing.

The grouped GEMM is `torch._grouped_mm` (one kernel over all experts, the token counts as offsets) where
the device runs it: the CPU (fp32 and bf16) and CUDA devices of compute capability 9.0 and up in bf16
(the kernel's requirement, torch/_meta_registrations.py `_grouped_mm`); elsewhere a loop over the
experts' slices, the same arithmetic. The design follows torchtitan's `GroupedExperts` and
`TokenChoiceTopKRouter` (torchtitan/models/common/moe.py: routing in fp32, bias used for the choice
only, scores gathered from the unbiased probabilities).

The balancing loss does not change the forward value: `AuxLoss.apply(out, aux)` returns `out` and,
in backward, gives `aux` the gradient `backward_scale` (Megatron-Core's MoEAuxLossAutoScaler, the
same device): the loss reaches the router's gradient from any pipeline stage without travelling with
the activations, and `loss` stays the language-model loss. The trainer sets `backward_scale`
(coeff / MoE layers / micro-batches, times the fp16 loss scale) before a step.

Per-step statistics (tokens per expert, dropped tokens, the balancing loss) accumulate on the module
during forward, never during the recomputation activation checkpointing runs inside backward, and the
trainer collects and clears them after each step (`take_stats`).

Under expert parallelism (`parallel.ep`, runtime/parallel/expert.py) `experts` holds this rank's slice of
the experts and the sorted rows travel to their owners and back by all-to-all; routing, capacity, the
statistics (of this rank's tokens) and the scatter-add are the same. Under tensor parallelism (sequence
parallel, runtime/parallel/tensor.py) the input is a sequence shard (a DTensor Shard(1)): the routed path
runs on this rank's tokens, the shared experts (tensor-parallel) on the gathered sequence, and `sequence`
supplies the other shards' counts where one process's arithmetic needs the whole micro-batch (the
balancing loss's load fractions, the capacity's slot positions). Under context parallelism
(runtime/parallel/context.py) `sequence` spans the cp x tp ranks, whose tokens are the head and tail chunks
of the same sequences: the load fractions are summed over all of them (Megatron-Core's router reduces its
tokens per expert over the same tp x cp group, megatron/core/transformer/moe/router.py `_apply_aux_loss`), and
the capacity keeps the slots one process keeps, in one process's token order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.runtime.model.feed_forward import FeedForward


@dataclass(frozen=True)
class MoEArgs:
    """model.moe, concrete: widths filled, the router's fields flattened."""

    experts: int
    top_k: int
    expert_ffn_hidden: int
    shared_ffn_hidden: int = 0  # the shared experts' total width; 0: none
    dense_layers: int = 0
    score: str = "softmax"
    normalize_top_k: bool = True
    aux_loss_coeff: float = 0.0
    bias_update_rate: float | None = None
    capacity_factor: float | None = None

    @classmethod
    def from_config(cls, moe: Any, ffn_hidden: int) -> MoEArgs:
        from hpctrain.config.moe import expert_width, shared_width

        r = moe.router
        return cls(experts=moe.experts, top_k=moe.top_k, expert_ffn_hidden=expert_width(moe, ffn_hidden),
                   shared_ffn_hidden=shared_width(moe, ffn_hidden), dense_layers=moe.dense_layers,
                   score=r.score, normalize_top_k=r.normalize_top_k, aux_loss_coeff=r.aux_loss_coeff,
                   bias_update_rate=r.bias_update_rate, capacity_factor=r.capacity_factor)


_paused = 0  # > 0 inside paused_moe_stats()


@contextlib.contextmanager
def paused_moe_stats() -> Iterator[None]:
    """Forwards that are not training steps (the pipeline's shape inference) record no statistics."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def _in_backward() -> bool:
    """True inside autograd's backward: where activation checkpointing recomputes a forward."""
    return bool(torch._C._current_graph_task_id() != -1)


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; backward gives `aux` the gradient `scale` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device, dtype=torch.float32), None


class Router(nn.Module):
    """Token-choice top-k routing, computed in fp32 whatever the autocast or parameter dtype."""

    expert_bias: torch.Tensor | None

    def __init__(self, hidden: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(hidden, args.experts, bias=False)
        if args.bias_update_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(args.experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, h] -> (top-k weights [tokens, k] fp32, expert ids [tokens, k], scores [tokens, E] fp32)."""
        from torch.distributed.tensor import DTensor, Partial

        weight = self.gate.weight
        if isinstance(weight, DTensor):  # replicated over tp: the gradient sums the sequence shards'
            weight = weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), weight.float())
        scores = F.softmax(logits, dim=-1) if self.args.score == "softmax" else torch.sigmoid(logits)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        _, ids = torch.topk(choice.detach(), self.args.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        if self.args.normalize_top_k:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids, scores


EXPERT_LOAD_KEY = "expert_load_ep"  # metrics.jsonl: expert_load_ep<N> (hpctrain/plan/expert_load.py reads them)


def expert_rank_loads(counts: torch.Tensor) -> dict[str, float]:
    """`expert_load_ep<N>` for every N > 1 that divides the experts: with the experts placed on N expert-parallel
    ranks as the runtime places them (contiguous blocks of experts / N, runtime/parallel/expert.py), the busiest
    rank's routed tokens over the mean rank's, averaged over the MoE layers that routed any ([layers, experts]
    `counts` of one step). A layer's expert GEMMs and all-to-alls wait for its busiest rank, and the layers' times
    add up, hence the mean over layers. Grouping whole blocks of experts can only lower the ratio (each rank's load
    is the mean of its experts'), so it never exceeds the per-expert figure at N = experts."""
    counts = counts[counts.sum(dim=1) > 0]
    experts = counts.shape[1]
    if counts.shape[0] == 0:
        return {}
    out = {}
    for n in range(2, experts + 1):
        if experts % n:
            continue
        ranks = counts.reshape(counts.shape[0], n, experts // n).sum(dim=2)
        out[f"{EXPERT_LOAD_KEY}{n}"] = float((ranks.max(dim=1).values / ranks.mean(dim=1)).mean())
    return out


def use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands here (module docstring); else the loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        aligned = all(int(n) % 16 == 0 for n in weight.shape[1:])  # 16-byte aligned rows in bf16
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0) and aligned
    return False


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times weight[e].T.

    x [R, in], weight [E, out, in] (nn.Linear layout per expert) -> [R, out]."""
    if x.shape[0] == 0:  # still a function of weight: a rank with no rows gives it a (zero) gradient too
        return x @ weight[0].transpose(0, 1)
    if use_grouped_mm(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    pieces = torch.split(x, counts.tolist())
    return torch.cat([piece @ weight[e].transpose(0, 1) for e, piece in enumerate(pieces)])


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight: all of them, or its Shard(0) slice under expert parallelism."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts as three stacked weights, run as grouped GEMMs."""

    def __init__(self, hidden: int, ffn_hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [R, h] sorted by expert, counts [E] -> [R, h]."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(grouped_linear(x, w1, counts, offsets)) * grouped_linear(x, w3, counts, offsets)
        return grouped_linear(h, w2, counts, offsets)


class MoE(nn.Module):
    """The block's FFN slot when the block is a MoE block (transformer.py's TransformerBlock)."""

    def __init__(self, hidden: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(hidden, args)
        self.experts = GroupedExperts(hidden, args.expert_ffn_hidden, args.experts)
        self.shared = FeedForward(hidden, args.shared_ffn_hidden, swiglu=True) if args.shared_ffn_hidden else None
        self.backward_scale = 0.0  # set by the trainer before each step (module docstring)
        self.ep: Any = None  # runtime/parallel/expert.py's ExpertGroup under expert parallelism
        self.sequence: Any = None  # runtime/parallel/sequence.py's SequenceShards under tp (sequence parallel)
        self.clear_stats()

    def clear_stats(self) -> None:
        self.stat_counts: torch.Tensor | None = None  # tokens routed to each expert, this step [E]
        self.stat_dropped = 0.0
        self.stat_aux: list[torch.Tensor] = []  # this rank's term of each micro-batch's balancing loss
        self.stat_aux_count = 0.0  # micro-batches those terms make up (1 / tp each under sequence parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        full = x  # under sequence parallelism a DTensor Shard(1): the shared experts gather it (tensor.py)
        if isinstance(x, DTensor):
            x = x.to_local()  # this tp rank's sequence shard; the routed path runs on its tokens only
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        tokens, k, experts = flat.shape[0], self.args.top_k, self.args.experts
        shards = self.sequence.size if self.sequence is not None else 1
        weights, ids, scores = self.router(flat)
        flat_ids = ids.reshape(-1)  # [tokens * k], token-major
        # scatter_add, not bincount: its output has a static shape (the planner's fake-tensor dry builds)
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, tokens in order within
        kept_counts = counts
        if self.args.capacity_factor is not None:
            capacity = math.ceil(self.args.capacity_factor * tokens * shards * k / experts)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[flat_ids[order]]
            if self.sequence is not None:
                position = position + self._earlier_slots(flat_ids, order, batch, seq)
            keep = position < capacity
            order = order[keep]
            kept_counts = torch.zeros_like(counts).scatter_add_(0, flat_ids[order], torch.ones_like(order))
        token_of = order // k
        if self.ep is None:
            routed = self.experts(flat[token_of], kept_counts)
        else:  # the experts live on the ep ranks that own them
            routed = self.ep.run(self, flat[token_of], kept_counts)
        gate = weights.reshape(-1)[order].to(routed.dtype)
        out = torch.zeros(tokens, hidden, dtype=routed.dtype, device=x.device)
        out = out.index_add(0, token_of, routed * gate[:, None])
        out = out.reshape(batch, seq, hidden)
        if self.shared is not None:
            out = out + self.shared(full).to(out.dtype)  # [b, s/tp, h] under sequence parallelism, as out
        aux = self._balance_loss(scores, counts, tokens) if self.args.aux_loss_coeff > 0 else None
        if not _in_backward() and not _paused:
            self._record(counts, order.numel(), tokens * k, aux)
        if aux is not None and torch.is_grad_enabled():
            out = AuxLoss.apply(out, aux, self.backward_scale)
        return out

    def _balance_loss(self, scores: torch.Tensor, counts: torch.Tensor, tokens: int) -> torch.Tensor:
        """Switch Transformer's E * sum_i f_i P_i (Fedus et al. 2021, eq. 4-6): f_i the fraction of routed
        slots expert i got, P_i its mean routing probability (sigmoid scores normalised per token).

        Under sequence parallelism f is the whole micro-batch's (the shards' counts summed) and this rank's
        term is E * sum_i f_i P_i(its tokens) / tp: the terms sum to the micro-batch's loss and each one's
        gradient is the loss's gradient with respect to this rank's scores. Under context parallelism f is
        summed over the cp x tp ranks too, but the division is by tp only (`loss_shards`): each cp rank's terms
        make a loss of its own tokens, and FSDP averages the gradients over dp x cp, as it does the language-model
        loss's, so the mean over the cp ranks is the micro-batch's loss."""
        probs = scores if self.args.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        shards, loss_shards = 1, 1
        if self.sequence is not None:
            counts, shards, loss_shards = self.sequence.sum(counts), self.sequence.size, self.sequence.loss_shards
        fraction = counts.float() / max(tokens * shards * self.args.top_k, 1)
        return self.args.experts * torch.sum(fraction * probs.mean(dim=0)) / loss_shards

    def _earlier_slots(self, flat_ids: torch.Tensor, order: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Across the sequence shards, per slot of `order`: what turns its position among this rank's slots of its
        expert into its position in one process's order, so that capacity keeps the same slots. One process's order is sequence by sequence, each in position order; a rank
        holds blocks of consecutive positions of every sequence (`SequenceShards.blocks`: one contiguous shard
        per tp rank, the head and tail chunks of a cp rank): the slots of every rank per (sequence, block,
        expert) are summed over the group, and a slot's one-process position is its position within its own
        block plus the slots of its expert in every earlier (sequence, block)."""
        experts, k = self.args.experts, self.args.top_k
        g, blocks, total = self.sequence.blocks(seq, flat_ids.device)
        local_blocks = seq // g
        token = order // k
        row, block = token // seq, (token % seq) // g  # the slot's sequence and this rank's block of it
        expert_of = flat_ids[order]
        mine = torch.zeros(batch * local_blocks * experts, dtype=torch.int64, device=flat_ids.device).scatter_add_(
            0, (row * local_blocks + block) * experts + expert_of, torch.ones_like(order)).reshape(batch, local_blocks, experts)
        every = torch.zeros(batch, total, experts, dtype=torch.int64, device=flat_ids.device)
        every[:, blocks] = mine
        every = self.sequence.sum(every).reshape(batch * total, experts)
        earlier = (torch.cumsum(every, 0) - every).reshape(batch, total, experts)  # slots in earlier (seq, block)s
        own = mine.reshape(batch * local_blocks, experts)
        own_earlier = (torch.cumsum(own, 0) - own).reshape(batch, local_blocks, experts)
        return earlier[row, blocks[block], expert_of] - own_earlier[row, block, expert_of]

    @torch.no_grad()
    def _record(self, counts: torch.Tensor, kept: int, routed: int, aux: torch.Tensor | None) -> None:
        c = counts.detach().float()
        self.stat_counts = c if self.stat_counts is None else self.stat_counts + c
        self.stat_dropped += float(routed - kept) if self.args.capacity_factor is not None else 0.0
        if aux is not None:
            self.stat_aux.append(aux.detach())
            self.stat_aux_count += 1.0 / (self.sequence.loss_shards if self.sequence is not None else 1)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step (section 2.1.2): bias += rate * sign(mean load - load), `counts` the
        step's tokens per expert summed over every rank (the same on all ranks, so the bias stays equal)."""
        if self.router.expert_bias is None or self.args.bias_update_rate is None:
            return
        c = counts.to(self.router.expert_bias.device, torch.float32)
        self.router.expert_bias.add_(self.args.bias_update_rate * torch.sign(c.mean() - c))
