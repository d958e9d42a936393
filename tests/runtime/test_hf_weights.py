"""`model.init_from` (issue 15 item 1): Hugging Face Llama weights load into every layout with the
logits of transformers' LlamaForCausalLM (fp32, within 1e-4), each rank reading only its shards.

Reference: the real `transformers` LlamaForCausalLM on the same saved folder (GQA untied, tied, and
Llama 3 RoPE scaling). The layouts of one world size share one process group (one launch each).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpctrain.config import job_from_dict

from ._dist import run_distributed
from ._hf import VARIANTS, hf_job_dict, hf_logits, local_bytes, runtime_logits, save_llama, saved_models, tokens

LOGIT_TOL = 1e-4
# (variant, (tp, pp, dp)): the acceptance layouts; tied and llama3 ride along on some of them.
LAYOUTS: dict[int, list[tuple[str, tuple[int, int, int]]]] = {
    2: [("untied", (2, 1, 1)), ("tied", (1, 2, 1)), ("llama3", (1, 1, 2))],
    8: [("untied", (2, 2, 2)), ("tied", (2, 2, 2))],
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, str]:
    return saved_models(str(tmp_path_factory.getbasetemp() / "hf-models"))


def _build(folder: str, layout: tuple[int, int, int]) -> Any:
    from hpctrain.runtime.model.hf_weights import load_init_from
    from hpctrain.runtime.parallel.build import build_training

    # As the runtime starts (Trainer): built without the seed's draw, then filled from the folder.
    training = build_training(job_from_dict(hf_job_dict(folder, *layout)), torch.device("cpu"), initialise=False)
    read = load_init_from(training)
    return training, read


def layout_logits(cases: list[tuple[str, tuple[int, int, int]]], batch: torch.Tensor) -> list[dict[str, Any]]:
    """On each rank: per case, the logits (last stage) and bytes read vs bytes held."""
    out = []
    for folder, layout in cases:
        training, read = _build(folder, layout)
        held = local_bytes(training)  # before the forward: FSDP's root keeps its parameters gathered after it
        out.append({"logits": runtime_logits(training, batch), "read": read["bytes_read"], "held": held})
    return out


def test_name_mapping_covers_transformers_state_dict(hf_models) -> None:
    from safetensors import safe_open

    from hpctrain.runtime.model.hf_weights import from_hf_name, to_hf_name
    from hpctrain.runtime.model.transformer import ModelArgs, build_model

    job = job_from_dict(hf_job_dict(hf_models["untied"]))
    ours = [name for name, _ in build_model(ModelArgs.from_config(job.model)).named_parameters()]
    with safe_open(f"{hf_models['untied']}/model.safetensors", framework="pt") as handle:
        theirs = set(handle.keys())
    assert {to_hf_name(n) for n in ours} == theirs
    assert [from_hf_name(to_hf_name(n)) for n in ours] == ours
    with pytest.raises(KeyError):
        to_hf_name("layers.0.attention.wq.bias")


def test_config_json_fills_the_model_section(hf_models) -> None:
    model = job_from_dict(hf_job_dict(hf_models["llama3"])).model
    assert (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab) == (
        2, 64, 4, 2, 96, 128)
    assert model.rope_theta == 500.0 and model.rope_scaling is not None and model.rope_scaling.factor == 8.0
    assert job_from_dict(hf_job_dict(hf_models["tied"])).model.tie_embeddings is True


def test_llama3_rope_matches_transformers(hf_models) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hpctrain.runtime.model.transformer import ModelArgs, rope_inv_freq

    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_pretrained(hf_models["llama3"]), torch.device("cpu"))
    args = ModelArgs.from_config(job_from_dict(hf_job_dict(hf_models["llama3"])).model)
    ours = rope_inv_freq(args)
    plain = rope_inv_freq(ModelArgs(**{**args.__dict__, "rope_scaling": None}))
    assert not torch.allclose(ours, plain), "the scaling must change some frequencies to be tested"
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)


def test_exported_config_reads_back_in_transformers(hf_models, tmp_path) -> None:
    """The config.json export writes (transformers 4 spelling) gives transformers 5 the same model and
    RoPE, and init_from reads it back to the same `model:` section."""
    import json

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hpctrain.config.hf_config import read_hf_config
    from hpctrain.runtime.model.hf_weights import hf_config_dict
    from hpctrain.runtime.model.transformer import ModelArgs, rope_inv_freq

    model = job_from_dict(hf_job_dict(hf_models["llama3"])).model
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(model)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_pretrained(str(tmp_path)), torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(ModelArgs.from_config(model)).float(), theirs.float(), rtol=1e-6, atol=0)
    fields = read_hf_config(str(tmp_path)).fields
    assert all(fields[k] == (v.model_dump() if k == "rope_scaling" else v)
               for k, v in model if k in fields), fields


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_process_logits_match_transformers(hf_models, variant: str) -> None:
    batch = tokens()
    training, read = _build(hf_models[variant], (1, 1, 1))
    assert read["bytes_read"] == local_bytes(training)
    got = runtime_logits(training, batch)
    diff = (got - hf_logits(hf_models[variant], batch)).abs().max().item()
    assert diff <= LOGIT_TOL, f"{variant}: max |dlogit| = {diff:.2e}"


def test_lora_base_loads_and_adapters_stay(hf_models) -> None:
    """Under LoRA the folder fills the frozen base; the adapters keep PEFT's init (B = 0), so the model
    starts at transformers' logits."""
    from hpctrain.runtime.model.hf_weights import load_init_from
    from hpctrain.runtime.parallel.build import build_training

    data = hf_job_dict(hf_models["untied"])
    data["train"]["lora"] = {"rank": 4, "alpha": 8, "targets": ["wq", "w2"]}
    seeded = build_training(job_from_dict(data), torch.device("cpu")).model_parts[0].layers["0"].attention.wq
    training = build_training(job_from_dict(data), torch.device("cpu"), initialise=False)
    load_init_from(training)
    wq = training.model_parts[0].layers["0"].attention.wq
    assert torch.equal(wq.lora_A, seeded.lora_A) and wq.lora_A.abs().sum() > 0 and not wq.lora_B.any()
    batch = tokens()
    diff = (runtime_logits(training, batch) - hf_logits(hf_models["untied"], batch)).abs().max().item()
    assert diff <= LOGIT_TOL


def test_sharded_folder_loads(hf_models, tmp_path) -> None:
    """A folder saved in several safetensors files with an index (as large checkpoints are published)."""
    folder = save_llama(str(tmp_path / "sharded"), seed=1, max_shard_size="40KB", **VARIANTS["tied"])
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    batch = tokens()
    training, _ = _build(folder, (1, 1, 1))
    diff = (runtime_logits(training, batch) - hf_logits(folder, batch)).abs().max().item()
    assert diff <= LOGIT_TOL


def test_mismatched_shape_is_one_line(hf_models) -> None:
    from hpctrain.errors import ConfigError

    data = hf_job_dict(hf_models["untied"])
    data["model"]["kv_heads"] = 4
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    assert str(info.value).splitlines() == [
        "<dict>:1: model.kv_heads: differs from init_from's config.json (2) (got 4); remove model.kv_heads "
        "(it comes from config.json) or use the folder's value"]


@pytest.mark.dist
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_logits_match_transformers(hf_models, world_size: int) -> None:
    batch = tokens()
    cases = [(hf_models[variant], layout) for variant, layout in LAYOUTS[world_size]]
    results = run_distributed(layout_logits, world_size, cases, batch, timeout_s=240)
    for i, (variant, layout) in enumerate(LAYOUTS[world_size]):
        want = hf_logits(hf_models[variant], batch)
        got = [rank[i]["logits"] for rank in results if rank[i]["logits"] is not None]
        assert len(got) == world_size // layout[1], f"{variant} {layout}: logits on every last-stage rank"
        diff = max((g - want).abs().max().item() for g in got)
        assert diff <= LOGIT_TOL, f"{variant} {layout}: max |dlogit| = {diff:.2e}"
        for rank in results:  # each rank read exactly the bytes of the shards it holds
            assert rank[i]["read"] == rank[i]["held"], f"{variant} {layout}: {rank[i]}"
        print(f"[hf] {variant} tp,pp,dp={layout}: max |dlogit| = {diff:.2e}")
