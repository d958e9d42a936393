"""`hpctrain export --lora-format merged|peft` (issue 15 item 3): a LoRA run started from a
transformers-saved Llama folder trains 2 steps; the merged export loads in transformers and the PEFT
folder loads with peft on that base, both with the runtime's logits (within 1e-4)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpctrain.cli import main as cli_main

from ._entry import make_job, run_entry
from ._hf import hf_job_dict, hf_logits, saved_models, tokens

LOGIT_TOL = 1e-4
LORA = {"rank": 4, "alpha": 16.0, "targets": ["q_proj", "v_proj", "wo", "w1", "w2"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-export")
    folder = saved_models(str(tmp_path_factory.getbasetemp() / "hf-models"))["untied"]
    # AdamW at a high rate: the adapters (B starts at 0) move far enough that a wrong fold shows.
    job = hf_job_dict(folder, steps=2, log_every=1, lora=LORA, optimizer={"name": "adamw", "lr": 0.05})
    job["checkpoint"] = {"every_steps": 2, "keep_last": 1}
    run_dir = str(root / "run")
    assert run_entry(job, run_dir) == [0]
    return {"base": folder, "run": run_dir}


def _runtime_logits(run_dir: str, batch: torch.Tensor, init_from: bool = True) -> torch.Tensor:
    """The base (init_from, or the seed's draw) plus the adapters of step 2, as the runtime computes."""
    import torch.distributed.checkpoint as dcp

    from hpctrain.config import load_job
    from hpctrain.runtime.parallel.build import build_training

    training = build_training(load_job(os.path.join(run_dir, "job.resolved.yaml")), torch.device("cpu"))
    if init_from:
        from hpctrain.runtime.model.hf_weights import load_init_from

        load_init_from(training)
    part = training.model_parts[0]
    state = {"model": {k: v for k, v in part.state_dict().items() if ".lora_" in k}}
    dcp.load(state, checkpoint_id=os.path.join(run_dir, "checkpoints", "step-2"))
    assert not part.load_state_dict(state["model"], strict=False).unexpected_keys
    assert max(p.abs().max() for n, p in part.named_parameters() if n.endswith("lora_B")) > 1e-3  # trained
    part.eval()
    with torch.no_grad():
        return part(batch)


def test_merged_export_loads_in_transformers(trained, tmp_path) -> None:
    out = str(tmp_path / "merged")
    assert cli_main(["export", trained["run"], "-o", out, "--lora-format", "merged"]) == 0
    batch = tokens()
    want = _runtime_logits(trained["run"], batch)
    assert (hf_logits(out, batch) - want).abs().max().item() <= LOGIT_TOL
    assert (hf_logits(trained["base"], batch) - want).abs().max().item() > 100 * LOGIT_TOL  # the adapters count


def test_peft_folder_loads_with_peft(trained, tmp_path) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "peft")
    assert cli_main(["export", trained["run"], "-o", out, "--lora-format", "peft"]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["target_modules"] == ["down_proj", "gate_proj", "o_proj", "q_proj", "v_proj"]
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == os.path.abspath(trained["base"])
    with safe_open(os.path.join(out, "adapter_model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").get_shape() == [4, 64]
    base = LlamaForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    model.eval()
    batch = tokens()
    with torch.no_grad():
        got = model(batch).logits
    assert (got - _runtime_logits(trained["run"], batch)).abs().max().item() <= LOGIT_TOL


def test_seed_base_exports_merged_and_peft_with_its_base(tmp_path) -> None:
    """Without init_from the frozen base is the seed's draw (on the CPU here, as the run's ranks drew
    it): merged and PEFT (with DIR/base) give the runtime's logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    job = make_job(train={"steps": 2, "lora": {**LORA, "targets": ["wq", "w3"]},
                          "optimizer": {"name": "adamw", "lr": 0.05}}, checkpoint={"every_steps": 2, "keep_last": 1})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [0]
    batch = tokens(vocab=256)
    want = _runtime_logits(run, batch, init_from=False)
    assert cli_main(["export", run, "-o", str(tmp_path / "merged")]) == 0  # merged is the default
    assert (hf_logits(str(tmp_path / "merged"), batch) - want).abs().max().item() <= LOGIT_TOL
    out = str(tmp_path / "peft")
    assert cli_main(["export", run, "-o", out, "--lora-format", "peft"]) == 0
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["base_model_name_or_path"] == os.path.join(out, "base")
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(os.path.join(out, "base"),
                                                                       dtype=torch.float32), out)
    model.eval()
    with torch.no_grad():
        assert (model(batch).logits - want).abs().max().item() <= LOGIT_TOL


def test_lora_format_on_a_full_run_is_one_line_exit_2(trained, tmp_path, capsys) -> None:
    import shutil

    import yaml

    run = shutil.copytree(trained["run"], str(tmp_path / "full"))
    resolved = os.path.join(run, "job.resolved.yaml")
    data = yaml.safe_load(open(resolved))
    data["train"]["lora"] = None
    yaml.safe_dump(data, open(resolved, "w"))
    assert cli_main(["export", run, "-o", str(tmp_path / "x"), "--lora-format", "peft"]) == 2
    err = capsys.readouterr().err
    assert "--lora-format" in err and "train.lora" in err and len(err.strip().splitlines()) == 1
