"""The search space of one job: which values of each layout dimension to try, and why some fail.

A dimension the job fixes has one value; an "auto" one gets every value the hardware allows.
Rejection reasons are stable keys (plan.json `rejected.counts`) with a one-line explanation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpctrain.plan.context import cp_candidates
from hpctrain.plan.model_stats import AC_MODES

if TYPE_CHECKING:
    from hpctrain.config import Job

AUTO = "auto"
SCHEDULES_PP = ("1f1b", "interleaved-1f1b", "gpipe")
MAX_MICRO_BATCH = 64
VIRTUAL_STAGE_CHOICES = (2, 3, 4, 6, 8)
MAX_STAGE_IMBALANCE = 0.15  # issue 4 item 5; the doctor flags the same 15 % between ranks

REASONS: dict[str, str] = {
    "tp_exceeds_nvlink_island": "TP larger than an NVLink island (TP traffic would cross PCIe or the network)",
    "tp_does_not_divide_model": "heads, kv_heads or ffn_hidden not divisible by TP",
    "pp_exceeds_layers": "more pipeline stages than layers",
    "stages_imbalanced": f"layers not splittable into balanced stages (compute imbalance > "
                         f"{MAX_STAGE_IMBALANCE:.0%}, embedding and head counted)",
    "global_batch_not_divisible": "global batch not divisible by dp",
    "ep_does_not_divide_dp": "parallel.ep does not fit the layout (it must divide dp x cp x tp, be a multiple of tp "
                             "when tp > 1, with sequence parallelism on: expert parallelism borrows dp, cp and tp ranks)",
    "cp_does_not_split_sequence": "seq_len / cp not divisible by tp under sequence parallelism",
    "local_batch_not_divisible": "local batch (global_batch / dp) not divisible by micro_batch",
    "too_few_micro_batches": "fewer micro-batches than pipeline stages (or not a multiple of pp for interleaving)",
    "memory_over_budget": "memory over budget on the most loaded rank",
    "selective_recompute_fits": "full recomputation where selective recomputation fits the same layout",
}

# What one count of each reason stands for. The search rejects whole (tp, pp) families, pipeline splits
# and micro-batch sizes before it builds candidates; only the memory check and the recomputation
# preference see single candidates, so `fit + memory_over_budget + selective_recompute_fits ==
# evaluated` and the other counts are in their own units.
REASON_UNITS: dict[str, str] = {
    "tp_exceeds_nvlink_island": "(tp, pp) families",
    "tp_does_not_divide_model": "(tp, pp) families",
    "pp_exceeds_layers": "(tp, pp) families",
    "global_batch_not_divisible": "(tp, pp) families",
    "ep_does_not_divide_dp": "(tp, pp) families",
    "cp_does_not_split_sequence": "(tp, pp) families",
    "stages_imbalanced": "pipeline splits",
    "local_batch_not_divisible": "micro-batch sizes",
    "too_few_micro_batches": "micro-batch sizes",
    "memory_over_budget": "candidates",
    "selective_recompute_fits": "candidates",
}


def ep_layout_problem(ep: int, dp: int, tp: int, sequence_parallel: bool, moe: bool = True, cp: int = 1) -> str | None:
    """Why `ep` does not fit a (dp, cp, tp) layout, or None. torchtitan's ParallelDims with etp=1
    (torchtitan/distributed/parallel_dims.py): the experts' region efsdp x ep spans the dense region's
    dp x cp x tp ranks (context parallelism folded into the experts' grouping, Megatron-Core's "MoE parallel
    folding"), so ep divides dp x cp x tp; with tp > 1 an ep group holds whole tp groups (ep a multiple of
    tp; the experts are not tensor-parallel) and the MoE input must be sequence-sharded over tp (SP on).
    The runtime's rule (runtime/parallel/dims.py)."""
    if moe and tp > 1 and ep % tp:  # ep = 1 too: experts replicated over tp would see other ranks' tokens
        return f"ep={ep} is not a multiple of tp={tp}"
    if ep == 1:
        return None
    if (dp * cp * tp) % ep:
        region = f"dp x cp x tp = {dp * cp * tp}" if cp > 1 else f"dp x tp = {dp * tp}"
        return f"ep={ep} does not divide {region}"
    if tp > 1 and ep % tp:
        return f"ep={ep} is not a multiple of tp={tp}"
    if tp > 1 and not sequence_parallel:
        return f"ep={ep} with tp={tp} needs sequence_parallel"
    return None


def ep_candidates(ep: Any, model: Any, world: int) -> tuple[int, ...]:
    """parallel.ep's values to try: a fixed one as is; auto: 1 without model.moe, else every divisor of the
    expert count up to the world size (the runtime splits whole experts, runtime/parallel/expert.py); the
    search then keeps those that fit each (dp, tp) (ep_layout_problem) and ranks an ep group crossing nodes by
    its all-to-all's cost (cost.py), it does not forbid it."""
    if ep != AUTO:
        return (int(ep),)
    moe = getattr(model, "moe", None)
    if moe is None:
        return (1,)
    return tuple(d for d in divisors(int(moe.experts)) if d <= world)


def _fixed(value: Any) -> Any:
    return None if value == AUTO else value


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Choices:
    """Candidate values per dimension (a fixed job value gives a one-element tuple)."""

    tp: tuple[int, ...]
    pp: tuple[int, ...]
    dp: int | None
    micro_batch: int | None
    schedule: str | None
    virtual_stages: int | None
    ac: tuple[str, ...]
    zero: int | None
    offload: tuple[bool, ...]
    sequence_parallel: bool
    ep: tuple[int, ...] = (1,)  # parallel.ep: the job's, or with `auto` every divisor of the experts (ep_candidates)
    cp: tuple[int, ...] = (1,)  # parallel.cp: the job's, or 1 and more for a long sequence (plan/context.py)

    @classmethod
    def from_job(cls, job: Job) -> Choices:
        par, train = job.parallel, job.train
        world = job.cluster.nodes * job.cluster.gpus_per_node
        tp_fixed, pp_fixed = _fixed(par.tp), _fixed(par.pp)
        tp = (tp_fixed,) if tp_fixed is not None else tuple(d for d in divisors(world) if d <= job.cluster.gpus_per_node)
        pp = (pp_fixed,) if pp_fixed is not None else tuple(divisors(world))
        ac = _fixed(train.activation_checkpointing)
        offload = par.offload_optimizer
        return cls(
            tp=tp, pp=pp, dp=_fixed(par.dp), micro_batch=_fixed(train.micro_batch),
            schedule=_fixed(par.schedule), virtual_stages=_fixed(par.virtual_stages),
            ac=(ac,) if ac is not None else AC_MODES,
            zero=_fixed(par.zero),
            offload=(False, True) if offload == AUTO else (bool(offload),),
            sequence_parallel=bool(par.sequence_parallel),
            ep=ep_candidates(par.ep, job.model, world),
            cp=cp_candidates(par.cp, int(job.transformer.seq_len or 0), world),
        )

    def micro_batches(self, local_batch: int) -> list[int]:
        if self.micro_batch is not None:
            return [self.micro_batch]
        return [d for d in divisors(local_batch) if d <= MAX_MICRO_BATCH]

    def zeros(self, dp: int, pp: int) -> tuple[int, ...]:
        """FSDP2 runs zero 0 as zero 1 (runtime/parallel/fsdp.py), so auto tries 1-3; without dp, 0.
        Under pipelining torch's schedule defers both the reduce-scatter and the resharding to the
        last micro-batch, so zero 2 and 3 save nothing over 1 there: auto tries 1 only."""
        if self.zero is not None:
            return (self.zero,)
        if dp == 1:
            return (0,)
        return (1,) if pp > 1 else (1, 2, 3)

    def schedules(self, pp: int, layers: int) -> list[tuple[str, int]]:
        """(schedule, virtual_stages) pairs for a pipeline depth; ("none", 1) without pipelining."""
        if pp == 1:
            return [("none", 1)]
        names = (self.schedule,) if self.schedule is not None else SCHEDULES_PP
        out = []
        for name in names:
            if name != "interleaved-1f1b":
                out.append((name, 1))
                continue
            vs = (self.virtual_stages,) if self.virtual_stages is not None else VIRTUAL_STAGE_CHOICES
            out += [(name, v) for v in vs if v >= 2 and pp * v <= layers]
        return out


class Rejections:
    """Counts by reason and a few examples each; also the closest miss per (tp, pp) family."""

    MAX_EXAMPLES = 3

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self.family_reasons: dict[tuple[int, int], tuple[str, str]] = {}
        self._closest_miss_bytes: dict[tuple[int, int], float] = {}

    def add(self, reason: str, example: str, family: tuple[int, int], count: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + count
        examples = self.examples.setdefault(reason, [])
        if len(examples) < self.MAX_EXAMPLES:
            examples.append(example)
        self.family_reasons.setdefault(family, (reason, example))

    def add_memory_miss(self, example: str, family: tuple[int, int], total_bytes: float) -> None:
        """A layout over the memory budget; per family the smallest miss is kept as its reason."""
        self.counts["memory_over_budget"] = self.counts.get("memory_over_budget", 0) + 1
        examples = self.examples.setdefault("memory_over_budget", [])
        if len(examples) < self.MAX_EXAMPLES:
            examples.append(example)
        known = self.family_reasons.get(family)
        if known is None or known[0] != "memory_over_budget" or total_bytes < self._closest_miss_bytes[family]:
            self.family_reasons[family] = ("memory_over_budget", example)
            self._closest_miss_bytes[family] = total_bytes

    def memory_miss_bar(self, family: tuple[int, int]) -> float | None:
        """The total at or above which a layout over the memory budget could change nothing but the count
        (`count_memory_miss`): the family's closest miss, once the examples are full and the family's reason is a
        miss (`add_memory_miss` keeps a later one only when strictly smaller); None while its total is needed."""
        known = self.family_reasons.get(family)
        if (len(self.examples.get("memory_over_budget", ())) < self.MAX_EXAMPLES or known is None
                or known[0] != "memory_over_budget"):
            return None
        return self._closest_miss_bytes[family]

    def extend(self, later: Rejections) -> None:
        """Add the rejections of a search of what comes after everything here in the search's order
        (plan/split_search.py): what one search of both in order records (the counts summed, each reason's first
        examples, each family's first reason or its closest miss, as `add` and `add_memory_miss` keep them)."""
        for reason, count in later.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + count
        for reason, examples in later.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(examples[:max(0, self.MAX_EXAMPLES - len(mine))])
        for family, (reason, example) in later.family_reasons.items():
            if reason != "memory_over_budget":
                self.family_reasons.setdefault(family, (reason, example))
                continue
            total = later._closest_miss_bytes[family]  # its smallest miss: add_memory_miss's rule for it
            known = self.family_reasons.get(family)
            if known is None or known[0] != "memory_over_budget" or total < self._closest_miss_bytes[family]:
                self.family_reasons[family] = (reason, example)
                self._closest_miss_bytes[family] = total

    def count_memory_miss(self) -> None:
        """One more layout over the memory budget, whose total `memory_miss_bar` said could change nothing else."""
        self.counts["memory_over_budget"] += 1

    def to_json(self) -> dict[str, Any]:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples,
                "reasons": {key: REASONS[key] for key in sorted(self.counts)},
                "units": {key: REASON_UNITS[key] for key in sorted(self.counts)}}
