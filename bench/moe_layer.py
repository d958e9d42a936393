"""The MoE layer's training throughput (forward + backward, tokens/s) side by side, interleaved rounds:

  moe       hpctrain's MoE (runtime/model/moe.py): sort by expert, grouped GEMMs, weighted scatter-add
  loop      the same experts run per expert with a mask per expert, as transformers' Mixtral/Qwen3-MoE
            eager path does (modeling_mixtral.py MixtralExperts.forward, transformers 5.24)
  dense     a dense SwiGLU FFN of the same active FLOPs: width top_k x expert width (+ the router's)

    python bench/moe_layer.py [--tokens 4096] [--hidden 512] [--experts 8] [--top-k 2] [--ffn 768]
                              [--rounds 5] [--device cpu|cuda] [--dtype fp32|bf16]

Prints each variant's median tokens/s and the ratios moe/dense and moe/loop, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hpctrain.runtime.model.moe import MoE, MoEArgs
from hpctrain.runtime.model.feed_forward import FeedForward


def per_expert_loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' eager MoE, on hpctrain's weights: one mask and two gathers per hit expert."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids, _ = layer.router(flat)
    out = torch.zeros_like(flat)
    mask = F.one_hot(ids, num_classes=layer.args.experts).permute(2, 1, 0)  # [E, k, tokens]
    e = layer.experts
    for expert in range(layer.args.experts):
        slot, token = torch.where(mask[expert])
        if token.numel() == 0:
            continue
        h = flat[token]
        h = F.linear(F.silu(F.linear(h, e.w1[expert])) * F.linear(h, e.w3[expert]), e.w2[expert])
        out.index_add_(0, token, h * weights[token, slot, None].to(h.dtype))
    return out.reshape(x.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=768, help="one expert's inner width")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    moe = MoE(args.hidden, MoEArgs(experts=args.experts, top_k=args.top_k, expert_ffn_hidden=args.ffn)).to(device)
    # Equal active FLOPs: top_k experts' matmuls; the router's hidden x experts is added to the dense width.
    dense_width = args.top_k * args.ffn + -(-args.experts // 3)
    dense = FeedForward(args.hidden, dense_width, swiglu=True).to(device)
    for module in (moe, dense):
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.02)
        module.to(dtype)
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    variants = {"moe": lambda: moe(x), "loop": lambda: per_expert_loop(moe, x), "dense": lambda: dense(x)}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run(fn) -> float:
        fn().float().square().mean().backward()  # warm-up
        sync()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn().float().square().mean().backward()
        sync()
        return args.tokens * args.iters / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved: a slow moment of the machine hits every variant alike
        for name, fn in variants.items():
            rates[name].append(run(fn))
    med = {name: statistics.median(r) for name, r in rates.items()}
    grouped = "torch._grouped_mm" if moe_uses_grouped(moe, x) else "per-expert matmul loop (fallback)"
    print(f"MoE layer, {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, "
          f"expert width {args.ffn}, {args.dtype} on {device} (grouped GEMM: {grouped}); dense FFN width "
          f"{dense_width}; forward+backward, median of {args.rounds} interleaved rounds x {args.iters} steps")
    for name in variants:
        print(f"  {name:6s} {med[name]:>12,.0f} tokens/s")
    print(f"  moe/dense {med['moe'] / med['dense']:.2f}x   moe/loop {med['moe'] / med['loop']:.2f}x")


def moe_uses_grouped(moe: MoE, x: torch.Tensor) -> bool:
    from hpctrain.runtime.model.moe import use_grouped_mm

    return use_grouped_mm(x.reshape(-1, x.shape[-1]), moe.experts.w1)


if __name__ == "__main__":
    main()
