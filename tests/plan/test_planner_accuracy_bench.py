"""bench/planner_accuracy.py's machinery on two corpus runs (issue 13 item 5): the corpus loads with
its required fields, each run is ranked, predicted in the publisher's unit and summarised. The
accuracy targets themselves are the bench's output, not asserted here."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_accuracy as bench  # noqa: E402

from hpctrain.plan import moe_cost  # noqa: E402

REQUIRED = {"name", "source", "verified", "set", "layout_case", "model", "hardware", "global_batch", "layout", "metric"}


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return bench.load_corpus()


def test_corpus_fields_and_split(corpus: list[dict]) -> None:
    names = [run["name"] for run in corpus]
    assert len(names) == len(set(names))
    for run in corpus:
        assert REQUIRED <= set(run), run["name"]
        assert {"tp", "pp"} <= set(run["layout"]) and run["metric"]["value"] > 0, run["name"]
    # The split is by source (one publication's table = one name prefix): none has rows in both sets.
    sources: dict[str, set[str]] = {}
    for run in corpus:
        sources.setdefault(run["name"].split("-")[0], set()).add(run["set"])
    assert all(len(sets) == 1 for sets in sources.values()), sources
    assert {run["set"] for run in corpus} == {"calibration", "validation"}


def test_two_runs_ranked_predicted_and_summarised(corpus: list[dict]) -> None:
    runs = {run["name"]: run for run in corpus}
    chosen = [runs["mpt-1b-a100"], runs["ptdp-1.7b"]]
    outcomes = [bench.evaluate(run) for run in chosen]
    for run, o in zip(chosen, outcomes):
        assert o.rank is not None and o.rank >= 1 and o.rank_note.startswith("best: ")
        assert o.published == run["metric"]["value"] and o.unit == run["metric"]["unit"]
        assert o.predicted > 0 and math.isfinite(o.error) and o.memory_gib > 0
        assert f"tp={run['layout']['tp']} pp={run['layout']['pp']}" in o.layout
        assert o.name in bench.row(o)
    # The publisher's unit: tokens/s per GPU is the planner's own figure; TFLOP/s goes through
    # Megatron's formula (Narayanan et al. 2021, eq. 3) on the same tokens/s.
    mpt, ptdp = outcomes
    hw, lay, _ = bench.predict(runs["ptdp-1.7b"])
    model = bench._job(runs["ptdp-1.7b"], fixed=True).model
    tokens = lay.cost.tokens_per_s / 32
    assert ptdp.predicted == pytest.approx(bench.publisher_flops_per_token(model, "megatron_hfu") * tokens / 1e12)
    s = bench.summary(outcomes, "calibration")
    assert s["throughput_cases"] == 2 and s["layout_cases"] == 1
    assert s["median_abs_error"] == pytest.approx(sorted([abs(mpt.error), abs(ptdp.error)])[0] / 2
                                                  + sorted([abs(mpt.error), abs(ptdp.error)])[1] / 2)
    assert s["within"] == sum(abs(o.error) <= bench.TOLERANCE for o in outcomes)
    assert "calibration: published (tp,pp) in top 5" in bench.summary_line(s)


def test_family_rank_orders_families_by_their_best_layout() -> None:
    class L:
        def __init__(self, tp: int, pp: int) -> None:
            self.tp, self.pp = tp, pp

    layouts = [L(1, 1), L(1, 1), L(8, 2), L(4, 1), L(8, 2)]
    assert bench.family_rank(layouts, (8, 2)) == 2
    assert bench.family_rank(layouts, (4, 1)) == 3
    assert bench.family_rank(layouts, (2, 2)) is None


def test_fit_reads_only_the_calibration_set(corpus: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """--fit picks, per GPU, the grid value with the smallest median |log error| over CALIBRATION runs;
    a validation run on the same GPU, however wrong, does not move it."""
    runs = {run["name"]: run for run in corpus}
    calibration = runs["mpt-1b-a100"]
    poisoned = {**runs["torchtitan-llama3-70b"], "metric": {"value": 1.0, "unit": "tokens_per_s_per_gpu"}}
    grid = [0.45, 0.63, 0.85]
    monkeypatch.setattr(bench, "GEMM_GRID", grid)
    fitted = bench.fit_gemm_efficiency([calibration, poisoned])
    key = ("a100-80gb", "torch")
    assert set(fitted) == {key}
    errors = {v: abs(math.log(bench.evaluate(calibration, {key: v}, rank=False).predicted
                              / calibration["metric"]["value"])) for v in grid}
    assert fitted[key] == min(errors, key=errors.get)
    # Had the fit read the poisoned run too, it would have chosen differently (the test has power).
    poison = {v: abs(math.log(bench.evaluate(poisoned, {key: v}, rank=False).predicted)) for v in grid}
    both = {v: (errors[v] + poison[v]) / 2 for v in grid}
    assert min(both, key=both.get) != fitted[key]
    # One figure per (GPU, software stack): a megatron-te calibration run on the same GPU is fitted on its own.
    te = {**calibration, "name": "mpt-te", "stack": "megatron-te"}
    both_stacks = bench.fit_gemm_efficiency([calibration, te])
    assert set(both_stacks) == {key, ("a100-80gb", "megatron-te")}


def test_the_fit_stays_under_what_cublaslt_alone_measures(corpus: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack fitted on FP8 runs may not price its GEMMs faster than cuBLASLt alone ran them on that GPU
    (hardware.FP8_GEMM_MEASURED_TFLOPS): on H100, 1,382.2 / (1,979 x 0.80) = 0.873, so a grid value above it is never
    chosen even where the calibration error would still fall."""
    from hpctrain.plan.hardware import FP8_GEMM_MEASURED_TFLOPS

    runs = {run["name"]: run for run in corpus}
    llama = runs["nemo2407-llama2-7b"]
    assert llama["precision"] == "fp8" and FP8_GEMM_MEASURED_TFLOPS["h100-80gb"] == 1382.2
    too_slow = {**llama, "metric": {**llama["metric"], "value": llama["metric"]["value"] * 3}}  # wants the fastest
    monkeypatch.setattr(bench, "GEMM_GRID", [0.80, 0.87, 0.88, 0.95])
    key = ("h100-80gb", "megatron-te")
    assert bench.fit_gemm_efficiency([too_slow])[key] == 0.87
    bf16 = {**too_slow, "precision": "bf16"}  # no measurement bounds a 16-bit fit here
    assert bench.fit_gemm_efficiency([bf16])[key] == 0.95


def test_te_attention_names_transformer_engines_backend(corpus: list[dict]) -> None:
    """NeMo's launcher runs of 2024 (NVTE_FUSED_ATTN=0) carry `te_attention: flash`: FlashAttention-2's figure, so
    their long-sequence rows are slower than with cuDNN's kernels; the field is checked and megatron-te only."""
    runs = {run["name"]: run for run in corpus}
    run = runs["nemo2403ls-llama2-7b-128k"]
    assert run["te_attention"] == "flash" and runs["nemo2407-gpt3-175b-128"].get("te_attention") is None
    fused = {k: v for k, v in run.items() if k != "te_attention"}
    _, flash_layout, _ = bench.predict(run)
    _, fused_layout, _ = bench.predict(fused)
    assert flash_layout.cost.tokens_per_s < 0.8 * fused_layout.cost.tokens_per_s  # attention is most of 128K tokens
    with pytest.raises(SystemExit, match="te_attention must be one of fused, flash"):
        bench._te_attention({**run, "te_attention": "cudnn"})
    with pytest.raises(SystemExit, match="te_attention applies to stack megatron-te only"):
        bench._te_attention({**fused, "stack": "torch", "te_attention": "flash"})


def test_the_stack_and_dispatcher_fields_reach_the_cost(corpus: list[dict]) -> None:
    """`stack: megatron-te` runs attention at the FA3 class on Hopper and the routed experts in FP8 under fp8;
    `dispatcher: deepep` deduplicates the fabric copies; unknown values stop the bench with one line."""
    run = next(r for r in corpus if r["name"] == "mbridge-qwen3-235b-fp8")
    torch_run = {k: v for k, v in run.items() if k not in ("stack", "dispatcher")}
    te_run = {**torch_run, "stack": "megatron-te"}
    job = bench._job(te_run, fixed=True)
    assert bench._hardware(job, None, te_run).gpu.attention_efficiency > bench._hardware(job, None, torch_run).gpu.attention_efficiency
    _, plain, _ = bench.predict(torch_run)
    _, te, _ = bench.predict(te_run)
    assert te.cost.tokens_per_s > plain.cost.tokens_per_s
    nccl = {**te_run, "a2a_overlap": False}
    deepep = {**nccl, "dispatcher": "deepep"}
    _, a, _ = bench.predict(nccl)
    _, d, _ = bench.predict(deepep)
    assert a.label() == d.label() and d.cost.a2a_s < a.cost.a2a_s  # ep 32 over 4 nodes: fewer fabric bytes
    with pytest.raises(SystemExit, match="dispatcher must be one of alltoall, deepep, hybridep"):
        bench._dispatcher({**run, "dispatcher": "nccl"})
    with pytest.raises(SystemExit, match="stack must be one of torch, megatron-te"):
        bench._stack({**run, "stack": "jax"})


def test_the_publishers_software_is_costed(corpus: list[dict]) -> None:
    """A run declares what its software had: its attention kernel (pre-FlashAttention runs
    materialise the scores, slower than flash) and its recomputation modes (no selective before
    Korthikanti et al. 2022); the search keeps to both."""
    runs = {run["name"]: run for run in corpus}
    run = runs["ptdp2-175b-384"]
    assert run["attention"] == "materialized" and run["ac_modes"] == ["none", "full"]
    job = bench._job(run, fixed=False)
    hw = bench._hardware(job, None, run)
    layouts, _ = bench._search(job, hw, run=run)
    assert layouts and {lay.ac for lay in layouts} <= {"none", "full"}
    flash_run = {key: value for key, value in run.items() if key not in ("attention", "ac_modes")}
    flash, _ = bench._search(job, hw, run=flash_run)
    assert "selective" in {lay.ac for lay in flash}
    assert flash[0].cost.tokens_per_s > layouts[0].cost.tokens_per_s
    with pytest.raises(SystemExit, match="attention must be one of flash, materialized"):
        bench._attention({**run, "attention": "xformers"})


def test_a_step_time_row_is_costed_as_published_and_compared_as_throughput(corpus: list[dict]) -> None:
    """Korthikanti et al.'s table 5 rows publish seconds per iteration: the prediction is the global
    batch over the planner's tokens/s, the error a throughput ratio (published / predicted - 1), and
    the published schedule (interleaved, 3 stages per rank) is the one costed."""
    run = {r["name"]: r for r in corpus}["korthikanti-175b-t5-selective"]
    o = bench.evaluate(run, rank=False)
    hw, lay, _ = bench.predict(run)
    assert (lay.schedule, lay.virtual_stages, lay.ac, lay.sequence_parallel) == ("interleaved-1f1b", 3, "selective", True)
    assert o.unit == "step_time_s" and o.published == 13.75
    assert o.predicted == pytest.approx(64 * 2048 / lay.cost.tokens_per_s)
    assert o.error == pytest.approx(13.75 / o.predicted - 1)
    assert "13.75 s" in bench.row(o)


def test_a_run_the_planner_cannot_cost_is_a_miss_not_a_crash(corpus: list[dict]) -> None:
    good = {r["name"]: r for r in corpus}["mpt-1b-a100"]
    bad = {**good, "name": "typo", "hardware": {**good["hardware"], "gpu": "a100-81gb"}}
    outcomes = [bench.evaluate_or_fail(good), bench.evaluate_or_fail(bad)]
    assert outcomes[1].failure.startswith("ValueError: cluster.gpu: unknown name (got 'a100-81gb')")
    assert "NOT COSTED" in bench.row(outcomes[1])
    s = bench.summary(outcomes, "calibration")
    assert (s["throughput_cases"], s["within"], s["not_costed"]) == (2, 1, 1)
    assert "1 not costed, counted as misses" in bench.summary_line(s)


def test_categories_and_the_new_rows_fields(corpus: list[dict]) -> None:
    runs = {run["name"]: run for run in corpus}
    assert bench.categories(runs["ptdp-1.7b"]) == ["dense"]
    assert bench.categories(runs["mbridge-qwen3-30b-fp8"]) == ["MoE", "FP8"]
    assert bench.categories(runs["tt24-8b-cp2"]) == ["CP", "FP8"]
    assert bench.categories(runs["llama3-405b-131k"]) == ["CP"]
    for category in bench.CATEGORIES:  # every category has validation rows
        assert any(category in bench.categories(r) and r["set"] == "validation" for r in corpus), category


def test_kendall_tau_and_table_lines() -> None:
    assert bench.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert bench.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)

    def outcome(name: str, published: float, predicted: float) -> bench.Outcome:
        return bench.Outcome(name=name, set="validation", layout_case=False, rank=1, rank_note="",
                             unit="tokens_per_s_per_gpu", published=published, predicted=predicted, layout="",
                             fits=True, memory_gib=1.0, published_memory_gib=None)

    outcomes = [outcome("a", 30, 10), outcome("b", 20, 20), outcome("c", 10, 30), outcome("d", 5, 5)]
    runs = [{"table": "t"}] * 4
    (line,) = bench.table_lines(outcomes, runs)
    assert "Kendall tau +0.00" in line and "published best a in the planner's top 3" in line
    assert bench.table_lines(outcomes[:2], runs[:2]) == []  # fewer than 3 layouts: no line


def test_a_moe_fp8_row_is_costed_with_the_publishers_software(corpus: list[dict]) -> None:
    run = next(r for r in corpus if r["name"] == "mbridge-qwen3-30b-fp8")
    _, lay, _ = bench.predict(run)
    assert lay.ep == 8 and lay.cost.a2a_s > 0
    plain = {**run, "precision": "bf16", "fused": False, "expert_load_imbalance": None}
    _, bf16, _ = bench.predict(plain)
    assert lay.cost.tokens_per_s > bf16.cost.tokens_per_s  # FP8 linears and fused element-wise work


def test_megatron_flop_formula_by_hand_and_against_megatron_bridge() -> None:
    """`megatron` = Megatron-LM's num_floating_point_operations (2025) per token: 12 l h x FFN (x 3/2 gated, top-k
    experts) + 12 l h^2 (1 + g/a + s/2h) (a d / h) + 6 h V. By hand for Qwen3-235B-A22B and Llama 3 70B, then
    against Megatron-Bridge's published pairs (tokens/s/GPU, Model TFLOP/s/GPU), which its flop_utils.py computes
    with the same formula: 26.04 DGX-H100, Qwen3_235B_a22B 1686 -> 250, LLAMA3_70B 1633 -> 734."""
    from hpctrain.config.model import ModelConfig

    qwen = ModelConfig(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, ffn_hidden=12288, vocab=151936,
                       seq_len=4096, moe=dict(experts=128, top_k=8, expert_ffn_hidden=1536))
    llama = ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256, seq_len=8192)
    # Qwen3-235B: routed FFN 8 x 1536 x 3/2; attention with head_dim 128 x 64 heads = 2 h (query ratio 2).
    qwen_hand = (12 * 94 * 4096 * (8 * 1536 * 1.5)
                 + 12 * 94 * 4096**2 * (1 + 4 / 64 + 4096 / 4096 / 2) * 2
                 + 6 * 4096 * 151936)
    llama_hand = (12 * 80 * 8192 * (28672 * 1.5)
                  + 12 * 80 * 8192**2 * (1 + 8 / 64 + 8192 / 8192 / 2)
                  + 6 * 8192 * 128256)
    assert bench.publisher_flops_per_token(qwen, "megatron") == pytest.approx(qwen_hand, rel=1e-12)
    assert bench.publisher_flops_per_token(llama, "megatron") == pytest.approx(llama_hand, rel=1e-12)
    assert qwen_hand == pytest.approx(148.03e9, rel=1e-4) and llama_hand == pytest.approx(449.22e9, rel=1e-4)
    assert bench.publisher_flops_per_token(qwen, "megatron") * 1686 / 1e12 == pytest.approx(250, rel=0.005)
    assert bench.publisher_flops_per_token(llama, "megatron") * 1633 / 1e12 == pytest.approx(734, rel=0.005)
    # A dense gelu model: no 3/2, the FFN's two matrices; MHA (kv_heads = heads).
    gpt = ModelConfig(layers=24, hidden=4096, heads=32, ffn_hidden=16384, vocab=50304, seq_len=2048, activation="gelu")
    assert bench.publisher_flops_per_token(gpt, "megatron") == pytest.approx(
        12 * 24 * 4096 * 16384 + 12 * 24 * 4096**2 * (2 + 2048 / 4096 / 2) + 6 * 4096 * 50304, rel=1e-12)


def test_the_new_sources_fields() -> None:
    """Rows of Megatron-Core software carry `stack: megatron-te`; MoE rows of Megatron-Bridge a dispatcher where
    the release's recipe was found; the ModelZoo table is one `table`; the pending CP-with-EP file parses in the
    corpus's format and is not the bench's corpus."""
    corpus = bench.load_corpus()
    runs = {run["name"]: run for run in corpus}
    for run in corpus:
        if run["name"].split("-")[0] in ("nemo2407", "mz", "mbridge", "mbridge2602", "mb2509", "mb260201", "mb2604",
                                         "mb260401", "mb2606", "mb260601", "mb2608", "nemo2403ls", "nemo2504ls"):
            assert run.get("stack") == "megatron-te" and run.get("fused") is True, run["name"]
        assert run.get("stack", "torch") in ("torch", "megatron-te"), run["name"]
        assert run.get("dispatcher") in (None, "alltoall", "deepep", "hybridep"), run["name"]
    assert all(run["set"] == "calibration" for run in corpus if run["name"].startswith("nemo2407-"))
    table = [run for run in corpus if run.get("table") == "modelzoo-qwen3-235b-h100"]
    assert len(table) == 5 and all(run["metric"]["unit"] == "step_time_s" for run in table)
    assert runs["mb2509-qwen3-235b-fp8-tokendrop"]["token_drop"] is True
    # the H100 long-context table (CP with EP) is costed since the cpep merge: 8 rows, CP 1 to 8, Megatron's FLOPs
    long_context = [run for run in corpus if run["name"].startswith("mz-lc-") and run["hardware"]["gpu"] == "h100-80gb"]
    assert len(long_context) == 8 and {run["layout"]["cp"] for run in long_context} == {1, 2, 4, 8}
    assert all(run["metric"]["flops"] == "megatron" and run["layout"]["ep"] == 8 for run in long_context)
    # and the GB200 128K row of the same readme: CP 4 with EP 32 on an NVL72 rack
    assert runs["mz-lc-qwen3-235b-gb200-128k"]["layout"]["cp"] == 4 and runs["mz-lc-qwen3-235b-gb200-128k"]["layout"]["ep"] == 32
    pending = bench.load_corpus(bench.CORPUS.parent / "pending_cp_ep_runs.yaml")
    assert not {run["name"] for run in pending} & set(runs)
    # Blackwell rows (2026-12-06): every one names a catalog node of its GPU; the NeMo long-sequence table is its own
    # validation source, in TFLOP/s by the 2024 formula, its CP rows on Megatron-Core's ring.
    from hpctrain.plan.hardware import NODES

    blackwell = [run for run in corpus if run["hardware"]["gpu"].startswith(("b200", "b300", "gb200", "gb300"))]
    # 102 Megatron-Bridge, 4 ModelZoo (the GB200 128K CP x EP row among them), 8 of NeMo 25.04's B200 long-sequence table
    assert len(blackwell) == 114
    assert all(NODES[run["hardware"]["node"]].gpu == run["hardware"]["gpu"] for run in blackwell)
    for prefix, rows in (("nemo2403ls-", 9), ("nemo2504ls-", 8)):
        long_seq = [run for run in corpus if run["name"].startswith(prefix)]
        assert len(long_seq) == rows and all(run["set"] == "validation" for run in long_seq)
        assert all(run["metric"]["flops"] == "megatron_2024" for run in long_seq)
        assert all(run.get("cp_rotate") == "ring" for run in long_seq if run["layout"].get("cp", 1) > 1)
        # the GPUs are the layout's (the B200 table's later version lists four times as many: `assumed`)
        assert all(run["hardware"]["gpus"] == run["layout"]["tp"] * run["layout"].get("pp", 1) * run["layout"]["dp"]
                   * run["layout"].get("cp", 1) for run in long_seq)


def test_megatron_2024_flop_formula_by_hand_and_against_nemo_2407() -> None:
    """`megatron_2024` = Megatron-LM's num_floating_point_operations from 2024-04-04 to 2025-03-06 (and NeMo's flops
    formulas until 2025-08): the full s x s score matrix, 12 l h^2 (1 + g/a + s/h) (a d / h), top-k experts on every
    layer. By hand for Llama 2 7B at 4K and 1M tokens; against NeMo 24.07's published pair for Llama 2 7B (16934
    tokens/s/GPU, 780 Model TFLOP/s/GPU: this formula gives 780.4, the causal 2025 one 725.9)."""
    from hpctrain.config.model import ModelConfig

    def llama2_7b(seq: int) -> ModelConfig:
        return ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000, seq_len=seq)

    for seq in (4096, 1048576):
        hand = 12 * 32 * 4096**2 * (1 + 1 + seq / 4096) + 12 * 32 * 4096 * 11008 * 1.5 + 6 * 4096 * 32000
        assert bench.publisher_flops_per_token(llama2_7b(seq), "megatron_2024") == pytest.approx(hand, rel=1e-12)
        # the 2025 form differs by the halved scores only: 6 l h s (r = 1 here)
        assert (bench.publisher_flops_per_token(llama2_7b(seq), "megatron_2024")
                - bench.publisher_flops_per_token(llama2_7b(seq), "megatron")) == pytest.approx(6 * 32 * 4096 * seq)
    assert bench.publisher_flops_per_token(llama2_7b(4096), "megatron_2024") == pytest.approx(46.0849e9, rel=1e-5)
    flops_4k = bench.publisher_flops_per_token(llama2_7b(4096), "megatron_2024")
    assert flops_4k * 16934 / 1e12 == pytest.approx(780, rel=0.001)
    assert bench.publisher_flops_per_token(llama2_7b(4096), "megatron") * 16934 / 1e12 < 730
    # MoE: the 2024 form puts the routed experts on every layer (model.moe's dense_layers not split off)
    moe = ModelConfig(layers=4, hidden=1024, heads=8, kv_heads=2, ffn_hidden=4096, vocab=1000, seq_len=2048,
                      moe=dict(experts=8, top_k=2, expert_ffn_hidden=512, dense_layers=1))
    moe_hand = 12 * 4 * 1024 * (2 * 512 * 1.5) + 12 * 4 * 1024**2 * (1 + 2 / 8 + 2048 / 1024) + 6 * 1024 * 1000
    assert bench.publisher_flops_per_token(moe, "megatron_2024") == pytest.approx(moe_hand, rel=1e-12)
    with pytest.raises(SystemExit, match="known: megatron_hfu, megatron_mfu, palm, megatron, megatron_2024"):
        bench.publisher_flops_per_token(moe, "megatron_2023")


def test_the_cp_rotate_field_reaches_the_cost(corpus: list[dict]) -> None:
    """`cp_rotate: ring` (Megatron-Core's point-to-point CP) prices the K/V exchange as the planner's ring, beside
    the attention blocks, where the default all-gathers it; unknown values stop the bench with one line."""
    run = {r["name"]: r for r in corpus}["nemo2403ls-llama2-7b-256k"]
    _, ring, _ = bench.predict(run)
    _, gather, _ = bench.predict({**run, "cp_rotate": "allgather", "layout": {**run["layout"], "ac": "none"}})
    assert (ring.cp, ring.ac, gather.ac) == (8, "none", "none")
    assert ring.cost.cp_comm_s < gather.cost.cp_comm_s
    with pytest.raises(SystemExit, match="cp_rotate must be one of allgather, ring"):
        bench._cp_rotate({**run, "cp_rotate": "a2a"})


# A Blackwell row as the corpus would hold one (issue 26; the lead owns the corpus, so it is inline here): a MoE
# model in MXFP8 on 256 GB200 GPUs of NVL72 racks, with no gpus_per_node (the node profile's 4 per compute tray).
GB200_MXFP8 = {
    "name": "inline-gb200-mxfp8", "set": "validation", "layout_case": False, "precision": "fp8",
    "fp8_recipe": "mxfp8", "fused": True, "expert_load_imbalance": 1.0,
    "source": "inline test row", "verified": "not a published run",
    "model": {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "qk_norm": True,
              "ffn_hidden": 6144, "vocab": 151936, "seq_len": 4096, "tie_embeddings": False,
              "moe": {"experts": 128, "top_k": 8, "expert_ffn_hidden": 768}},
    "hardware": {"gpu": "gb200-186gb", "gpus": 256, "node": "gb200-nvl72", "fabric": "ib-ndr400"},
    "global_batch": 1024, "layout": {"tp": 1, "pp": 1, "ep": 16, "micro_batch": 1, "zero": 1},
    "metric": {"value": 10000, "unit": "tokens_per_s_per_gpu"}}


def test_a_gb200_mxfp8_row_costs_with_its_recipe_and_its_nvlink_domain() -> None:
    job = bench._job(GB200_MXFP8, fixed=True)
    assert (job.cluster.nodes, job.cluster.gpus_per_node, job.train.fp8.recipe) == (64, 4, "mxfp8")
    hw, lay, fits = bench.predict(GB200_MXFP8)
    assert fits and (hw.nvlink_domain_gpus, hw.gpu.name) == (72, "gb200-186gb")
    assert (lay.tp, lay.pp, lay.dp, lay.ep) == (1, 1, 256, 16)
    # racks of 72 GPUs: the ep group on slots 64-79 straddles two racks, its all-to-all leaves NVLink
    assert lay.cost.a2a_crosses_nodes
    # the publisher's allocation of 16 trays per rack (sbatch --segment=16): every ep group inside one rack
    segments = {**GB200_MXFP8, "hardware": {**GB200_MXFP8["hardware"], "nvlink_domain_gpus": 64}}
    _, inside, _ = bench.predict(segments)
    assert not inside.cost.a2a_crosses_nodes and inside.cost.a2a_s < lay.cost.a2a_s / 5
    # the recipe reaches the cost model: tensorwise (compiled, `fused`) casts 8 bytes per element, mxfp8 6.0625
    _, tensorwise, _ = bench.predict({**GB200_MXFP8, "fp8_recipe": "tensorwise"})
    _, bf16, _ = bench.predict({**GB200_MXFP8, "precision": "bf16"})
    assert bf16.cost.compute_s > tensorwise.cost.compute_s > lay.cost.compute_s
    outcome = bench.evaluate(GB200_MXFP8)
    assert math.isfinite(outcome.error) and outcome.rank is not None
    assert bench.categories(GB200_MXFP8) == ["MoE", "FP8"]


def test_token_drop_and_full_iteration_graphs_take_the_moe_host_sync_away(corpus: list[dict]) -> None:
    """A run's `token_drop` or `cuda_graph: full_iteration` means its MoE blocks never wait for routing sizes on the
    host (moe_cost.MOE_SYNC_HOST_S); Megatron-Core's dropless MoE always does; a torch run as hpctrain's runtime (ep > 1).
    The rows that name a full-iteration graph in their recipe carry the field."""
    runs = {run["name"]: run for run in corpus}
    graphed = runs["mb2606-gb200-qwen3-30b-mxfp8"]
    assert graphed["cuda_graph"] == "full_iteration" and "cuda_graph_impl full_iteration" in graphed["verified"]
    # 26.04's recipe: Transformer Engine's per-layer graphs (router, preprocess), no full iteration: the sync stays
    layers = runs["mb2604-gb200-qwen3-30b-mxfp8"]
    assert layers["cuda_graph"] == "layers" and "cuda_graph_impl transformer_engine" in layers["verified"]
    assert bench._moe_sync(layers) == "always"
    assert bench._moe_sync(graphed) == "none"
    assert bench._moe_sync(runs["mb2509-qwen3-30b-fp8-tokendrop"]) == "none"
    assert bench._moe_sync(runs["mb2604-qwen3-30b-fp8"]) == "always"
    assert bench._moe_sync({"name": "t", "stack": "torch"}) == "ep"
    with pytest.raises(SystemExit, match="cuda_graph must be one of none, layers, full_iteration"):
        bench._moe_sync({**graphed, "cuda_graph": "partial"})
    # the same row without its graph: slower by its syncs, on the same layout
    _, with_graph, _ = bench.predict(graphed)
    _, without, _ = bench.predict({k: v for k, v in graphed.items() if k != "cuda_graph"})
    assert with_graph.label() == without.label() and with_graph.cost.host_s == 0.0
    assert without.cost.host_s > 0 and without.cost.step_time_s > with_graph.cost.step_time_s


def test_layer_graphs_spare_an_fp8_run_its_eager_launches(corpus: list[dict]) -> None:
    """`cuda_graph: layers` (Transformer Engine's per-layer graphs, moe_cost.MOE_EAGER_HOST_S) is on exactly the MoE rows
    whose recipe or command names cuda_graph_impl transformer_engine; taking it off an FP8 row adds the eager launches
    to each block's sync, on the same layout."""
    named = {r["name"] for r in corpus if r["model"].get("moe") and not r.get("token_drop")
             and re.search(r"cuda_graph_impl transformer_engine|--cuda-graph-impl transformer_engine", r["verified"])}
    assert named and named == {r["name"] for r in corpus if r.get("cuda_graph") == "layers"}
    run = next(r for r in corpus if r["name"] == "mb2604-gb200-qwen3-30b-mxfp8")
    _, graphed, _ = bench.predict(run)
    _, eager, _ = bench.predict({k: v for k, v in run.items() if k != "cuda_graph"})
    assert graphed.label() == eager.label()
    assert eager.cost.host_s == pytest.approx(graphed.cost.host_s * (moe_cost.MOE_SYNC_HOST_S + moe_cost.MOE_EAGER_HOST_S)
                                              / moe_cost.MOE_SYNC_HOST_S, rel=1e-9)


def test_the_moe_recompute_field_reaches_the_cost(corpus: list[dict]) -> None:
    """The ModelZoo long-context rows ran --recompute-modules layernorm moe: ac selective with `moe_recompute`, which
    replays the MoE blocks' forward (cost_setup.CostSetup.moe_recompute); without the field the same layout is faster."""
    run = next(r for r in corpus if r["name"] == "mz-lc-qwen3-235b-64k-dropless")
    assert run["moe_recompute"] is True and run["layout"]["ac"] == "selective"
    _, with_replay, _ = bench.predict(run)
    _, without, _ = bench.predict({k: v for k, v in run.items() if k != "moe_recompute"})
    assert with_replay.label() == without.label() and with_replay.ac == "selective"
    assert with_replay.cost.compute_s > without.cost.compute_s and with_replay.cost.a2a_s > without.cost.a2a_s
