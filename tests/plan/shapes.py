"""Model shapes shared by the planner tests (plain namespaces: the planner reads job.model by attribute)."""

from __future__ import annotations

from types import SimpleNamespace


def shape(**fields: object) -> SimpleNamespace:
    base = dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=256, vocab=1000, seq_len=128,
                activation="gelu", tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0, preset=None)
    base.update(fields)
    return SimpleNamespace(**base)


LLAMA3_8B = shape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                  seq_len=8192, activation="swiglu")
LLAMA2_7B = shape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                  seq_len=4096, activation="swiglu")
LLAMA3_70B = shape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                   seq_len=8192, activation="swiglu")
GPT3_175B = shape(layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=50257,
                  seq_len=2048, activation="gelu", tie_embeddings=True)
# Megatron-LM's 1T configuration (Narayanan et al. 2021, table 1): 128 layers, hidden 25600, 160 heads.
GPT_1T = shape(layers=128, hidden=25600, heads=160, kv_heads=160, ffn_hidden=4 * 25600, vocab=51200,
               seq_len=2048, activation="gelu", tie_embeddings=True)
