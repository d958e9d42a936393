"""Mixtral and Qwen3-MoE in and out: tiny random models saved by the real transformers (offline).

`init_from` fills model.moe, head_dim and qk_norm from config.json, and the runtime's logits equal
transformers' (fp32) on one process, on pp2 and under expert parallelism (each rank reading only its
experts); a short run from the folder, exported, loads back in
transformers with the runtime's logits.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from hpctrain.cli import main as cli_main
from hpctrain.config import job_from_dict

from ._dist import run_distributed
from ._entry import run_entry
from ._hf import hf_job_dict, runtime_logits, tokens

LOGIT_TOL = 1e-4
SHAPE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5),
    # head_dim 32 != 64/4, the first block dense (mlp_only_layers), un-normalised top-k scores
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                      head_dim=32, mlp_only_layers=[0], norm_topk_prob=False, rms_norm_eps=1e-6),
}


def _save(folder: str, family: str, seed: int) -> str:
    import transformers

    config_cls, model_cls = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
                             "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE, **FAMILIES[family]))
    with torch.no_grad():
        for name, p in model.named_parameters():  # norm gains off 1, so a missing or swapped q/k norm shows
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf-moe")
    return {family: _save(str(root / family), family, i) for i, family in enumerate(FAMILIES)}


def _hf_logits(folder: str, batch: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(batch).logits


def _job(folder: str, pp: int = 1, **train: Any) -> dict[str, Any]:
    job = hf_job_dict(folder, pp=pp, **train)
    job["parallel"]["zero"] = 0
    return job


def test_config_json_fills_moe_head_dim_and_qk_norm(folders) -> None:
    mixtral = job_from_dict(_job(folders["mixtral"])).model
    assert mixtral.moe is not None and not mixtral.qk_norm and mixtral.head_dim == 16
    assert (mixtral.moe.experts, mixtral.moe.top_k, mixtral.moe.expert_ffn_hidden, mixtral.moe.dense_layers) == (4, 2, 48, 0)
    assert mixtral.moe.router.normalize_top_k and mixtral.moe.router.score == "softmax"
    qwen = job_from_dict(_job(folders["qwen3_moe"])).model
    assert qwen.moe is not None and qwen.qk_norm and qwen.head_dim == 32 and qwen.ffn_hidden == 96
    assert (qwen.moe.expert_ffn_hidden, qwen.moe.dense_layers, qwen.moe.router.normalize_top_k) == (40, 1, False)


def test_a_disagreeing_moe_field_is_one_problem(folders, capsys) -> None:
    path = os.path.join(os.path.dirname(folders["mixtral"]), "job.yaml")
    job = _job(folders["mixtral"])
    job["model"]["moe"] = {"experts": 8, "top_k": 2, "router": {"aux_loss_coeff": 0.01}}
    with open(path, "w") as handle:
        json.dump(job, handle)
    assert cli_main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "model.moe.experts" in err and "differs from init_from's config.json (4)" in err
    assert "aux_loss_coeff" not in err  # the router's balancing is the job's choice, not config.json's


def _build(folder: str, pp: int) -> Any:
    from hpctrain.runtime.model.hf_weights import load_init_from
    from hpctrain.runtime.parallel.build import build_training

    training = build_training(job_from_dict(_job(folder, pp=pp)), torch.device("cpu"), initialise=False)
    load_init_from(training)
    return training


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_process_logits_match_transformers(folders, family: str) -> None:
    batch = tokens()
    got = runtime_logits(_build(folders[family], 1), batch)
    assert got is not None
    want = _hf_logits(folders[family], batch)
    assert (got - want).abs().max().item() <= LOGIT_TOL


def _pp2_logits(cases: list[str], batch: torch.Tensor) -> list[Any]:
    return [runtime_logits(_build(folder, 2), batch) for folder in cases]


@pytest.mark.dist
def test_pp2_logits_match_transformers(folders) -> None:
    batch = tokens()
    cases = [folders[f] for f in sorted(FAMILIES)]
    ranks = run_distributed(_pp2_logits, 2, cases, batch, timeout_s=180)
    for i, folder in enumerate(cases):
        got = ranks[1][i]  # the last stage holds the logits
        assert ranks[0][i] is None and got is not None
        assert (got - _hf_logits(folder, batch)).abs().max().item() <= LOGIT_TOL, folder


def _ep_cases(cases: list[tuple[str, dict[str, int]]], batch: torch.Tensor) -> list[dict[str, Any]]:
    from hpctrain.runtime.model.hf_weights import load_init_from
    from hpctrain.runtime.parallel.build import build_training

    from ._hf import local_bytes

    out = []
    for folder, layout in cases:
        job = _job(folder, pp=layout["pp"])
        tp = layout.get("tp", 1)
        job["parallel"].update(dp=layout["dp"], ep=layout["ep"], tp=tp, sequence_parallel=tp > 1)
        job["train"]["micro_batch"] = 1
        job["cluster"]["gpus_per_node"] = layout["pp"] * layout["dp"] * tp
        training = build_training(job_from_dict(job), torch.device("cpu"), initialise=False)
        read = load_init_from(training)
        held = local_bytes(training)  # before the forward (FSDP's root keeps its parameters gathered after it)
        experts = {name: tuple(p.to_local().shape) for part in training.model_parts
                   for name, p in part.named_parameters() if name.endswith("experts.w1")}
        out.append({"logits": runtime_logits(training, batch), "read": read["bytes_read"], "held": held,
                    "experts": experts})
    return out


@pytest.mark.dist
def test_expert_parallel_init_from_matches_transformers_and_reads_only_its_experts(folders) -> None:
    """ep2 (over dp4: 2 experts per ep rank, each sharded again over efsdp 2), ep2 x pp2 (dp2 ep2) and ep2 x tp2
    x dp2 (sequence parallel; the ep groups are the tp groups, efsdp 2): logits equal transformers', and each
    rank reads from the folder exactly the bytes of the shards it holds."""
    batch = tokens()
    # Mixtral over dp4 ep2; Qwen3-MoE (its first block dense, head_dim apart from hidden/heads) over pp2 dp2 ep2
    # and over dp2 tp2 ep2.
    cases = [(folders["mixtral"], {"pp": 1, "dp": 4, "ep": 2}), (folders["qwen3_moe"], {"pp": 2, "dp": 2, "ep": 2}),
             (folders["qwen3_moe"], {"pp": 1, "dp": 2, "tp": 2, "ep": 2})]
    ranks = run_distributed(_ep_cases, 4, cases, batch, timeout_s=240)
    for i, (folder, layout) in enumerate(cases):
        want = _hf_logits(folder, batch)
        last = [r[i] for rank, r in enumerate(ranks) if rank // (4 // layout["pp"]) == layout["pp"] - 1]
        for r in last:
            assert r["logits"] is not None and (r["logits"] - want).abs().max().item() <= LOGIT_TOL, (folder, layout)
        for rank, r in enumerate(ranks):
            assert r[i]["read"] == r[i]["held"] > 0, (folder, layout, rank)
            # 4 experts over ep2, then over efsdp = dp x tp / ep
            per_rank = 4 // (layout["dp"] * layout.get("tp", 1))
            assert all(shape[0] == per_rank for shape in r[i]["experts"].values()), r[i]["experts"]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_after_training_loads_in_transformers(folders, tmp_path, family: str) -> None:
    import torch.distributed.checkpoint as dcp

    from hpctrain.config import load_job
    from hpctrain.runtime.parallel.build import build_training

    job = _job(folders[family], steps=2, log_every=1)
    job["checkpoint"] = {"every_steps": 2, "keep_last": 1}
    job["cluster"]["gpus_per_node"] = 1
    job["train"]["micro_batch"] = 2
    run_dir = str(tmp_path / "run")
    assert run_entry(job, run_dir) == [0]
    out = str(tmp_path / "hf")
    assert cli_main(["export", run_dir, "-o", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == family
    resolved = load_job(os.path.join(run_dir, "job.resolved.yaml"))
    part = build_training(resolved, torch.device("cpu")).model_parts[0]
    state = {"model": part.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(run_dir, "checkpoints", "step-2"))
    part.load_state_dict(state["model"])
    part.eval()
    batch = tokens()
    with torch.no_grad():
        want = part(batch)
    assert (_hf_logits(out, batch) - want).abs().max().item() <= LOGIT_TOL
    # trained: the exported router differs from the folder's
    from hpctrain.runtime.model.hf_weights import iter_hf_tensors

    exported, base = dict(iter_hf_tensors(out)), dict(iter_hf_tensors(folders[family]))
    assert exported.keys() == base.keys()
    gate = next(k for k in base if k.endswith("layers.1." + ("block_sparse_moe" if family == "mixtral" else "mlp")
                                               + ".gate.weight"))
    assert 0 < (exported[gate] - base[gate]).abs().max().item() < 0.5


@pytest.mark.slow
def test_a_collapsed_router_gets_the_doctors_finding(tmp_path, capsys) -> None:
    """A Mixtral whose FFN norms are zero: every router logit is 0, top-1 takes the first expert for every
    token, and no gradient can change it (SwiGLU(0) = 0). A real local run, then `hpctrain doctor`."""
    import transformers
    import yaml

    torch.manual_seed(3)
    config = transformers.MixtralConfig(**{**SHAPE, **FAMILIES["mixtral"], "num_experts_per_tok": 1})
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.zero_()
    folder = str(tmp_path / "collapsed")
    model.save_pretrained(folder)
    job = {"name": "collapsed", "model": {"init_from": folder, "seq_len": 16},
           "train": {"global_batch": 4, "micro_batch": 2, "steps": 6, "precision": "fp32", "log_every": 1,
                     "activation_checkpointing": "none", "data": "synthetic"},
           "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
           "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
           "checkpoint": {"every_steps": 100}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    runs = tmp_path / "runs"
    assert cli_main(["submit", str(path), "--set", f"runs_dir={runs}", "--wait"]) == 0
    run = next(p for p in runs.iterdir() if p.is_dir())
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["expert_load_max_over_mean"] for m in metrics] == [4.0] * 6  # 4 experts, all tokens on one
    # the busiest of N expert-parallel ranks: its block of 4 / N experts holds the hot one, so N x the mean
    assert [(m["expert_load_ep2"], m["expert_load_ep4"]) for m in metrics] == [(2.0, 4.0)] * 6
    assert all("aux_loss" not in m for m in metrics)  # no balancing loss asked for: none logged
    capsys.readouterr()
    assert cli_main(["doctor", str(run)]) == 1
    out = capsys.readouterr().out
    assert "the MoE router has collapsed: one expert takes 4.0x the mean load" in out
    assert "--set model.moe.router.aux_loss_coeff=0.01" in out
    assert "--set model.moe.router.bias_update_rate=0.001" in out
    # the planner prices a layout of this model with what the run routed: the busiest ep rank at 4x at ep 4
    from hpctrain.plan import plan_job

    plan_spec = {"name": "collapsed-plan", "model": {"init_from": folder, "seq_len": 4096},
                 "train": {"global_batch": 64, "micro_batch": 2, "activation_checkpointing": "none"},
                 "parallel": {"tp": 1, "pp": 1, "dp": 4, "ep": 4, "zero": 1},
                 "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu": "h100-80gb"}}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan_spec))
    capsys.readouterr()
    assert cli_main(["plan", str(plan_file), "--json", "--expert-load", str(run)]) == 0
    planned = json.loads(capsys.readouterr().out)["expert_load"]
    assert planned["source"] == "measured" and planned["by_ep"] == {"2": 2.0, "4": 4.0}
    assert planned["steps"] == [1, 6] and planned["lines"] == 6
    from hpctrain.plan.expert_load import KEY, read_expert_load
    from hpctrain.rundir.metrics import METRICS_FILE, records_backwards

    load = read_expert_load(str(run), job_from_dict(plan_spec), run / METRICS_FILE, records_backwards(run, KEY))
    measured, default = plan_job(job_from_dict(plan_spec), load).best, plan_job(job_from_dict(plan_spec)).best
    # 4x the mean rows on the busiest rank, against the default 1.1 (step) and 1.0 (memory): slower, and more held
    assert measured.cost.step_time_s > default.cost.step_time_s
    assert measured.memory.activations > default.memory.activations
