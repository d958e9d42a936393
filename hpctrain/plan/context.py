"""Context parallelism in the planner (torch-free): the candidates, and the memory a cp rank adds.

The runtime (runtime/parallel/context.py) splits each sequence over cp ranks (a head chunk and its mirror
tail chunk each) and, by default (`parallel.cp_rotate: allgather`), all-gathers every attention layer's K/V
over them. Per rank that means:

- activations: everything per token is computed for seq_len / cp tokens (the memory model runs with
  micro_batch x seq_len / cp tokens; `tokens_per_rank`);
- the K/V buffer: the layer's attention holds the whole sequence's K and V (after the GQA repeat, as
  the runtime's SDPA inputs; 2 x seq_len x heads/tp x head_dim x 16-bit-or-fp32 bytes per sequence)
  where one process would hold its own tokens' only: `cp_kv_extra_bytes` is the difference, saved per layer
  without checkpointing, alive only while a layer's backward recomputes it with checkpointing
  (selective recomputes the all-gather too: its outputs are not matmul outputs);
- the joined output: the two chunks' attention outputs are saved by SDPA and joined into one more
  tensor of the local output's size, wo's input (`cp_output_join_bytes`);
- on a CPU (`gpu: cpu`) SDPA materialises each lower-right causal mask ([c, keys] in the compute dtype;
  a GPU's flash / memory-efficient kernels take the causal bias without one): `cpu_causal_mask_bytes`;
- model states: FSDP shards over dp x cp ranks (the cp ranks hold the same weights).

With `parallel.cp_rotate: ring` (runtime/parallel/ring_attention.py) the K/V chunk pairs travel around the cp
group instead: nothing of the other ranks' K/V is saved and no output is joined; the layer saves its own
K/V unrepeated (kv heads) where SDPA saves them repeated (`cp_ring_saved_delta_bytes`, <= 0), and while its
attention runs it holds the held pair, the one in flight, the held pair repeated and the fp32 dK/dV
accumulators (`cp_ring_buffer_bytes`). Time: cp-1 transfers per layer forward, each overlapped with a
block's attention; backward the K/V again with the fp32 accumulators, and one last accumulator send
(`cp_ring_exposed_s`).

The search tries cp > 1 for a sequence of at least LONG_SEQUENCE tokens when the job leaves parallel.cp
at 1 and the GPU count allows it (Megatron-Core recommends CP from 8K tokens; Llama 3 used cp=16 at
128K, Llama 3 paper section 3.3.2). A job that sets parallel.cp > 1 gets that degree only.
"""

from __future__ import annotations

from typing import Any

LONG_SEQUENCE = 16384
MAX_CP = 64


def cp_candidates(job_cp: int, seq_len: int, world: int) -> tuple[int, ...]:
    """The cp degrees the search tries: the job's when it sets one, else 1 and, for long sequences,
    every power of two up to MAX_CP that divides the GPU count and splits the sequence in 2 x cp chunks."""
    if job_cp > 1 or seq_len < LONG_SEQUENCE:
        return (job_cp,)
    out = [1]
    cp = 2
    while cp <= min(MAX_CP, world):
        if world % cp == 0 and seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return tuple(out)


def tokens_per_rank(micro_batch: int, seq_len: int, cp: int) -> int:
    """Tokens of one micro-batch that a context-parallel rank holds."""
    return micro_batch * seq_len // cp


def cp_kv_extra_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """Per layer and micro-batch: the other cp ranks' K and V that the layer's attention holds
    (2 x (seq_len - seq_len / cp) tokens x the repeated K/V width on one TP rank)."""
    if cp <= 1:
        return 0.0
    head_dim = getattr(model, "head_dim", 0) or model.hidden // model.heads
    repeated = model.heads * head_dim / tp  # after the GQA repeat (the runtime repeats after the exchange)
    other_tokens = micro_batch * (model.seq_len - model.seq_len // cp)
    return 2.0 * other_tokens * repeated * matmul_bytes


def cp_output_join_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """Per layer and micro-batch: the joined attention output of the rank's two chunks (wo's input)."""
    if cp <= 1:
        return 0.0
    head_dim = getattr(model, "head_dim", 0) or model.hidden // model.heads
    return micro_batch * model.seq_len / cp * model.heads * head_dim / tp * matmul_bytes


def cpu_causal_mask_bytes(seq_len: int, cp: int, matmul_bytes: float, cp_rank: int | None = None) -> float:
    """Per layer, on a CPU only: the materialised lower-right causal masks of a cp rank's chunks (a chunk
    whose keys are its own square block needs none); `cp_rank` None: the largest, that of rank >= 1."""
    if cp <= 1:
        return 0.0
    c = seq_len // (2 * cp)
    ranks = range(cp) if cp_rank is None else (cp_rank,)
    worst = 0
    for r in ranks:
        head = (r + 1) * c if r > 0 else 0
        worst = max(worst, c * (head + (2 * cp - r) * c))
    return worst * matmul_bytes


def cp_kv_message_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """What one rank sends per attention layer: its K and V, the kv heads only (GQA) on one TP rank."""
    head_dim = getattr(model, "head_dim", 0) or model.hidden // model.heads
    return 2.0 * micro_batch * model.seq_len / cp * model.kv_heads * head_dim / tp * matmul_bytes


def _widths(model: Any, tp: int) -> tuple[float, float]:
    """(query width, kv width) on one TP rank, in elements per token."""
    head_dim = getattr(model, "head_dim", 0) or model.hidden // model.heads
    return model.heads * head_dim / tp, model.kv_heads * head_dim / tp


def cp_ring_saved_delta_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """Per layer and micro-batch, ring: what the ring op saves less than one process's SDPA (its own K/V
    with the kv heads, not repeated to the query heads): -2 x tokens x (q width - kv width) with GQA, else 0."""
    q_width, kv_width = _widths(model, tp)
    if cp <= 1 or model.heads == model.kv_heads:
        return 0.0
    return -2.0 * tokens_per_rank(micro_batch, model.seq_len, cp) * (q_width - kv_width) * matmul_bytes


def cp_ring_buffer_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """Per layer and micro-batch, ring, alive only while the layer's attention backward runs (its larger
    half): the held K/V pair and the one in flight (kv heads), the held pair repeated to the query heads,
    the fp32 dK/dV partial and accumulators (partial, sent, received, incoming: kv heads), the fp32 dQ, and
    the per-chunk copies of q, output and output gradient the kernels take. Tokens per rank, not seq_len."""
    if cp <= 1:
        return 0.0
    tokens = tokens_per_rank(micro_batch, model.seq_len, cp)
    q_width, kv_width = _widths(model, tp)
    kv_pairs = 2 * 2 * kv_width * matmul_bytes + 2 * q_width * matmul_bytes
    accumulators = 4 * 2 * kv_width * 4 + q_width * 4
    copies = 3 * q_width * matmul_bytes
    return tokens * (kv_pairs + accumulators + copies)


def cp_ring_exposed_s(cp: int, kv_transfer_s: float, grad_transfer_s: float, block_forward_s: float,
                      recompute: bool) -> float:
    """Per layer and micro-batch, ring: the transfers' time not hidden behind the blocks' attention.
    Forward: cp-1 K/V transfers, each beside one rotation's blocks (block_forward_s); backward: cp-1 K/V plus
    accumulator transfers beside backward blocks (twice the forward's work), and the last accumulator send
    alone; full recomputation runs the forward ring once more."""
    if cp <= 1:
        return 0.0
    forward = (cp - 1) * max(0.0, kv_transfer_s - block_forward_s)
    backward = (cp - 1) * max(0.0, kv_transfer_s + grad_transfer_s - 2.0 * block_forward_s) + grad_transfer_s
    return forward * (2 if recompute else 1) + backward


def cp_ring_recompute_extra_bytes(model: Any, micro_batch: int, cp: int, tp: int, matmul_bytes: float) -> float:
    """Per layer and micro-batch, ring, with checkpointing: what the buffers add to the layer's recompute peak.
    A layer's backward reaches attention after its FFN's backward freed the FFN's saved tensors (swiglu: four
    [tokens, ffn/tp] tensors, gelu: two), so only the buffers beyond those raise the peak."""
    if cp <= 1:
        return 0.0
    tokens = tokens_per_rank(micro_batch, model.seq_len, cp)
    ffn_saved = (4 if getattr(model, "activation", "swiglu") == "swiglu" else 2) * model.ffn_hidden / tp * matmul_bytes
    return max(0.0, cp_ring_buffer_bytes(model, micro_batch, cp, tp, matmul_bytes) - tokens * ffn_saved)
