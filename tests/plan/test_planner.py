"""plan_job / resolve_job on real job files: auto values resolved, fixed ones respected, reasons given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.config import job_from_dict, load_job
from hpctrain.errors import PlanError
from hpctrain.plan import check_catalog_names, plan_job, resolve_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LAYOUT_KEYS = {"tp", "pp", "dp", "micro_batch", "schedule", "virtual_stages", "ac", "zero", "offload_optimizer",
               "memory_gib", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "comm_share", "bubble_share"}


def job(**sections):
    base = {"name": "t", "model": {"preset": "llama3-8b"}, "train": {"global_batch": 64},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return job_from_dict(base)


def test_gpt3_example_resolves_every_auto():
    resolved, result = resolve_job(load_job(EXAMPLES / "gpt3-175b.yaml"))
    par, train = resolved.parallel, resolved.train
    for value in (par.tp, par.pp, par.dp, par.zero, par.virtual_stages, train.micro_batch):
        assert isinstance(value, int)
    assert par.tp * par.pp * par.dp == 1024
    assert par.schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    assert train.activation_checkpointing in ("none", "selective", "full")
    assert resolved.placement.stage_layers[0][0] == 0 and resolved.placement.stage_layers[-1][1] == 96
    assert result.best.memory.total <= result.budget_bytes


def test_fixed_values_are_respected():
    resolved, result = resolve_job(job(parallel={"tp": 2, "pp": 2}, train={"micro_batch": 1,
                                                                           "activation_checkpointing": "full"}))
    assert (resolved.parallel.tp, resolved.parallel.pp, resolved.parallel.dp) == (2, 2, 4)
    assert resolved.train.micro_batch == 1 and resolved.train.activation_checkpointing == "full"
    assert all((lay.tp, lay.pp, lay.micro_batch, lay.ac) == (2, 2, 1, "full") for lay in result.layouts)


def test_json_shape():
    data = json.loads(json.dumps(plan_job(job()).to_json(top=3)))
    assert len(data["layouts"]) == 3
    for layout in data["layouts"]:
        assert LAYOUT_KEYS <= set(layout)
        assert set(layout["memory_gib"]) == {"weights", "grads", "optimizer", "activations", "other", "total"}
    assert isinstance(data["rejected"]["counts"], dict) and isinstance(data["rejected"]["examples"], dict)
    ranked = [lay["tokens_per_s"] for lay in data["layouts"]]
    assert ranked == sorted(ranked, reverse=True)


def test_nothing_fits_raises_with_reasons():
    with pytest.raises(PlanError) as info:
        plan_job(job(model={"preset": "llama3-70b"}, cluster={"nodes": 1, "gpus_per_node": 1, "node": None},
                     parallel={"tp": 1}))
    text = str(info.value)
    assert "no layout" in text and "memory over budget" in text


def test_v100_has_no_bf16():
    with pytest.raises(PlanError, match="train.precision"):
        plan_job(job(cluster={"gpu": "v100-32gb", "node": None}))


def test_catalog_names_did_you_mean():
    problems = check_catalog_names(job(cluster={"gpu": "a100-80g", "node": "dgx-a10", "fabric": "ib-hdr"}))
    text = "\n".join(problems)
    assert "'a100-80gb'" in text and "'dgx-a100'" in text and "'ib-hdr200'" in text
    assert all(line.startswith("cluster.") for line in problems)


def test_compile_dropped_with_a_note_when_the_planner_chooses_tp():
    """runtime/parallel/compile.py: tensor-parallel blocks do not compile yet; an auto tp > 1 turns compile off,
    said."""
    resolved, result = resolve_job(job(train={"compile": True}, parallel={"pp": 1, "dp": 2}))
    assert resolved.parallel.tp > 1, "the test needs a layout with tensor parallel"
    assert resolved.train.compile is False
    assert any(note.startswith("train.compile set to false") for note in result.notes)
    kept, _ = resolve_job(job(train={"compile": True}, parallel={"tp": 1, "pp": 1}))
    assert kept.train.compile is True


def test_sequence_parallel_dropped_when_tp_is_one():
    resolved, result = resolve_job(job(model={"preset": "tiny"}, parallel={"tp": 1, "sequence_parallel": False},
                                       cluster={"nodes": 1, "gpus_per_node": 2, "node": None}))
    assert resolved.parallel.sequence_parallel is False


def test_expert_parallel_degree_limits_dp_and_passes_through():
    """A fixed parallel.ep is never searched: only layouts whose dp x cp x tp it divides are tried (cp folds into the
    experts' grouping, runtime/parallel/expert.py), and the resolved job keeps it."""
    moe_job = job(model={"preset": "mixtral-8x7b"}, parallel={"ep": 8}, train={"global_batch": 64})
    resolved, result = resolve_job(moe_job)
    assert result.layouts and all((lay.dp * lay.cp * lay.tp) % 8 == 0 for lay in result.layouts)
    assert any(lay.cp > 1 and lay.dp % 8 for lay in result.layouts)  # ep over dp x cp
    assert result.rejected.counts.get("ep_does_not_divide_dp", 0) > 0  # dp x cp 4, 2, 1 of the 16 GPUs
    p = resolved.parallel
    assert p.ep == 8 and (p.dp * p.cp * p.tp) % 8 == 0


def test_a_dense_plan_loads_neither_the_moe_section_nor_pydantics_plugin_finder(tmp_path) -> None:
    """The MoE section's module is built on first use (config/lazy.py); a dense job's plan must not import it:
    loaded after the schema's models, it makes pydantic read every distribution's entry points (~25 ms of `plan`).
    Nor tabulate: the report's tables are plan.report.simple_table (its import reads importlib.metadata, ~20 ms)."""
    import subprocess
    import sys

    job = tmp_path / "dense.yaml"
    job.write_text("name: dense\nmodel: {preset: gpt3-175b}\ntrain: {global_batch: 1536}\n"
                   "cluster: {nodes: 48, gpus_per_node: 8, gpu: a100-80gb, node: dgx-a100, fabric: ib-hdr200}\n")
    probe = ("import sys\nfrom hpctrain.cli import main\nrc = main(['plan', sys.argv[1]])\n"
             "print(sorted(m for m in ('hpctrain.config.moe', 'pydantic.plugin._loader', 'torch', 'tabulate')\n"
             "             if m in sys.modules))\n"
             "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(job)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "mem GiB" in proc.stdout and "memory of pp rank" in proc.stdout  # both tables printed
