"""The dense feed-forward network of a block (gelu: w2(gelu(w1 x)); swiglu: w2(silu(w1 x) * w3 x)), also a
MoE block's shared experts (runtime/model/moe.py). Its own module so that transformer.py and moe.py both
import it and neither imports the other back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, swiglu: bool) -> None:
        super().__init__()
        self.swiglu = swiglu
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
