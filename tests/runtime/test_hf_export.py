"""`hpctrain export` (issue 15 item 2) and the init_from start through the runtime entry point.

One real run (2 processes, pp=2, tied embeddings: the checkpoint holds the embedding twice) starts from
a transformers-saved Llama folder, trains 2 steps and checkpoints; the export of that checkpoint loads in
transformers' LlamaForCausalLM with the runtime's logits (within 1e-4), unsharded and sharded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hpctrain.cli import main as cli_main

from ._entry import REPO, run_entry
from ._hf import hf_job_dict, hf_logits, saved_models, tokens

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("export")
    folder = saved_models(str(tmp_path_factory.getbasetemp() / "hf-models"))["tied"]
    job = hf_job_dict(folder, pp=2, steps=2, log_every=1)
    job["checkpoint"] = {"every_steps": 2, "keep_last": 2}
    run_dir = str(root / "run")
    assert run_entry(job, run_dir) == [0, 0]
    return {"base": folder, "run": run_dir, "root": str(root)}


def _runtime_logits(run_dir: str, checkpoint: str, batch: torch.Tensor) -> torch.Tensor:
    """The trained weights as the runtime computes with them: one process, loaded straight from DCP."""
    import torch.distributed.checkpoint as dcp

    from hpctrain.config import load_job
    from hpctrain.runtime.parallel.build import build_training

    job = load_job(os.path.join(run_dir, "job.resolved.yaml"), ["parallel.pp=1", "cluster.gpus_per_node=1"])
    part = build_training(job, torch.device("cpu")).model_parts[0]
    state = {"model": part.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    part.load_state_dict(state["model"])
    part.eval()
    with torch.no_grad():
        return part(batch)


def _export(trained: dict[str, str], out: str, *extra: str) -> int:
    return cli_main(["export", trained["run"], "-o", out, *extra])


def test_export_round_trip_matches_runtime_logits(trained, tmp_path, capsys) -> None:
    from hpctrain.runtime.model.hf_weights import iter_hf_tensors

    out = str(tmp_path / "hf")
    assert _export(trained, out) == 0
    assert "exported step-2" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    batch = tokens()
    checkpoint = os.path.join(trained["run"], "checkpoints", "step-2")
    want = _runtime_logits(trained["run"], checkpoint, batch)
    got = hf_logits(out, batch)
    assert (got - want).abs().max().item() <= LOGIT_TOL
    # The run started from the folder's weights (the entry point's init_from), then trained: close, not equal.
    exported, base = dict(iter_hf_tensors(out)), dict(iter_hf_tensors(trained["base"]))
    assert "lm_head.weight" not in exported  # tied: written once, as transformers does
    moved = max((exported[k] - base[k]).abs().max().item() for k in base)
    assert 0 < moved < 0.05, moved
    events = [json.loads(line) for line in open(os.path.join(trained["run"], "events.jsonl"))]
    loaded = [e for e in events if e["event"] == "weights loaded"]
    assert len(loaded) == 1 and loaded[0]["bytes_read"] > 0


def test_sharded_export_has_an_index_and_equal_weights(trained, tmp_path) -> None:
    from hpctrain.runtime.model.hf_weights import iter_hf_tensors

    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    assert _export(trained, one) == 0
    limit = 40_000  # bytes; the largest tensor (the embedding, 32 kB in fp32) fits in one shard
    assert _export(trained, many, "--max-shard-size", str(limit), "--step", "2") == 0
    files = sorted(f for f in os.listdir(many) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(os.path.join(many, f)) <= limit + 4096 for f in files)  # + the file's header
    index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(files)
    a, b = dict(iter_hf_tensors(one)), dict(iter_hf_tensors(many))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    batch = tokens()
    assert (hf_logits(many, batch) - hf_logits(one, batch)).abs().max().item() == 0.0


def test_export_bad_input_is_one_line_exit_2(trained, tmp_path, capsys) -> None:
    cases = [
        ([str(tmp_path / "nope"), "-o", str(tmp_path / "o1")], "RUN: no run directory"),
        ([trained["run"], "-o", str(tmp_path / "o2"), "--step", "7"],
         "--step: got 7; " + os.path.join(trained["run"], "checkpoints") + " has complete checkpoints at steps 2"),
        ([trained["run"], "-o", trained["root"]], f"-o {trained['root']}: exists and is not an empty folder"),
        ([trained["run"], "-o", str(tmp_path / "o3"), "--max-shard-size", "lots"], "--max-shard-size: got 'lots'"),
    ]
    for argv, start in cases:
        assert cli_main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
    empty = tmp_path / "fresh-run"
    empty.mkdir()
    (empty / "events.jsonl").write_text("")
    (empty / "job.resolved.yaml").write_text(open(os.path.join(trained["run"], "job.resolved.yaml")).read())
    assert cli_main(["export", str(empty), "-o", str(tmp_path / "o4")]) == 2
    assert capsys.readouterr().err.startswith(f"RUN: no complete checkpoint in {empty / 'checkpoints'}")


def test_login_path_stays_torch_free(trained, tmp_path) -> None:
    """`validate` of an init_from job reads config.json without torch; `export` rejects bad input before
    importing it (one process for both: a fresh interpreter costs a second or two)."""
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(hf_job_dict(trained["base"])))
    code = ("import sys\nfrom hpctrain.cli import main\n"
            f"assert main(['validate', {str(job)!r}]) == 0\n"
            f"rc = main(['export', {str(tmp_path / 'missing')!r}, '-o', {str(tmp_path / 'o')!r}])\n"
            "assert 'torch' not in sys.modules, 'torch imported on the login path'\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "valid (job 'hf-test'" in proc.stdout


def test_export_of_a_run_from_scratch_carries_the_data_tokenizer_and_eos(tmp_path) -> None:
    """issue 29: a tokenizer trained by `data tokenizer-train` on local text, data prepared with it, a short
    local run (`submit --wait`, from another folder than the job file's, which names the data relative to
    itself), `export`: the folder loads in transformers with that tokenizer and its EOS id, and export's
    stderr carries no torch UserWarning."""
    import tokenizers
    import transformers
    import yaml

    proj, elsewhere, out = tmp_path / "proj", tmp_path / "elsewhere", tmp_path / "hf"
    (proj / "data").mkdir(parents=True)
    elsewhere.mkdir()
    texts = [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "architecture.md")]
    tok = str(proj / "tok.json")
    assert cli_main(["data", "tokenizer-train", *texts, "-o", tok, "--vocab-size", "320"]) == 0
    assert cli_main(["data", "prepare", *texts, "-o", str(proj / "data" / "d.bin"), "--tokenizer", tok]) == 0
    eos_id = json.loads((proj / "data" / "d.bin.json").read_text())["eos_id"]
    job = {"name": "scratch", "model": {"preset": "tiny", "vocab": 320},
           "train": {"data": "data/d.bin", "global_batch": 2, "micro_batch": 1, "steps": 2, "precision": "fp32",
                     "activation_checkpointing": "none", "lr_schedule": {"warmup_steps": 0}},
           "parallel": {"tp": 1, "pp": 1},
           "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": "cpu", "fabric": "ethernet"},
           "checkpoint": {"every_steps": 2}}
    (proj / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=os.path.dirname(sys.executable), OMP_NUM_THREADS="1")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=180)

    run = cli("submit", str(proj / "job.yaml"), "--wait", "--timeout", "150")
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = next((elsewhere / "runs").iterdir())
    assert yaml.safe_load((run_dir / "job.resolved.yaml").read_text())["train"]["data"] == str(proj / "data" / "d.bin")
    exported = cli("export", str(run_dir), "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    assert "UserWarning" not in exported.stderr and "Warning" not in exported.stderr, exported.stderr
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(out))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos_id
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "hpctrain plans the layout, renders the script and submits it."
    assert loaded.eos_token_id == eos_id and loaded.eos_token == "<|endoftext|>"
    assert loaded(text)["input_ids"] == tokenizers.Tokenizer.from_file(tok).encode(text).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos_id
    with torch.no_grad():
        logits = model(torch.tensor([loaded(text)["input_ids"]])).logits
    assert logits.shape[-1] == 320 and torch.isfinite(logits).all()
