"""RMSNorm owns its autograd and keeps what a fused kernel keeps; bf16 keeps 16-bit activations
(issue 12 item 2)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hpctrain.runtime.model.transformer import ModelArgs, build_model  # noqa: E402
from hpctrain.runtime.model.norm import rms_norm  # noqa: E402


def test_gradients_match_finite_differences() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))


def test_matches_torch_rms_norm() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 7, 32), torch.randn(32)
    expected = torch.nn.functional.rms_norm(x, (32,), w, 1e-5)
    assert torch.allclose(rms_norm(x, w, 1e-5), expected, atol=1e-6)


def test_saves_16_bit_input_and_one_fp32_rstd_per_row() -> None:
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)  # an fp32 master weight
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    kinds = sorted((str(t.dtype), tuple(t.shape)) for t in saved if t is not w)
    assert kinds == [("torch.bfloat16", (2, 5, 16)), ("torch.float32", (2, 5, 1))]


def test_bf16_autocast_keeps_16_bit_activations() -> None:
    """Without FSDP (autocast): no activation-sized fp32 tensor is saved anywhere in the model."""
    args = ModelArgs(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, seq_len=16)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 64, (2, 16))
    wide: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] in (args.hidden, args.ffn_hidden):
            if not isinstance(t, torch.nn.Parameter):
                wide.append(tuple(t.shape))
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    params = {tuple(p.shape) for p in model.parameters()}
    assert logits.dtype == torch.bfloat16
    assert [s for s in wide if s not in params] == []
