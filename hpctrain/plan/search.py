"""Layout search: every (tp, pp, dp, micro_batch, schedule, virtual_stages, ac, zero, offload)
the job and the hardware allow, filtered with a reason each, ranked by estimated tokens/s.

Checks run from the cheapest to the most expensive, so a (tp, pp) family that fails a structural
check is rejected once, not once per micro-batch and AC mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from hpctrain.config.plugins_off import collector_paused
from hpctrain.plan.activations import DEFAULT_EXPERT_LOAD_IMBALANCE
from hpctrain.plan.cost import step_cost
from hpctrain.plan.cost_setup import CostSetup, StepCost
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.kernels import DEFAULT_EXPERT_STEP_IMBALANCE
from hpctrain.plan.lora import LoraShape
from hpctrain.plan.memory import MemoryProbe, activation_terms
from hpctrain.plan.rank_setup import MemoryBreakdown, RankSetup
from hpctrain.plan.model_stats import stage_param_count
from hpctrain.plan.space import MAX_STAGE_IMBALANCE, Choices, Rejections, ep_layout_problem
from hpctrain.plan.stages import balanced_stage_split, megatron_unit_split, stage_imbalance

if TYPE_CHECKING:
    from hpctrain.config import Job

StageLayers = list[tuple[int, int]]


@dataclass(frozen=True)
class Layout:
    """One feasible layout with its predicted memory (most loaded rank) and step cost."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: str  # "none" when pp == 1
    virtual_stages: int
    ac: str
    zero: int
    offload_optimizer: bool
    sequence_parallel: bool
    stage_layers: tuple[tuple[int, int], ...]
    stage_imbalance: float
    # Its memory, the breakdown built when first read (`memory`, `peak_rank`): a search keeps thousands of layouts
    # and a report reads a few breakdowns.
    probe: MemoryProbe = field(compare=False, repr=False)
    cost: StepCost
    cp: int = 1  # context parallelism: dp x cp x tp x pp == world
    ep: int = 1  # expert parallelism: routed experts over ep of the dp x cp x tp ranks

    @property
    def memory(self) -> MemoryBreakdown:
        """The most loaded pipeline rank's memory at its peak phase."""
        return self.probe.peak()[1]

    @property
    def peak_rank(self) -> int:
        """The pipeline rank whose memory `memory` is."""
        return self.probe.peak()[0]

    def label(self) -> str:
        return layout_label(self.tp, self.pp, self.dp, self.cp, self.ep, self.micro_batch, self.schedule,
                            self.virtual_stages, self.ac, self.zero, self.offload_optimizer)


def layout_label(tp: int, pp: int, dp: int, cp: int, ep: int, micro_batch: int, schedule: str, virtual_stages: int,
                 ac: str, zero: int, offload: bool) -> str:
    """`Layout.label` of these fields."""
    sched = "" if pp == 1 else f" {schedule}" + (f" v={virtual_stages}" if virtual_stages > 1 else "")
    extra = (f" cp={cp}" if cp > 1 else "") + (f" ep={ep}" if ep > 1 else "")
    return f"tp={tp} pp={pp} dp={dp}{extra} mb={micro_batch}{sched} ac={ac} zero={zero}" + (" offload" if offload else "")


@dataclass(frozen=True)
class SearchSettings:
    """What the search needs beyond the layout dimensions."""

    global_batch: int
    precision: str
    optimizer: str
    budget_bytes: float
    overhead_bytes: float
    lora: LoraShape | None = None
    attention: str = "flash"  # cost.ATTENTION_KERNELS: the runtime's own is flash
    embedding_on_cpu: bool = False  # train.embedding_on_cpu: the table and its states in host memory
    cp_rotate: str = "allgather"  # parallel.cp_rotate (plan/context.py)
    fp8: bool = False  # train.precision fp8 (memory is priced in `precision`, its high precision)
    fp8_min_width: int = 1024
    fp8_recipe: str = "tensorwise"  # train.fp8.recipe (kernels.FP8_RECIPES)
    fp8_all_gather: bool = False  # fp8 tensorwise: under FSDP the weights are torchao wrappers (RankSetup.foreach)
    # train.precision fp8, emulated or not: the recipe whose converted linears the memory model prices
    # (RankSetup.fp8_recipe; `fp8` above is the cost model's, off under emulation)
    memory_fp8_recipe: str | None = None
    compile: bool = False  # train.compile: the runtime compiles the blocks of tp == 1 layouts
    compile_with_tp: bool = False  # a published run's software fuses element-wise work under TP too (bench only)
    expert_load_imbalance: float | None = None  # the busiest ep rank's load; None: kernels.DEFAULT_EXPERT_STEP_IMBALANCE
    # A run's measured load per ep ((ep, busiest rank / mean), plan/expert_load.py): prices the step and the busiest
    # rank's memory of each layout at its own ep; an ep it lacks falls back as above.
    expert_load_by_ep: tuple[tuple[int, float], ...] = ()
    selective_mm_recompute: float = 0.0  # cost_setup.CostSetup's: a published run's selective policy (bench only)
    a2a_overlap: bool = False  # cost_setup.CostSetup's: a published run's overlapped expert all-to-alls (bench only)
    cp_repeated_kv: bool = False  # cost_setup.CostSetup's: a published run's CP gathers K/V repeated to the query heads
    dispatcher: str = "alltoall"  # cost_setup.CostSetup's: a published run's expert dispatcher (bench only)
    fp8_experts: bool = False  # cost_setup.CostSetup's: a published run's FP8 routed experts (bench only)
    tp_overlap: bool = False  # cost_setup.CostSetup's: a published run's TP collectives overlapped with GEMMs (bench only)
    dp_once_per_step: bool = False  # cost_setup.CostSetup's: Megatron-Core's distributed optimizer (bench only)
    moe_sync: str = "ep"  # cost_setup.CostSetup's: when a MoE block syncs with the host (moe_cost.MOE_SYNCS; others bench only)
    moe_recompute: bool = False  # cost_setup.CostSetup's: Megatron-Core's "moe" recompute module under selective (bench only)
    layer_graphs: bool = False  # cost_setup.CostSetup's: a published run's per-layer CUDA graphs (bench only)
    # stages.STAGE_SPLITS: a published run's pipeline split (bench only; it ran it, so no balance rule applies)
    stage_split: str = "balanced"

    def measured_load(self, ep: int) -> float | None:
        """The run's measured busiest-rank load at this ep, None when none was given for it."""
        return next((load for n, load in self.expert_load_by_ep if n == ep), None)


def optimizer_kind(job: Job) -> str:
    opt = job.train.optimizer
    if opt.name == "adamw":
        return "adamw"
    return "sgd-momentum" if opt.momentum > 0 else "sgd"


def _model_divisible(model: Any, tp: int) -> bool:
    return model.heads % tp == 0 and model.kv_heads % tp == 0 and model.ffn_hidden % tp == 0


class StageCache:
    """Stage splits and per-rank figures per (pp, v, ac): computed once, reused by every candidate."""

    def __init__(self, model: Any, kind: str = "balanced") -> None:
        self.model = model
        self.kind = kind
        self._splits: dict[tuple[int, int], tuple[StageLayers, float]] = {}
        self.memory: dict[Any, Any] = {}  # memory.MemoryProbe's memo: one model, one split per (pp, v)
        self.costs: dict[Any, Any] = {}  # cost.step_cost's memo: one model, one hardware
        self._busiest: dict[tuple[int, int, int, int], tuple[int, bool, float, int]] = {}

    def split(self, pp: int, v: int) -> tuple[StageLayers, float]:
        key = (pp, v)
        if key not in self._splits:
            if self.kind == "megatron-units":  # the publisher's split: it ran, whatever its balance
                try:
                    self._splits[key] = (megatron_unit_split(self.model, pp, v), 0.0)
                except ValueError:  # not a (pp, v) the publisher's software takes: out, as imbalanced
                    self._splits[key] = ([], float("inf"))
            else:
                layers = balanced_stage_split(self.model, pp, v)
                self._splits[key] = (layers, stage_imbalance(self.model, layers, pp))
        return self._splits[key]

    def busiest(self, pp: int, v: int, tp: int, ep: int) -> tuple[int, bool, float, int]:
        """`busiest_rank` of the (pp, v) split, and the layers of the rank that holds the head."""
        key = (pp, v, tp, ep)
        if key not in self._busiest:
            stage_layers = self.split(pp, v)[0]
            last = (len(stage_layers) - 1) % pp
            head_layers = sum(b - a for i, (a, b) in enumerate(stage_layers) if i % pp == last)
            self._busiest[key] = (*busiest_rank(self.model, stage_layers, pp, tp, ep), head_layers)
        return self._busiest[key]


def busiest_rank(model: Any, stage_layers: StageLayers, pp: int, tp: int, ep: int = 1) -> tuple[int, bool, float]:
    """(layers, holds the head, parameters on one TP rank) of the pipeline rank with the most layers."""
    sizes = [0] * pp
    for index, (a, b) in enumerate(stage_layers):
        sizes[index % pp] += b - a
    rank = sizes.index(max(sizes))
    last = len(stage_layers) - 1
    params = sum(stage_param_count(model, a, b, has_embedding=i == 0, has_head=i == last, tp=tp, ep=ep)
                 for i, (a, b) in enumerate(stage_layers) if i % pp == rank)
    return sizes[rank], rank == (last % pp), float(params)


def search(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings) -> tuple[list[Layout], Rejections, int]:
    """All feasible layouts, best first, the rejections, and the number of candidates evaluated (in this process;
    plan/split_search.py's `search_with_workers` may split a large search over several, with the same result)."""
    with collector_paused():  # a search makes ~10^5 objects and no cycles (config/plugins_off.py)
        found: list[Layout | SetAside] = []
        rejected = Rejections()
        evaluated = search_part(model, hw, choices, settings, family_triples(choices),
                                StageCache(model, settings.stage_split), found, rejected)
        return ranked(prefer_selective(found, rejected)), rejected, evaluated


Triple = tuple[int, int, int]  # (tp, pp, cp), the search's outer loops


def family_triples(choices: Choices) -> list[Triple]:
    """Every (tp, pp, cp) in the search's order: a (tp, pp) family's triples next to each other."""
    return [(tp, pp, cp) for tp in choices.tp for pp in choices.pp for cp in choices.cp]


class FamilyRejected(NamedTuple):
    """A (tp, pp, cp) that a structural check rejects: the reason (space.REASONS) and its example."""

    reason: str
    example: str


class FamilyOpen(NamedTuple):
    """A (tp, pp, cp) that passes the structural checks: its dp and the ep degrees that fit."""

    dp: int
    eps: list[int]


def family_check(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings,
                 triple: Triple) -> FamilyOpen | FamilyRejected | None:
    """What the structural checks say of one (tp, pp, cp), cheapest first: None when the world does not split so
    (or dp is fixed to another)."""
    tp, pp, cp = triple
    world = hw.world_size
    if world % (tp * pp * cp):
        return None
    dp = world // (tp * pp * cp)
    if choices.dp is not None and dp != choices.dp:
        return None
    tag = f"tp={tp} pp={pp} dp={dp}" + (f" cp={cp}" if cp > 1 else "")
    if cp > 1 and choices.sequence_parallel and tp > 1 and (model.seq_len // cp) % tp:
        return FamilyRejected("cp_does_not_split_sequence", f"{tag}: seq_len={model.seq_len}")
    if tp > hw.nvlink_island_gpus or hw.nvlink_island_gpus % tp:
        return FamilyRejected("tp_exceeds_nvlink_island", f"{tag}: NVLink islands of {hw.nvlink_island_gpus} GPU(s)")
    if not _model_divisible(model, tp):
        return FamilyRejected("tp_does_not_divide_model", f"{tag}: heads={model.heads} kv_heads={model.kv_heads} "
                              f"ffn_hidden={model.ffn_hidden}")
    if pp > model.layers:
        return FamilyRejected("pp_exceeds_layers", f"{tag}: {model.layers} layers")
    problems = [ep_layout_problem(ep, dp, tp, choices.sequence_parallel and tp > 1, model.moe is not None, cp)
                for ep in choices.ep]
    fitting = [ep for ep, problem in zip(choices.ep, problems) if problem is None]
    if not fitting:
        return FamilyRejected("ep_does_not_divide_dp", f"{tag}: {problems[0]}")
    if settings.global_batch % dp:
        return FamilyRejected("global_batch_not_divisible", f"{tag}: global_batch={settings.global_batch}")
    return FamilyOpen(dp, fitting)


def search_part(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, triples: list[Triple],
                stages: StageCache, found: list[Layout | SetAside], rejected: Rejections) -> int:
    """Search `triples` in order, appending to `found` and `rejected`; the candidates evaluated."""
    evaluated = 0
    for triple in triples:
        checked = family_check(model, hw, choices, settings, triple)
        if checked is None:
            continue
        tp, pp, cp = triple
        if isinstance(checked, FamilyRejected):
            rejected.add(checked.reason, checked.example, (tp, pp))
            continue
        for ep in checked.eps:
            evaluated += _search_family(model, hw, choices, settings, tp, pp, checked.dp, stages, found, rejected, cp,
                                        ep)
    return evaluated


def ranked(layouts: list[Layout]) -> list[Layout]:
    """Best first: by tokens/s, then the recomputation mode that recomputes less, then memory (a stable sort, the
    search's order among equals). Memory by the rank totals (MemoryProbe.peak_total), the breakdowns' totals up to
    rounding: only where neighbours' totals lie within rounding of each other are their breakdowns built and they
    ordered by those, so the order is the one the breakdowns give."""
    keys = [(-lay.cost.tokens_per_s, AC_ORDER[lay.ac], lay.probe.peak_total()) for lay in layouts]
    order = sorted(range(len(layouts)), key=keys.__getitem__)
    out: list[Layout] = []
    start = 0
    while start < len(order):
        end = start + 1
        head = keys[order[start]][:2]
        while end < len(order) and keys[order[end]][:2] == head and \
                keys[order[end]][2] <= keys[order[end - 1]][2] * (1 + 1e-9):
            end += 1
        group = order[start:end]
        if len(group) > 1:
            group.sort(key=lambda i: (layouts[i].memory.total, i))
        out.extend(layouts[i] for i in group)
        start = end
    return out


AC_ORDER = {"none": 0, "selective": 1, "full": 2}  # ties go to the mode that recomputes less


@dataclass(frozen=True)
class SetAside:
    """A full-recomputation layout that fits beside its fitting selective twin, left in the search's list without a
    breakdown or a cost: `prefer_selective` drops it whatever they are (its place in the list keeps the order of the
    rejections' examples)."""

    label: str
    family: tuple[int, int]


def prefer_selective(layouts: list[Layout | SetAside], rejected: Rejections) -> list[Layout]:
    """Drop every full-recomputation layout whose twin with selective recomputation (same tp, pp,
    dp, micro-batch, schedule, zero, offload) fits: full re-runs every GEMM of the forward and two
    more TP collectives per layer (Korthikanti et al. 2022, table 2: selective recomputes ~2-5 %
    of the FLOPs, full ~33 %), so it is only worth its time where selective does not fit. A `SetAside` is one
    the search already knew so of."""
    def twin(lay: Layout) -> tuple[Any, ...]:
        return (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.micro_batch, lay.schedule, lay.virtual_stages, lay.zero,
                lay.offload_optimizer)

    selective = {twin(lay) for lay in layouts if isinstance(lay, Layout) and lay.ac == "selective"}
    kept = []
    for lay in layouts:
        if isinstance(lay, SetAside):
            rejected.add("selective_recompute_fits", f"{lay.label}: fits with ac=selective", lay.family)
        elif lay.ac == "full" and twin(lay) in selective:
            rejected.add("selective_recompute_fits", f"{lay.label()}: fits with ac=selective", (lay.tp, lay.pp))
        else:
            kept.append(lay)
    return kept


_D = TypeVar("_D")


def frozen_with(cls: type[_D], *fields: Mapping[str, Any]) -> _D:
    """The frozen dataclass `cls` holding `fields` (later mappings win), built without running its `__init__`
    (RankSetup and CostSetup have no `__post_init__` and no slots): ~0.4 us against ~3-5 us, for each of the up to
    ~10^5 candidates of a search (tests/plan/test_search_memo.py holds the result to `dataclasses.replace`'s)."""
    new = object.__new__(cls)
    for part in fields:
        new.__dict__.update(part)
    return new


def _variant(template: _D, changes: dict[str, Any]) -> _D:
    """`dataclasses.replace(template, **changes)`, through `frozen_with`."""
    return frozen_with(type(template), vars(template), changes)


def _search_family(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, tp: int, pp: int, dp: int,
                   stages: StageCache, layouts: list[Layout | SetAside], rejected: Rejections, cp: int = 1,
                   ep: int = 1) -> int:
    family, tag = (tp, pp), f"tp={tp} pp={pp} dp={dp}" + (f" cp={cp}" if cp > 1 else "") + (f" ep={ep}" if ep > 1 else "")
    measured = settings.measured_load(ep) if settings.expert_load_by_ep else None
    sp = choices.sequence_parallel and tp > 1
    local_batch = settings.global_batch // dp
    evaluated = 0
    # Every candidate's setups differ from these in the fields of the loops below only (`_variant`).
    rank_template = RankSetup(tp=tp, pp=pp, dp=dp, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1,
                              ac="none", zero=0, offload_optimizer=False, sequence_parallel=sp,
                              precision=settings.precision, optimizer=settings.optimizer,
                              overhead_bytes=settings.overhead_bytes, lora=settings.lora, attention=settings.attention,
                              cp=cp, ep=ep, cpu_attention=hw.gpu.name == "cpu", embedding_on_cpu=settings.embedding_on_cpu,
                              cp_rotate=settings.cp_rotate, fp8_recipe=settings.memory_fp8_recipe,
                              fp8_min_width=settings.fp8_min_width,
                              expert_load_imbalance=DEFAULT_EXPERT_LOAD_IMBALANCE if measured is None else measured)
    for schedule, v in choices.schedules(pp, model.layers):
        stage_layers, imbalance = stages.split(pp, v)
        if imbalance > MAX_STAGE_IMBALANCE:
            rejected.add("stages_imbalanced", f"{tag} v={v}: imbalance {imbalance:.0%}", family)
            continue
        busiest_layers, busiest_head, busiest_params, head_layers = stages.busiest(pp, v, tp, ep)
        stage_tuple = tuple(stage_layers)
        cost_template = CostSetup(
            tp=tp, pp=pp, dp=dp * cp, cp=cp, micro_batch=1, micro_batches=1, virtual_stages=v, ac="none", zero=0,
            offload_optimizer=False, precision=settings.precision, max_rank_layers=busiest_layers,
            max_rank_has_head=busiest_head, head_rank_layers=head_layers, rank_params=busiest_params,
            sequence_parallel=sp, attention=settings.attention, embedding_on_cpu=settings.embedding_on_cpu, ep=ep,
            cp_rotate=settings.cp_rotate, fp8=settings.fp8, fp8_min_width=settings.fp8_min_width,
            fp8_recipe=settings.fp8_recipe, compile=settings.compile and (tp == 1 or settings.compile_with_tp),
            expert_load_imbalance=(measured if measured is not None else
                                   DEFAULT_EXPERT_STEP_IMBALANCE if settings.expert_load_imbalance is None
                                   else settings.expert_load_imbalance),
            selective_mm_recompute=settings.selective_mm_recompute, a2a_overlap=settings.a2a_overlap,
            cp_repeated_kv=settings.cp_repeated_kv, dispatcher=settings.dispatcher, fp8_experts=settings.fp8_experts,
            tp_overlap=settings.tp_overlap, dp_once_per_step=settings.dp_once_per_step, moe_sync=settings.moe_sync,
            moe_recompute=settings.moe_recompute, layer_graphs=settings.layer_graphs)
        # (ac, zero, offload) whose first micro-batches' loss on rank 0 already put a smaller micro-batch over the
        # budget and past the family's closest miss: that floor does not fall as the micro-batch grows
        # (MemoryProbe.first_loss_floor), so each larger one is a miss that changes nothing but the count.
        over_at_any_larger: set[tuple[str, int, bool]] = set()
        previous_mb = 0
        for mb in choices.micro_batches(local_batch):
            if mb < previous_mb:  # the rule needs growing micro-batches
                over_at_any_larger.clear()
            previous_mb = mb
            if local_batch % mb:
                rejected.add("local_batch_not_divisible", f"{tag} mb={mb}: local batch {local_batch}", family)
                continue
            m = local_batch // mb
            selective_fits: set[tuple[int, bool]] = set()  # this micro-batch's fitting selective layouts
            acts: dict[tuple[str, bool], Any] = {}  # its activation terms per (ac, fsdp): the same at every zero
            if pp > 1 and (m < pp or (schedule == "interleaved-1f1b" and m % pp)):
                rejected.add("too_few_micro_batches", f"{tag} mb={mb} {schedule}: {m} micro-batches", family)
                continue
            for ac in choices.ac:
                for zero in choices.zeros(dp, pp):
                    for offload in choices.offload:
                        evaluated += 1
                        if (ac, zero, offload) in over_at_any_larger:
                            rejected.count_memory_miss()
                            continue
                        setup = _variant(rank_template, {
                            "micro_batch": mb, "micro_batches": m, "schedule": schedule, "virtual_stages": v, "ac": ac,
                            "zero": zero, "offload_optimizer": offload,
                            "foreach": settings.fp8_all_gather and (dp * cp > 1 or offload)})
                        # Over the budget on the probe's rank totals (most of a long-sequence search's misses):
                        # counted without building a breakdown where its total would change no example and no
                        # family's closest miss.
                        fsdp = dp * cp > 1 or offload  # the activations' precision mode reads it (RankSetup.fsdp)
                        act = acts.get((ac, fsdp))
                        if act is None:
                            act = acts[(ac, fsdp)] = activation_terms(model, setup, stages.memory)
                        probe = MemoryProbe(model, stage_layers, setup, stages.memory, act)
                        bar = rejected.memory_miss_bar(family)
                        if bar is not None and probe.over(settings.budget_bytes, bar):
                            rejected.count_memory_miss()
                            floor = probe.first_loss_floor() * (1 - 1e-9)
                            if floor > settings.budget_bytes and floor >= bar:
                                over_at_any_larger.add((ac, zero, offload))
                            continue
                        if ac == "full" and (zero, offload) in selective_fits \
                                and probe.peak_total() < settings.budget_bytes * (1 - 1e-9):
                            # fits, beside a fitting selective twin: prefer_selective drops it, whatever it costs
                            layouts.append(SetAside(layout_label(tp, pp, dp, cp, ep, mb, schedule, v, ac, zero, offload),
                                                    family))
                            continue
                        # The breakdown only where the rank totals leave the budget in doubt, or for a miss's example.
                        if probe.peak_total() >= settings.budget_bytes * (1 - 1e-9):
                            memory = probe.peak()[1]
                            if memory.total > settings.budget_bytes:
                                label = f"{tag} mb={mb} {schedule} v={v} ac={ac} zero={zero}{' offload' if offload else ''}"
                                rejected.add_memory_miss(f"{label}: {memory.total / 2**30:.1f} GiB > "
                                                         f"{settings.budget_bytes / 2**30:.1f} GiB", family, memory.total)
                                continue
                        cost = step_cost(model, hw, _variant(cost_template, {
                            "micro_batch": mb, "micro_batches": m, "ac": ac, "zero": zero, "offload_optimizer": offload}),
                            settings.global_batch, stages.costs)
                        layouts.append(Layout(tp, pp, dp, mb, schedule, v, ac, zero, offload, sp, stage_tuple,
                                              imbalance, probe, cost, cp, ep))
                        if ac == "selective":
                            selective_fits.add((zero, offload))
    return evaluated
