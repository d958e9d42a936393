"""`hpctrain plan` and `hpctrain topo` end to end (argparse, handlers, exit codes, output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain import cli

ROOT = Path(__file__).resolve().parents[2]
TOPO = Path(__file__).parent / "data" / "topo"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_gpt3_prints_table_walls_and_reasons(capsys):
    code, out, err = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml"), "--top", "3"], capsys)
    assert code == 0, err
    assert "tokens/s" in out and "MFU" in out
    for wall in ("memory wall:", "compute wall:", "communication wall:"):
        assert wall in out
    assert "rejected:" in out and "memory over budget" in out
    families = [line for line in out.splitlines() if line.startswith("  tp=")]
    assert families and all(("fits" in line) or ("rejected, " in line) for line in families)


def test_plan_counts_add_up(capsys):
    """Every evaluated candidate either fits or is over the memory budget; the other rejections are
    counted in their own units (families, pipeline splits, micro-batch sizes) and say so."""
    import re

    code, out, err = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml")], capsys)
    assert code == 0, err
    fit, evaluated, over = map(int, re.search(r"(\d+) of (\d+) candidates fit in [\d.]+ GiB \((\d+) over it\)",
                                              out).groups())
    listed = re.search(r"^\s+(\d+) candidates: memory over budget", out, re.M)
    assert listed and int(listed.group(1)) == over
    # full recomputation is dropped where selective fits the same layout (issue 13 item 3)
    dominated = re.search(r"^\s+(\d+) candidates: full recomputation where selective", out, re.M)
    assert dominated and int(dominated.group(1)) > 0
    assert fit + over + int(dominated.group(1)) == evaluated and over > 0
    rejected = out.split("rejected:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert rejected and all(re.match(r"\s+\d+ (candidates|\(tp, pp\) families|pipeline splits|micro-batch sizes): ",
                                     line) for line in rejected), rejected


def test_plan_json(capsys):
    code, out, _ = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml"), "--json", "--top", "2",
                        "--set", "train.micro_batch=1"], capsys)
    assert code == 0
    data = json.loads(out)
    assert len(data["layouts"]) == 2 and all(lay["micro_batch"] == 1 for lay in data["layouts"])
    assert data["placement"]["stage_layers"]


def test_plan_nothing_fits_is_one_error_block_exit_2(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: big\nmodel: {preset: llama3-70b}\nparallel: {tp: 1, pp: 1}\n"
                   "cluster: {nodes: 1, gpus_per_node: 1, gpu: a100-40gb}\n")
    code, out, err = run(["plan", str(job)], capsys)
    assert code == 2 and "Traceback" not in err and "no layout" in err and "memory over budget" in err


def test_plan_unknown_gpu_did_you_mean(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: tiny}\ncluster: {gpu: h100-80g}\n")
    code, _, err = run(["plan", str(job)], capsys)
    assert code == 2 and "did you mean 'h100-80gb'" in err


def test_plan_with_topology_files(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nmodel: {{preset: llama3-8b}}\ntrain: {{global_batch: 64}}\n"
                   f"cluster: {{nodes: 2, gpus_per_node: 8, gpu: a100-80gb, topology: "
                   f"{{nvidia_smi: {TOPO / 'pcie-nvlink-pairs.txt'}, slurm_topology: {TOPO / 'tree.conf'}}}}}\n")
    code, out, err = run(["plan", str(job), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["cluster"]["nvlink_island_gpus"] == 2
    assert all(lay["tp"] <= 2 for lay in data["layouts"])
    assert data["placement"]["switches"] == 1


def test_topo_prints_islands_and_leaves(capsys):
    code, out, _ = run(["topo", str(TOPO / "dgx1-v100.txt"), str(TOPO / "tree.conf")], capsys)
    assert code == 0
    assert "[0 1 2 3], [4 5 6 7]" in out and "3 leaf switches" in out


def test_topo_bad_file_exit_2(tmp_path, capsys):
    bad = tmp_path / "topology.conf"
    bad.write_text("SwitchName=s1\n")
    code, _, err = run(["topo", str(bad), str(tmp_path / "missing")], capsys)
    assert code == 2 and "neither Nodes=" in err and "cannot read" in err


def test_plan_as_a_command_line_ends_at_once_with_all_its_output(capsys):
    """`hpctrain plan` ends without the interpreter's teardown (cli/main.py's exit_now, its collector off to the
    end): everything it prints is out, as from main() called in process, and the exit code is 0."""
    argv = ["plan", str(ROOT / "examples" / "gpt3-175b.yaml"), "--json", "--top", "40"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    done = subprocess.run([sys.executable, "-m", "hpctrain", *argv], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    here, there = json.loads(out), json.loads(done.stdout)
    here.pop("search_time_s"), there.pop("search_time_s")
    assert here == there and len(there["layouts"]) == 40


def test_planner_never_imports_torch():
    code = ("import sys; from hpctrain.config import load_job; from hpctrain.plan import resolve_job; "
            f"resolve_job(load_job({str(ROOT / 'examples' / 'gpt3-175b.yaml')!r})); "
            "from hpctrain.plan import report; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_top_must_be_positive(bad, capsys):
    code, _, err = run(["plan", str(ROOT / "examples" / "quickstart.yaml"), "--top", bad], capsys)
    assert code == 2 and "--top" in err


def test_workers_must_not_be_negative_and_do_not_change_the_plan(capsys, monkeypatch):
    import hpctrain.plan.split_search as split_module

    code, _, err = run(["plan", str(ROOT / "examples" / "quickstart.yaml"), "--workers", "-1"], capsys)
    assert code == 2 and "--workers" in err and "Traceback" not in err
    monkeypatch.setattr(split_module, "MIN_SPLIT_CANDIDATES", 0)  # split even this small search
    outs = []
    for workers in ("1", "2", "0"):
        code, out, _ = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml"), "--json", "--top", "50",
                            "--workers", workers], capsys)
        assert code == 0
        data = json.loads(out)
        data.pop("search_time_s")
        outs.append(data)
    assert outs[0] == outs[1] == outs[2] and len(outs[0]["layouts"]) == 50


def test_plan_explains_the_runner_up_and_labels_what_it_counts(capsys, tmp_path):
    """issue 29: the report says why #1 beats #2 (the step-time parts that differ) and #2's memory, says
    that TFLOP/s counts recomputation, and abbreviates a many-stage placement."""
    import re

    code, out, err = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml"), "--json"], capsys)
    layouts = json.loads(out)["layouts"]
    code, out, err = run(["plan", str(ROOT / "examples" / "gpt3-175b.yaml")], capsys)
    assert code == 0, err
    second = layouts[1]
    why = re.search(r"^#1 over #2 \((tp=\d+ pp=\d+ dp=\d+ [^)]*)\): #2 reaches ([\d.]+)% of #1's tokens/s, its step "
                    r"([\d.]+) s longer \(([^)]+)\); #2 needs ([\d.]+) GiB on pp rank \d+ \(#1 ([\d.]+) GiB of 80.0\)$",
                    out, re.M)
    assert why, out
    assert why.group(1).startswith(f"tp={second['tp']} pp={second['pp']} dp={second['dp']} mb={second['micro_batch']}")
    assert float(why.group(2)) == pytest.approx(100 * second["tokens_per_s"] / layouts[0]["tokens_per_s"], abs=0.006)
    assert float(why.group(5)) == pytest.approx(second["memory_gib"]["total"], abs=0.06)
    assert float(why.group(6)) == pytest.approx(layouts[0]["memory_gib"]["total"], abs=0.06)
    assert "TFLOP/s/GPU counts the FLOPs the GPUs run, activation recomputation (ac) included" in out
    deep = tmp_path / "gpt3-175b-pp16.yaml"  # a many-stage layout: pipeline fixed at 16 stages
    deep.write_text((ROOT / "examples" / "gpt3-175b.yaml").read_text().replace("  pp: auto", "  pp: 16"))
    code, out, err = run(["plan", str(deep), "--json"], capsys)
    stages = len(json.loads(out)["layouts"][0]["stage_layers"])
    code, out, err = run(["plan", str(deep)], capsys)
    assert stages >= 16 and f"placement: stages {stages} stages over layers 0-95: " in out and "[[0, 1]" not in out
    code, out, err = run(["plan", str(ROOT / "examples" / "llama3-8b-sweep.yaml")], capsys)
    assert "TFLOP/s per GPU (attention recomputation included)" in out  # its layout recomputes (ac selective)


def test_plan_on_cpu_claims_no_nvlink_and_no_fabric(capsys):
    code, out, err = run(["plan", str(ROOT / "examples" / "quickstart.yaml")], capsys)
    assert code == 0, err
    header = out.splitlines()[0]
    assert "(1 nodes x 2 CPU processes, gloo)" in header and "NVLink" not in header and "ib-" not in header
    code, out, err = run(["plan", str(ROOT / "examples" / "quickstart.yaml"), "--set", "cluster.nodes=2",
                          "--set", "parallel.dp=auto"], capsys)
    assert "(2 nodes x 2 CPU processes, gloo; between nodes modelled as ib-hdr200)" in out.splitlines()[0]
