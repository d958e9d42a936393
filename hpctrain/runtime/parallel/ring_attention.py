"""Ring attention for context parallelism (`parallel.cp_rotate: ring`): K/V chunks passed around the cp group.

**What travels.** Context-parallel rank r holds query, key and value chunks r (head) and 2·cp-1-r (tail)
of 2·cp chunks (runtime/parallel/context.py). For cp-1 rotations each rank sends the K/V chunk pair it
holds to rank r+1 and receives rank r-1's (point-to-point, `isend`/`irecv` over the cp group; the next
transfer is posted before the current block's attention runs, so it overlaps with it). At rotation t the
rank holds the pair of rank src = r-t; only the kv heads travel (GQA: the head repeat runs here, after
receiving), so a message is 2 · 2c · kv_heads/tp · head_dim elements per sequence (c = seq_len / (2·cp)).

**Which blocks (the causal structure).** Query chunk i against key chunk j: j < i the full block, j == i
the causal diagonal, j > i nothing. With the head/tail split that is, for src != r, either both local
query chunks against src's head chunk (src < r) or the local tail against both of src's chunks (src > r):
two c×c blocks per rotation on every rank, and at t = 0 the two diagonals plus tail-against-head.

**The merge (exact).** Each block's attention returns its output and its fp32 log-sum-exp; the blocks of a
query chunk are joined with the running log-sum-exp in fp32 (online softmax: Milakov & Gimelshein 2018;
Liu et al., Ring Attention, 2023; torch's `_merge_sdpa`, torch/distributed/tensor/experimental/
_context_parallel/_attention.py): lse = logaddexp(lse, lse_b), out = out·e^(lse_old-lse) + out_b·e^(lse_b-lse).
That is one process's softmax over all the keys, up to fp32 rounding.

**Backward.** Recomputes each block from the saved final output and log-sum-exp (flash attention's backward:
P = exp(S - lse), D = rowsum(dO·O); Dao 2022), in the same rotations. The K/V travel around the ring again,
each with an fp32 dK/dV accumulator: at rotation t the rank adds its queries' gradient for src's K/V to the
accumulator it received from r-1 and sends it on to r+1; after the last rotation one more send delivers
each accumulator to its K/V's owner with every rank's contribution (cp-1 K/V transfers, cp accumulator
transfers per layer). dQ stays local. The result equals one process's gradient up to fp32 rounding.

**Memory (per layer and micro-batch, one TP rank).** Saved for backward: q, the local K/V pair (kv heads
only: less than one process's SDPA, which saves its repeated K/V), the output and the fp32 log-sum-exp.
Alive only while the layer's attention runs: the held K/V pair and the one in flight (2 · 2 · s_r · kv_heads/tp
· head_dim elements, s_r = seq_len/cp tokens per sequence), the held pair repeated to the query heads
(2 · s_r · heads/tp · head_dim), and the fp32 running output; in backward also the fp32 dK/dV partial and
accumulators (held, sent, incoming: about 4 · 2 · s_r · kv_heads/tp · head_dim · 4 bytes), the fp32 dQ and
per-chunk copies of q, the output and its gradient (plan/context.py `cp_ring_buffer_bytes`). All of it
grows with the tokens per rank, seq_len/cp, not with seq_len. Llama 3 8B (32 heads, 8 kv heads, head_dim 128)
at 131072 tokens, cp 4, bf16, one sequence: a message is 128 MiB, the held pair and the one in flight 256 MiB,
the held pair repeated 512 MiB, all freed after the layer's attention; the all-gather form saves 2 GiB of
repeated K/V per layer. The all-gather
form (`allgather`) instead holds the whole sequence's repeated K/V, 2 · seq_len · heads/tp · head_dim, and
saves it for backward (plan/context.py has both).

**Kernels.** A block runs on a CPU as `aten._scaled_dot_product_flash_attention_for_cpu` (the kernel SDPA
uses there; it returns the log-sum-exp) and its backward op; on other devices as fp32 matmuls
(`_math_block`: tiles of query rows against the chunk's keys, a score tile at most MATH_TILE_ELEMENTS fp32
elements, transient; no fused GPU kernel yet, and not run on a GPU in this project's tests). Both are checked against dense causal attention
(tests/runtime/test_ring_attention.py).

**Activation checkpointing.** The ring is one custom op (`hpctrain::ring_attention`), so selective
checkpointing saves its outputs (runtime/parallel/activation_checkpoint.py lists it with SDPA) and the
recompute in backward does not run the ring again; full checkpointing recomputes the whole block, ring
included (one more round of cp-1 K/V transfers per layer). Every wait goes through `wait_ring`,
timed as `cp_kv` like the all-gather's `context.wait_kv` (runtime/observe/comm_timing.py): part of
`time_comm_exposed_s`, and `time_cp_kv_s`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

aten = torch.ops.aten

# The cp groups the op may name (a custom op takes no process group argument): group_name -> group.
_GROUPS: dict[str, Any] = {}
_KV_TAG, _GRAD_TAG = 25, 26  # the K/V and the dK/dV accumulators between the same two ranks


def register_group(group: Any) -> str:
    """Make a cp group nameable by the op; returns its name."""
    name = str(group.group_name)
    _GROUPS[name] = group
    return name


# ----------------------------------------------------------------------------------- one block
# The fp32 math block runs over tiles of query rows so that a score tile holds at most this many elements
# (2**26: 256 MiB in fp32, a few of them alive at once), whatever the chunk length.
MATH_TILE_ELEMENTS = 2**26


def _tiles(q: torch.Tensor, keys: int, tile_elements: int) -> list[tuple[int, int]]:
    rows = q.shape[2]
    per_row = max(1, q.shape[0] * q.shape[1] * keys)
    step = max(1, min(rows, tile_elements // per_row))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, first_row: int) -> torch.Tensor:
    """fp32 scores of query rows [first_row, first_row + q rows) against all keys; causal: key <= query row."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        rows = torch.arange(first_row, first_row + q.shape[2], device=q.device).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device).unsqueeze(0) > rows, float("-inf"))
    return scores


def _math_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                tile_elements: int = MATH_TILE_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v [b, h, c, d] -> (out [b, h, c, d] fp32, lse [b, h, c] fp32), in fp32 matmuls, tile by tile."""
    outs, lses = [], []
    for r0, r1 in _tiles(q, k.shape[2], tile_elements):
        scores = _scores(q[:, :, r0:r1], k, causal, r0)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _math_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, tile_elements: int = MATH_TILE_ELEMENTS
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention's backward of one block from the final output and lse (all fp32 results)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    kf, vf = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for r0, r1 in _tiles(q, k.shape[2], tile_elements):
        qf, do = q[:, :, r0:r1].float(), dout[:, :, r0:r1].float()
        p = torch.exp(_scores(qf, kf, causal, r0) - lse[:, :, r0:r1].unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - (do * out[:, :, r0:r1].float()).sum(-1, keepdim=True))
        dq[:, :, r0:r1] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: (out fp32, lse fp32). `fused` None: the CPU flash kernel on a CPU."""
    if fused if fused is not None else q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out.float(), lse.float()
    return _math_block(q, k, v, causal)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, fused: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's dq, dk, dv (fp32) given the merged output and lse of its queries."""
    if fused if fused is not None else q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal)
        return dq.float(), dk.float(), dv.float()
    return _math_block_backward(dout, q, k, v, out, lse, causal)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join a block into the running (out, lse) of its queries (fp32, online softmax)."""
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)), new


def blocks(cp: int, rank: int, src: int) -> list[tuple[int, int, bool]]:
    """(local query half, held key half, causal) of the blocks rank computes against src's K/V chunks."""
    mine, theirs = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    return [(qh, kh, i == j) for qh, i in enumerate(mine) for kh, j in enumerate(theirs) if j <= i]


# ----------------------------------------------------------------------------------- the ring
class _Ring:
    """One rank's neighbours in its cp group."""

    def __init__(self, group: Any, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> tuple[list[Any], torch.Tensor]:
        """Send `tensor` to the next rank, receive the previous rank's into a new buffer (asynchronous)."""
        incoming = torch.empty_like(tensor)
        # One batch: NCCL would deadlock on a lone send and receive with the same peer (cp = 2); gloo runs both.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, incoming, self.prev, self.group, tag)])
        return list(works), incoming


def wait_ring(work: Any) -> None:
    """Wait for one ring transfer; the communication timer wraps this as it wraps `context.wait_kv`
    (runtime/observe/comm_timing.py: kind cp_kv, so `time_cp_kv_s` and a part of `time_comm_exposed_s`)."""
    work.wait()


def _wait(works: list[Any]) -> None:
    for work in works:
        wait_ring(work)


def _heads(kv: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [2, b, s, kv_heads, d] pair -> k, v [b, heads, s, d] (GQA: repeated here, after receiving)."""
    if rep > 1:
        kv = kv.repeat_interleave(rep, dim=3)
    kv = kv.transpose(2, 3)
    return kv[0], kv[1]


def ring_forward(ring: _Ring, q: torch.Tensor, kv: torch.Tensor, fused: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, s, heads, d], kv [2, b, s, kv_heads, d] (local chunks) -> out [b, s, heads, d] (q's dtype),
    lse [b, heads, s] fp32."""
    cp, c = ring.cp, q.shape[1] // 2
    rep = q.shape[2] // kv.shape[3]
    qt = q.transpose(1, 2)
    qs = [qt[:, :, h * c:(h + 1) * c].contiguous() for h in (0, 1)]
    outs: list[torch.Tensor | None] = [None, None]
    lses: list[torch.Tensor | None] = [None, None]
    held = kv
    for t in range(cp):
        src = (ring.rank - t) % cp
        works, incoming = ring.pass_on(held, _KV_TAG) if t < cp - 1 else ([], held)
        k, v = _heads(held, rep)
        for qh, kh, causal in blocks(cp, ring.rank, src):
            o, lse = block_forward(qs[qh], k[:, :, kh * c:(kh + 1) * c].contiguous(),
                                   v[:, :, kh * c:(kh + 1) * c].contiguous(), causal, fused)
            outs[qh], lses[qh] = merge(outs[qh], lses[qh], o, lse)
        _wait(works)
        held = incoming
    assert outs[0] is not None and outs[1] is not None and lses[0] is not None and lses[1] is not None
    out = torch.cat([outs[0], outs[1]], dim=2).transpose(1, 2).to(q.dtype).contiguous()
    return out, torch.cat([lses[0], lses[1]], dim=2)


def ring_backward(ring: _Ring, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> dq [b, s, heads, d], dkv [2, b, s, kv_heads, d], both in q's / kv's dtype."""
    cp, c = ring.cp, q.shape[1] // 2
    heads, rep = q.shape[2], q.shape[2] // kv.shape[3]
    qt, ot, dot = q.transpose(1, 2), out.transpose(1, 2), dout.transpose(1, 2)
    chunk = [slice(h * c, (h + 1) * c) for h in (0, 1)]
    qs = [qt[:, :, s].contiguous() for s in chunk]
    os_ = [ot[:, :, s].contiguous() for s in chunk]
    dos = [dot[:, :, s].contiguous() for s in chunk]
    ls = [lse[:, :, s].contiguous() for s in chunk]
    dq = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
    held = kv
    grad_works: list[Any] = []
    grad_in: torch.Tensor | None = None
    for t in range(cp):
        src = (ring.rank - t) % cp
        works, incoming = ring.pass_on(held, _KV_TAG) if t < cp - 1 else ([], held)
        k, v = _heads(held, rep)
        b, _, s, d = k.shape
        partial = torch.zeros((2, b, heads // rep, s, d), dtype=torch.float32, device=q.device)  # kv heads
        for qh, kh, causal in blocks(cp, ring.rank, src):
            dqb, dkb, dvb = block_backward(dos[qh], qs[qh], k[:, :, chunk[kh]].contiguous(),
                                           v[:, :, chunk[kh]].contiguous(), os_[qh], ls[qh], causal, fused)
            dq[:, :, chunk[qh]] += dqb
            # GQA: the repeated heads' gradients summed onto their kv head, block by block
            partial[0, :, :, chunk[kh]] += dkb.view(b, heads // rep, rep, c, d).sum(2)
            partial[1, :, :, chunk[kh]] += dvb.view(b, heads // rep, rep, c, d).sum(2)
        acc = partial.transpose(2, 3).contiguous()  # [2, b, s, kv_heads, d], as the K/V travel
        if grad_in is not None:  # the accumulator for src's K/V, from rank - 1
            _wait(grad_works)
            acc += grad_in
        grad_works, grad_in = ring.pass_on(acc, _GRAD_TAG)  # on to rank + 1; the last one reaches the owner
        _wait(works)
        held = incoming
    _wait(grad_works)
    assert grad_in is not None
    return dq.transpose(1, 2).to(q.dtype), grad_in.to(kv.dtype)


# ----------------------------------------------------------------------------------- the op
@torch.library.custom_op("hpctrain::ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, kv: torch.Tensor, group_name: str, cp: int, rank: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the local query chunks over the whole sequence by a ring (module docstring)."""
    return ring_forward(_Ring(_GROUPS[group_name], cp, rank), q, kv)


@ring_attention.register_fake
def _(q: torch.Tensor, kv: torch.Tensor, group_name: str, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, kv, group_name, cp, rank = inputs
    ctx.save_for_backward(q, kv, *output)
    ctx.ring = (group_name, cp, rank)


def _backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple[Any, ...]:
    q, kv, out, lse = ctx.saved_tensors
    group_name, cp, rank = ctx.ring
    dq, dkv = ring_backward(_Ring(_GROUPS[group_name], cp, rank), dout, q, kv, out, lse)
    return dq, dkv, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)
