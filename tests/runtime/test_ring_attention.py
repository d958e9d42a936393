"""Ring attention's blocks and merge (runtime/parallel/ring_attention.py) against dense causal attention (issue 25).

One process plays every cp rank: a fake ring hands each rank the other ranks' K/V chunk pairs in the
order the real ring delivers them (and collects the dK/dV accumulators in its order), so the block
structure, the log-sum-exp merge and the backward are checked without a process group. The ring's
transfers themselves run in tests/runtime/test_context_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpctrain.runtime.parallel import ring_attention as ring
from hpctrain.runtime.parallel.context import chunk_positions


class _LocalRing:
    """The ring seen by one rank, with the other ranks' tensors at hand: pass_on returns what rank-1
    would send at this point (its K/V pairs in rotation order; for the accumulators, what the other
    ranks' backward computes is not available here, so the test sums the partials itself)."""

    def __init__(self, cp: int, rank: int, kvs: list[torch.Tensor]) -> None:
        self.cp, self.rank, self.kvs, self.kv_step, self.sent = cp, rank, kvs, 0, []

    def pass_on(self, tensor: torch.Tensor, tag: int) -> tuple[list[Any], torch.Tensor]:
        if tag == ring._KV_TAG:
            self.kv_step += 1
            return [], self.kvs[(self.rank - self.kv_step) % self.cp]
        self.sent.append(tensor.clone())  # an accumulator: recorded; rank-1's comes back as zeros
        return [], torch.zeros_like(tensor)


@pytest.mark.parametrize("cp,batch,heads,kv_heads,seq,dim,fused",
                         [(2, 1, 2, 2, 8, 4, True), (4, 2, 4, 2, 16, 8, True), (3, 1, 6, 2, 24, 4, False),
                          (4, 2, 4, 1, 32, 8, False)])
def test_ring_blocks_equal_dense_causal_attention(cp: int, batch: int, heads: int, kv_heads: int, seq: int,
                                                  dim: int, fused: bool) -> None:
    torch.manual_seed(cp * seq)
    q = torch.randn(batch, seq, heads, dim, dtype=torch.float64 if not fused else torch.float32)
    k = torch.randn(batch, seq, kv_heads, dim, dtype=q.dtype)
    v = torch.randn(batch, seq, kv_heads, dim, dtype=q.dtype)
    dout = torch.randn_like(q)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    rep = heads // kv_heads
    dense = F.scaled_dot_product_attention(qd.transpose(1, 2), kd.repeat_interleave(rep, 2).transpose(1, 2),
                                           vd.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    dense.backward(dout)
    where = [chunk_positions(seq, cp, r) for r in range(cp)]
    kvs = [torch.stack([k[:, w], v[:, w]]) for w in where]
    dk_total, dv_total = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    tol = 1e-5
    for r in range(cp):
        local = _LocalRing(cp, r, kvs)
        out, lse = ring.ring_forward(local, q[:, where[r]], kvs[r], fused)  # type: ignore[arg-type]
        assert (out - dense[:, where[r]]).abs().max().item() <= tol, ("out", r)
        back = _LocalRing(cp, r, kvs)
        dq, _ = ring.ring_backward(back, dout[:, where[r]], q[:, where[r]], kvs[r], out, lse, fused)  # type: ignore[arg-type]
        assert (dq - qd.grad[:, where[r]]).abs().max().item() <= tol, ("dq", r)
        # back.sent[t]: this rank's queries' gradient for the K/V of rank r - t (no other rank's part added)
        assert len(back.sent) == cp
        for t, acc in enumerate(back.sent):
            owner = where[(r - t) % cp]
            dk_total[:, owner] += acc[0]
            dv_total[:, owner] += acc[1]
    assert (dk_total - kd.grad).abs().max().item() <= tol
    assert (dv_total - vd.grad).abs().max().item() <= tol


def test_every_rank_computes_the_same_blocks_and_all_pairs_once() -> None:
    """The causal balance: two c x c blocks per rotation after the first on every rank, and every
    (query chunk, key chunk <= it) pair of the sequence computed exactly once."""
    for cp in (2, 3, 4, 8):
        seen = []
        for r in range(cp):
            mine = (r, 2 * cp - 1 - r)
            for t in range(cp):
                src = (r - t) % cp
                theirs = (src, 2 * cp - 1 - src)
                got = ring.blocks(cp, r, src)
                assert len(got) == (3 if t == 0 else 2), (cp, r, t)
                seen += [(mine[qh], theirs[kh]) for qh, kh, _ in got]
        assert sorted(seen) == sorted((i, j) for i in range(2 * cp) for j in range(i + 1))


def test_the_math_block_in_row_tiles_equals_one_tile() -> None:
    """The fp32 math block (other devices than the CPU) tiles its query rows; tiles of 3 rows (the causal mask
    offset by each tile's first row) give the one-tile result, forward and backward."""
    torch.manual_seed(7)
    q, k, v, dout = (torch.randn(2, 3, 8, 4) for _ in range(4))
    for causal in (True, False):
        whole = ring._math_block(q, k, v, causal)
        tiled = ring._math_block(q, k, v, causal, tile_elements=2 * 3 * 8 * 3)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, tiled))
        back = ring._math_block_backward(dout, q, k, v, whole[0], whole[1], causal)
        back_tiled = ring._math_block_backward(dout, q, k, v, whole[0], whole[1], causal, tile_elements=2 * 3 * 8 * 3)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(back, back_tiled))
        assert len(ring._tiles(q, 8, 2 * 3 * 8 * 3)) == 3  # rows 0-2, 3-5, 6-7
