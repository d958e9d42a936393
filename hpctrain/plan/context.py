"""Context parallelism in the planner (torch-free): the candidates, and the memory a cp rank adds.

The runtime (runtime/parallel/context.py) splits each sequence over cp ranks (a head chunk and its mirror
tail chunk each) and all-gathers every attention layer's K/V over them. Per rank that means:

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
