"""Memory per rank: model states, activations and buffers, as a breakdown at the peak moment.

The sharding stages are the ZeRO paper's (Rajbhandari et al. 2019, section 5.1): stage 1 shards the
optimizer states over the Nd data-parallel ranks, stage 2 also the gradients, stage 3 also the
weights. The byte counts are not the paper's DeepSpeed layout (16-bit weights and gradients plus
K = 12 bytes of fp32 state) but the runtime's (hpctrain/runtime): it keeps fp32 parameters as the
master weights and fp32 gradients, sharded by FSDP2 (runtime/parallel/fsdp.py), so a parameter costs
4 + 4 + 8 (AdamW moments) bytes, all sharded over dp whenever FSDP is on, plus a 16-bit unsharded
copy for compute. `rank_memory` accounts for that runtime, phase by phase (end of forward, end of
backward, optimizer step), and reports the components of the phase with the highest total — which
is what a memory tracker or torch.cuda.max_memory_allocated sees. The parameter-sized buffers it places are
plan/states.py's; what it takes and gives (RankSetup, MemoryBreakdown) is plan/rank_setup.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.plan.activations import (
    HALF_BYTES,
    backward_transient_bytes,
    dtypes,
    embedding_backward_transient_bytes,
    embedding_saved_bytes,
    expert_routing,
    ffn_output_input_bytes,
    ffn_saved_bytes_per_token,
    fp8_linear_params_per_layer,
    head_activations,
    in_flight_micro_batches,
    layer_activations,
    materialized_score_activations,
    norm_backward_transient_bytes,
    output_projection_backward_bytes,
    precision_mode,
    weight_copy_bytes_per_layer,
)
from hpctrain.plan.context import (
    cp_kv_extra_bytes,
    cp_output_join_bytes,
    cp_ring_recompute_extra_bytes,
    cp_ring_saved_delta_bytes,
    cpu_causal_mask_bytes,
    tokens_per_rank,
)
from hpctrain.plan.lora import lora_activations
from hpctrain.plan.rank_setup import ITEM_COMPONENTS, MemoryBreakdown, RankSetup
from hpctrain.plan.states import (
    ModelCounts,
    States,
    model_counts,
    rank_params,
    rank_routed_params,
    rank_states,
    states_key,
)


@dataclass(frozen=True)
class _ActivationTerms:
    """What one micro-batch's activations and buffers cost on a rank, whatever its pipeline position,
    sharding or optimizer: the part of `_phase_items` that many layouts of one search share."""

    tokens: int
    layer: Any  # LayerActivations (context parallelism's, the scores' and LoRA's terms included)
    head: Any  # HeadActivations
    copies_per_layer: float
    recompute: float
    transient: float
    ffn_output_input: float
    output_projection_backward: float
    ffn_part: float
    norm_backward_transient: float
    embedding_backward_transient: float


def _activation_key(s: RankSetup, mode: str) -> tuple[Any, ...]:
    """Every field of `s` that `_activation_terms` reads (with the precision mode)."""
    return (mode, s.micro_batch, s.cp, s.tp, s.sequence_parallel, s.ac, s.ep, s.expert_load_imbalance, s.attention,
            s.lora, s.cp_rotate, s.cpu_attention, s.cp_rank, s.fp8_recipe, s.fp8_min_width)


def _weight_copies_per_layer(model: Any, s: RankSetup, mode: str) -> float:
    """autocast's cached 16-bit weight copies of one layer (activations.weight_copy_bytes_per_layer), less those of
    the fp8 linears: torchao's Float8Linear casts its weight to fp8 itself, with no autocast-cached copy (measured
    against MemTracker: bench/memory_accuracy.py's fp8 configurations)."""
    copies = weight_copy_bytes_per_layer(model, s.tp, mode, s.ac)
    if s.fp8_recipe is not None and copies:
        copies -= HALF_BYTES * fp8_linear_params_per_layer(model, s.tp, s.fp8_min_width, s.fp8_recipe)
    return copies


def _activation_terms(model: Any, s: RankSetup, mode: str) -> _ActivationTerms:
    tokens = tokens_per_rank(s.micro_batch, model.seq_len, s.cp)
    routing = expert_routing(s.tp, s.sequence_parallel, s.ep, s.expert_load_imbalance)
    layer = layer_activations(model, tokens, s.tp, s.sequence_parallel, s.ac, mode, routing)
    layer = _context_parallel_layer(layer, model, s, mode)
    head = head_activations(model, tokens, s.tp, s.sequence_parallel, mode)
    if s.attention == "materialized":
        layer = materialized_score_activations(layer, model, tokens, s.tp, s.ac)
    if s.lora is not None:
        layer, head = lora_activations(layer, head, model, s.lora, tokens, s.tp, s.sequence_parallel, s.ac, mode)
    ffn_output_input = ffn_output_input_bytes(model, tokens, s.tp, mode)
    recompute = layer.recompute_peak_bytes - ffn_output_input
    if s.ac == "full":
        # Measured against MemTracker at the FFN backward of a recomputed block: with an fp32
        # stream (fp32, autocast) the recomputed RMSNorm saves the kept block input itself and a
        # second stream-sized tensor is already gone; with a 16-bit stream (fsdp-mp) one more
        # stream-sized tensor is alive. Each correction is one [tokens, hidden] stream tensor.
        stream = dtypes(mode).stream * model.hidden / (s.tp if s.sequence_parallel else 1) * tokens
        recompute += stream if mode == "fsdp-mp" else -layer.saved_bytes - stream
    return _ActivationTerms(
        tokens=tokens, layer=layer, head=head, copies_per_layer=_weight_copies_per_layer(model, s, mode),
        recompute=max(recompute, 0.0),
        transient=backward_transient_bytes(model, tokens, s.tp, s.sequence_parallel, mode),
        ffn_output_input=ffn_output_input,
        output_projection_backward=output_projection_backward_bytes(model, tokens, s.tp, mode),
        ffn_part=ffn_saved_bytes_per_token(model, s.tp, s.sequence_parallel, mode) * tokens,
        norm_backward_transient=norm_backward_transient_bytes(model, tokens, s.tp, s.sequence_parallel, mode),
        embedding_backward_transient=embedding_backward_transient_bytes(model, tokens, s.tp, s.sequence_parallel,
                                                                        mode))


def _memo(cache: dict[Any, Any], key: tuple[Any, ...], compute: Any) -> Any:
    """cache[key], computed by `compute()` the first time."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = compute()
    return value


@dataclass(slots=True)  # not frozen: one per layout and rank, built in the search's inner loop
class _RankParts:
    """What every phase of one pipeline rank's memory is built from (`_rank_parts`)."""

    states: States
    act: _ActivationTerms
    in_flight: float  # micro-batches in flight before the first backward (in_flight_micro_batches)
    copies: float  # autocast weight copies
    per_micro_batch: float  # one micro-batch's saved activations on the rank's layers (+ the embedding's)
    pipeline: float  # pipeline stage buffers
    layers: int
    first: bool
    last: bool
    # The FFN backward's gradient buffers peak in w1/w3's backward, after the product's backward has freed what
    # it saved (swiglu: w2's input, silu out, w3 out; gelu: w2's input), as measured at w3 with MemTracker; LoRA
    # keeps the moments it was checked against (plan/lora.py): its frozen weights make no weight gradients.
    freed: float


def _rank_parts(model: Any, stage_layers: list[tuple[int, int]], s: RankSetup, pp_rank: int,
                memo: dict[Any, Any], act: _ActivationTerms | None = None) -> _RankParts:
    """The parts of pipeline rank `pp_rank`'s phases: the parameter-sized buffers and one micro-batch's activation
    terms (each memoised in `memo` under the fields it reads; `act`: the latter, when the caller has them), and
    what they come to on this rank's layers."""
    fsdp = s.fsdp
    mode = precision_mode(s.precision, fsdp)
    if act is None:
        act = _activation_terms_of(model, s, mode, memo)
    key = states_key(s, mode, pp_rank)
    st: States | None = memo.get(key)
    params_key = ("params", s.pp, s.virtual_stages, pp_rank, s.tp, s.ep)
    counted = memo.get(params_key)
    if counted is None:
        counted = memo[params_key] = rank_params(model, stage_layers, s, pp_rank)
    params, layers = counted
    if st is None:
        counts: ModelCounts = _memo(memo, ("counts", s.tp, s.ep), lambda: model_counts(model, s.tp, s.ep))
        routed = _memo(memo, ("routed", *params_key), lambda: float(rank_routed_params(model, stage_layers, s, pp_rank))
                       if s.ep > 1 else 0.0)
        st = memo[key] = rank_states(model, stage_layers, s, pp_rank, fsdp, mode, params, layers, counts, routed)
    first, last = pp_rank == 0, pp_rank == s.pp - 1
    in_flight = in_flight_micro_batches(s.schedule, s.pp, pp_rank, s.micro_batches, s.virtual_stages)
    copies = layers * act.copies_per_layer + (act.head.weight_copy_bytes if last else 0.0)
    if s.lora is not None and s.ac == "full":
        # autocast caches the 16-bit copies of parameters that require grad only: a frozen base's copies
        # live while a matmul saves them, so under full checkpointing only the recomputed layer's.
        copies -= (layers - 1) * act.copies_per_layer
    per_micro_batch = layers * act.layer.saved_bytes + (embedding_saved_bytes(act.tokens) if first else 0.0)
    pipeline = pipeline_buffer_bytes(model, s, pp_rank, act.tokens, in_flight, mode)
    freed = ((3 if model.activation == "swiglu" else 1) * act.ffn_output_input
             if s.ac == "none" and s.lora is None else 0.0)
    return _RankParts(st, act, in_flight, copies, per_micro_batch, pipeline, layers, first, last, freed)


def activation_terms(model: Any, s: RankSetup, memo: dict[Any, Any]) -> _ActivationTerms:
    """One micro-batch's activation terms of `s` (`_activation_terms`, memoised in `memo`): what MemoryProbe takes as
    `act`; the same for every setup that differs from `s` only in fields `_activation_key` leaves out."""
    return _activation_terms_of(model, s, precision_mode(s.precision, s.fsdp), memo)


def _activation_terms_of(model: Any, s: RankSetup, mode: str, memo: dict[Any, Any]) -> _ActivationTerms:
    """`_activation_terms`, memoised in `memo` under the fields it reads."""
    terms: _ActivationTerms = _memo(memo, _activation_key(s, mode), lambda: _activation_terms(model, s, mode))
    return terms


def _loss_total(p: _RankParts, count: float, grads: float, accumulation: float) -> float:
    """The total of `_phase_items`' loss phase with `count` micro-batches in flight (without the runtime's overhead)."""
    st, head = p.states, p.act.head
    return (st.master + st.rope + st.optimizer + p.copies + p.pipeline + grads + accumulation + st.unsharded_forward
            + count * p.per_micro_batch + (head.saved_bytes + head.loss_transient_bytes if p.last else 0.0))


def _phase_peak_total(p: _RankParts, s: RankSetup, embedding_chunk_layers: int) -> float:
    """The largest of `_phase_items`' phase totals on this rank (without the runtime's overhead), summed here without
    building their items: every phase there, term for term (`embedding_chunk_layers`: the rank's first chunk's layers
    on the first stage, else 0). Equal to the sum of the largest phase's items up to rounding; the search picks a
    layout's peak rank with it and builds one breakdown (MemoryProbe.peak). tests/plan/test_search_memo.py holds it
    against `_phase_items`."""
    st, act = p.states, p.act
    layer = act.layer
    common = st.master + st.rope + st.optimizer + p.copies + p.pipeline
    best = st.master + st.rope + st.optimizer + st.grads_sharded + (
        st.grads_sharded if s.foreach and s.optimizer == "adamw" else 0.0)
    later = s.lora is None
    head = act.head.saved_bytes + act.head.loss_transient_bytes if p.last else 0.0
    steady = p.in_flight if (s.schedule != "gpipe" and s.micro_batches > p.in_flight) else p.in_flight - 1
    for count, grads, accumulation, is_steady in ((p.in_flight, 0.0, 0.0, False),
                                                  (steady, st.grads_held, st.accumulation, True)):
        if count <= 0 or (is_steady and not (s.micro_batches > 1 or s.pp > 1)):
            continue
        saved = count * p.per_micro_batch
        total = common + grads + accumulation + st.unsharded_forward + saved + head  # _loss_total, term for term
        best = total if total > best else best
        # the backward phases' items but "saved activations", "gradients", recompute and gradient buffers
        rest = common + accumulation + st.unsharded_backward + st.reduce_buffer
        total = rest + grads + act.recompute + act.transient + saved - p.freed
        best = total if total > best else best
        if grads and s.ac == "none" and later:
            total = rest + grads + act.recompute + act.output_projection_backward + saved
            best = total if total > best else best
        end_saved = saved - (p.layers - 1) * layer.saved_bytes
        total = rest + act.recompute + act.transient + end_saved + (grads if grads else st.grads_fresh_at_end)
        best = total if total > best else best
        if not later:
            continue
        if s.ac in ("none", "full"):
            if s.ac == "none":
                norm_saved, recompute = end_saved - act.ffn_part, 0.0
            else:
                norm_saved = end_saved
                recompute = max(layer.recompute_peak_bytes - act.ffn_part - layer.saved_bytes, 0.0)
            total = rest + norm_saved + recompute + act.norm_backward_transient + (grads if grads else
                                                                                    st.grads_fresh_at_norm)
            best = total if total > best else best
        if embedding_chunk_layers and not s.embedding_on_cpu:
            total = (rest + saved - embedding_chunk_layers * layer.saved_bytes + act.embedding_backward_transient
                     + (grads if grads else st.grads_fresh_at_embedding))
            best = total if total > best else best
    return best


def _phase_items(model: Any, stage_layers: list[tuple[int, int]], s: RankSetup, pp_rank: int,
                 cache: dict[Any, Any] | None = None, parts: _RankParts | None = None) -> dict[str, dict[str, float]]:
    """Bytes per item at each phase's peak: the loss (end of forward, every activation alive),
    the start of backward (the oldest micro-batch's last layer), the end of backward (the rank's
    first layer, where full recompute peaks as gradients pile up) and the optimizer step.
    `cache`: one search's memo of the parts that depend on fewer fields than the whole setup (the
    caller guarantees one model, and one stage split per (pp, virtual_stages)); `parts`: this rank's
    `_rank_parts`, when the caller has them already."""
    p = parts if parts is not None else _rank_parts(model, stage_layers, s, pp_rank, {} if cache is None else cache)
    st, act, in_flight, copies, per_micro_batch, pipeline = (p.states, p.act, p.in_flight, p.copies,
                                                             p.per_micro_batch, p.pipeline)
    layers, first, last = p.layers, p.first, p.last
    layer, head = act.layer, act.head
    recompute = act.recompute
    transient = act.transient
    common = {"fp32 master weights": st.master, "RoPE tables": st.rope, "optimizer states": st.optimizer,
              "autocast weight copies": copies, "pipeline stage buffers": pipeline}
    phases: dict[str, dict[str, float]] = {}
    # Gradients exist once a micro-batch has run backward. Before the first backward the most
    # micro-batches are in flight with no gradient; afterwards 1F1B keeps as many in flight (if
    # there are more micro-batches than that), GPipe one fewer with each backward.
    steady = in_flight if (s.schedule != "gpipe" and s.micro_batches > in_flight) else in_flight - 1
    for label, count, grads, accumulation in (("first micro-batches", in_flight, 0.0, 0.0),
                                              ("steady state", steady, st.grads_held, st.accumulation)):
        if count <= 0 or (label == "steady state" and not (s.micro_batches > 1 or s.pp > 1)):
            continue
        saved = count * per_micro_batch
        base = {**common, "gradients": grads,
                "unsharded fp32 gradient accumulation (FSDP, deferred reduce-scatter)": accumulation}
        phases[f"loss, {label}"] = {**base, "unsharded compute weights (FSDP)": st.unsharded_forward,
                                    "saved activations": saved + (head.saved_bytes if last else 0.0),
                                    "loss gradient buffers": head.loss_transient_bytes if last else 0.0}
        backward = {**base, "unsharded compute weights (FSDP)": st.unsharded_backward,
                    "recompute of one layer (activation checkpointing)": recompute,
                    "backward gradient buffers": transient, "gradient reduce-scatter buffer (FSDP)": st.reduce_buffer}
        # What the FFN backward has freed (`_RankParts.freed`). LoRA keeps the moments it was checked against
        # (plan/lora.py): its frozen weights make no weight gradients, and its adapters' tensors sit between these.
        later = s.lora is None
        phases[f"backward start, {label}"] = {**backward, "saved activations": saved - p.freed}
        if grads and s.ac == "none" and later:
            # Just before: w2's backward with every activation alive, its input gradient and a
            # new weight gradient that is then added to the held one.
            phases[f"output-projection backward, {label}"] = {
                **backward, "saved activations": saved,
                "backward gradient buffers": act.output_projection_backward}
        # In the backward of the rank's first layer, the micro-batch's other layers are freed.
        end_saved = saved - (layers - 1) * layer.saved_bytes
        phases[f"backward end, {label}"] = {**backward, "saved activations": end_saved,
                                            "gradients": grads if grads else st.grads_fresh_at_end}
        if later:
            phases.update(_late_backward_phases(model, s, label, backward, saved, end_saved, grads, st, act,
                                                stage_layers[0][1] - stage_layers[0][0] if first else 0))
    phases["optimizer step"] = {
        "fp32 master weights": st.master, "RoPE tables": st.rope, "optimizer states": st.optimizer,
        "gradients": st.grads_sharded,
        "foreach optimizer temporary": st.grads_sharded if s.foreach and s.optimizer == "adamw" else 0.0}
    return phases


def _late_backward_phases(model: Any, s: RankSetup, label: str, backward: dict[str, float], saved_all: float,
                          end_saved: float, grads: float, st: States, act: _ActivationTerms,
                          embedding_chunk_layers: int) -> dict[str, dict[str, float]]:
    """Two later moments of the rank's last-processed backward, where the peak falls when the
    gradients piling up outweigh the activations already freed (found with MemTracker's
    per-module peaks): the FFN norm's backward in the first layer (the FFN's tensors are freed,
    its gradients exist, the norm's fp32 internals are the largest buffers) and, on the first
    stage, the embedding's backward (the micro-batch's first chunk is freed; a weight-sized
    gradient). Selective recomputation is left out: its FFN-norm input is recomputed."""
    phases: dict[str, dict[str, float]] = {}
    layer, ffn_part = act.layer, act.ffn_part
    if s.ac in ("none", "full"):
        if s.ac == "none":
            saved, recompute = end_saved - ffn_part, 0.0
        else:
            # The recomputed layer without its FFN part (the attention norm saved the kept input).
            saved, recompute = end_saved, max(layer.recompute_peak_bytes - ffn_part - layer.saved_bytes, 0.0)
        phases[f"FFN-norm backward, {label}"] = {
            **backward, "saved activations": saved, "recompute of one layer (activation checkpointing)": recompute,
            "backward gradient buffers": act.norm_backward_transient,
            "gradients": grads if grads else st.grads_fresh_at_norm}
    if embedding_chunk_layers and not s.embedding_on_cpu:  # a host embedding's backward runs on the host
        phases[f"embedding backward, {label}"] = {
            **backward, "saved activations": saved_all - embedding_chunk_layers * layer.saved_bytes,
            "recompute of one layer (activation checkpointing)": 0.0,
            "backward gradient buffers": act.embedding_backward_transient,
            "gradients": grads if grads else st.grads_fresh_at_embedding}
    return phases


def _context_parallel_layer(layer: Any, model: Any, s: RankSetup, mode: str) -> Any:
    """A layer's activations with context parallelism's K/V buffer (plan/context.py): the other ranks' K/V,
    saved without checkpointing, else alive while the layer's backward recomputes it."""
    from dataclasses import replace

    matmul = dtypes(mode).matmul
    if s.cp > 1 and s.cp_rotate == "ring":
        saved = cp_ring_saved_delta_bytes(model, s.micro_batch, s.cp, s.tp, matmul)
        buffers = cp_ring_recompute_extra_bytes(model, s.micro_batch, s.cp, s.tp, matmul)
        if s.ac == "none":  # the buffers live inside one layer's attention, below the phases' peaks
            return replace(layer, saved_bytes=layer.saved_bytes + saved)
        return replace(layer, recompute_peak_bytes=layer.recompute_peak_bytes + saved + buffers)
    extra = cp_kv_extra_bytes(model, s.micro_batch, s.cp, s.tp, matmul)
    if not extra:
        return layer
    extra += cp_output_join_bytes(model, s.micro_batch, s.cp, s.tp, matmul)
    if s.cpu_attention:
        extra += cpu_causal_mask_bytes(model.seq_len, s.cp, matmul, s.cp_rank)
    if s.ac == "none":
        return replace(layer, saved_bytes=layer.saved_bytes + extra)
    return replace(layer, recompute_peak_bytes=layer.recompute_peak_bytes + extra)


def pipeline_buffer_bytes(model: Any, s: RankSetup, pp_rank: int, tokens: int, in_flight: float, mode: str) -> float:
    """What the pipeline keeps beside the layers, per model chunk on this rank; nothing grows with
    the micro-batch count (runtime/parallel/pipeline.py's BoundedStage): the stage's forward cache
    holds each in-flight micro-batch's output until its backward (hidden states, or the logits
    on the last chunk); a non-first chunk also has the next micro-batch's receive buffer (posted
    before the current backward) and the input gradients being computed and sent, three
    stream-sized tensors measured against MemTracker (the in-flight receive buffers themselves
    are the tensors the chunk's first RMSNorm saves, counted with the layer)."""
    if s.pp == 1:
        return 0.0
    d = dtypes(mode)
    hidden_bytes = tokens * d.stream * model.hidden / (s.tp if s.sequence_parallel else 1)
    logits_bytes = tokens * d.matmul * model.vocab / s.tp
    # The rank's v chunks (stages pp_rank, pp_rank + pp, ...): the model's last stage is the last rank's last chunk,
    # the first stage rank 0's first.
    chunks = s.virtual_stages
    cached = in_flight * ((chunks - 1) * hidden_bytes + logits_bytes) if pp_rank == s.pp - 1 else \
        in_flight * chunks * hidden_bytes
    return cached + 3 * hidden_bytes * (chunks - 1 if pp_rank == 0 else chunks)


def rank_memory(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, pp_rank: int,
                cache: dict[Any, Any] | None = None, parts: _RankParts | None = None) -> MemoryBreakdown:
    """Peak memory of pipeline rank `pp_rank` (any of its tp x dp replicas), with its breakdown
    (`cache`, `parts`: as `_phase_items`'s)."""
    phases = _phase_items(model, stage_layers, setup, pp_rank, cache, parts)
    name, items = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    items = {**items, "runtime overhead (CUDA context, allocator)": setup.overhead_bytes}
    sums = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "other": 0.0}
    for item, value in items.items():
        sums[ITEM_COMPONENTS[item]] += value
    return MemoryBreakdown(sums["weights"], sums["grads"], sums["optimizer"], sums["activations"],
                           sums["other"], name, tuple((k, v) for k, v in items.items() if v))


def _candidate_ranks(stage_layers: list[tuple[int, int]], pp: int) -> list[int]:
    """Ranks 0 (most micro-batches in flight, the embedding), pp-1 (head and loss) and the rank with the most
    layers: the pipeline ranks that can hold the peak."""
    if pp == 1:
        return [0]
    sizes = [0] * pp
    for index, (a, b) in enumerate(stage_layers):
        sizes[index % pp] += b - a
    return sorted({0, pp - 1, sizes.index(max(sizes))})


def peak_rank_memory(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup,
                     cache: dict[Any, Any] | None = None) -> tuple[int, MemoryBreakdown]:
    """The most loaded pipeline rank and its breakdown (`_candidate_ranks`)."""
    return MemoryProbe(model, stage_layers, setup, {} if cache is None else cache).peak()


class MemoryProbe:
    """One layout's memory, each candidate rank's parts computed once and only when needed (`_rank_parts`, memoised
    in `cache` as `_phase_items`' are): `over(...)` for a fraction of the work, `peak()` the whole breakdown."""

    def __init__(self, model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup,
                 cache: dict[Any, Any], act: _ActivationTerms | None = None) -> None:
        """`act`: `activation_terms(model, setup, cache)`, when the caller has them (a search's candidates share them
        across their sharding choices)."""
        self.model, self.stage_layers, self.setup, self.cache = model, stage_layers, setup, cache
        self._act = act
        self.ranks: list[int] = _memo(cache, ("ranks", setup.pp, setup.virtual_stages),
                                      lambda: _candidate_ranks(stage_layers, setup.pp))
        self._parts: dict[int, _RankParts] = {}
        self._totals: dict[int, float] = {}
        self._peak_total: float | None = None
        self._peak: tuple[int, MemoryBreakdown] | None = None

    @classmethod
    def with_totals(cls, model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, cache: dict[Any, Any],
                    totals: dict[int, float]) -> MemoryProbe:
        """A probe whose rank totals (`rank_totals`) another probe of the same layout computed (another process's,
        plan/split_search.py): its parts and breakdown computed again where read."""
        probe = cls(model, stage_layers, setup, cache)
        probe._totals = dict(totals)
        return probe

    @property
    def act(self) -> _ActivationTerms:
        """The layout's activation terms (`activation_terms`), computed when first needed."""
        if self._act is None:
            self._act = activation_terms(self.model, self.setup, self.cache)
        return self._act

    def rank_totals(self) -> dict[int, float]:
        """The rank totals computed so far (`rank_total`), by rank."""
        return dict(self._totals)

    def parts(self, rank: int) -> _RankParts:
        if rank not in self._parts:
            self._parts[rank] = _rank_parts(self.model, self.stage_layers, self.setup, rank, self.cache, self.act)
        return self._parts[rank]

    def first_loss_floor(self) -> float:
        """Rank 0's first micro-batches' loss with the runtime's overhead: a floor under `peak()`'s total that never
        falls as the micro-batch grows, the rest of the layout fixed (its in-flight micro-batches times their tokens
        do not fall: 1F1B's min(pp, m) x mb, GPipe's m x mb = the local batch; its parameter-sized buffers do not
        depend on the micro-batch; test_search_memo.py checks it over whole searches). A search sets the larger
        micro-batches of a layout aside once this floor has put it over the budget."""
        return self._loss_floor(0)

    def _loss_floor(self, rank: int) -> float:
        """`rank`'s first micro-batches' loss phase with the runtime's overhead, one of the phases its total
        (`rank_total`) is the largest of; 0 without micro-batches in flight."""
        p = self.parts(rank)
        return _loss_total(p, p.in_flight, 0.0, 0.0) + self.setup.overhead_bytes if p.in_flight > 0 else 0.0

    def over(self, budget: float, bar: float) -> bool:
        """Whether `peak()`'s total is known, from the ranks' totals alone (`rank_total`), to be over `budget` and at
        least `bar` (rank by rank, stopping at the first that shows it; the factor keeps rounding from deciding). A
        rank's first micro-batches' loss phase, one of the phases its total is the largest of, shows it first where
        it can, without the other phases."""
        for rank in self.ranks:
            if rank not in self._totals:
                floor = self._loss_floor(rank) * (1 - 1e-9)
                if floor > budget and floor >= bar:
                    return True
            total = self.rank_total(rank) * (1 - 1e-9)
            if total > budget and total >= bar:
                return True
        return False

    def rank_total(self, rank: int) -> float:
        """`rank_memory`'s total on `rank` up to rounding, without its breakdown (`_phase_peak_total`)."""
        total = self._totals.get(rank)
        if total is None:
            chunk = self.stage_layers[0][1] - self.stage_layers[0][0] if rank == 0 else 0
            total = self._totals[rank] = (_phase_peak_total(self.parts(rank), self.setup, chunk)
                                          + self.setup.overhead_bytes)
        return total

    def peak_total(self) -> float:
        """`peak()`'s total up to rounding, without a breakdown (computed once)."""
        if self._peak_total is None:
            self._peak_total = max(self.rank_total(rank) for rank in self.ranks)
        return self._peak_total

    def peak(self) -> tuple[int, MemoryBreakdown]:
        """The most loaded candidate rank and its breakdown: built for the ranks whose total (`rank_total`) is within
        rounding of the largest only, the first of them in rank order when they tie, as over every rank (built once)."""
        if self._peak is not None:
            return self._peak
        totals = [(rank, self.rank_total(rank)) for rank in self.ranks]
        top = max(total for _, total in totals) * (1 - 1e-9)
        results = [(rank, rank_memory(self.model, self.stage_layers, self.setup, rank, self.cache, self.parts(rank)))
                   for rank, total in totals if total >= top]
        self._peak = max(results, key=lambda item: item[1].total)
        return self._peak
