"""`model.init_from` at validate time (issue 15 item 1): config.json read as JSON, one line per problem.

Table-driven over hand-written config.json files (no torch, no transformers): both spellings of the
RoPE settings, the fields a job leaves out filled, each unusable folder named with its fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError

# transformers 4's spelling (most published checkpoints): rope_theta and rope_scaling at the top level.
LLAMA31_V4 = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # init_from "hf", relative: short enough to show whole in the messages


def _folder(tmp_path: Path, config: dict[str, Any] | None, weights: bool = True) -> str:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return "hf"


def _job(folder: str, **model: Any) -> dict[str, Any]:
    return {"name": "x", "model": {"init_from": folder, "seq_len": 16, **model}}


def test_v4_spelling_fills_every_field(tmp_path) -> None:
    m = job_from_dict(_job(_folder(tmp_path, LLAMA31_V4))).model
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab) == (2, 64, 4, 2, 96, 128)
    assert m.tie_embeddings and m.rope_theta == 500000.0 and m.norm_eps == 1e-5 and m.seq_len == 16
    assert m.rope_scaling is not None and m.rope_scaling.model_dump() == LLAMA31_V4["rope_scaling"]


def test_v5_spelling_and_agreeing_fields(tmp_path) -> None:
    v5 = {k: v for k, v in LLAMA31_V4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    m = job_from_dict(_job(_folder(tmp_path, v5), hidden=64, tie_embeddings=True)).model
    assert m.rope_theta == 10000.0 and m.rope_scaling is None


def _lines(tmp_path: Path, config: dict[str, Any] | None, weights: bool = True, **model: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        job_from_dict(_job(_folder(tmp_path, config, weights), **model))
    return str(info.value).splitlines()


FIX = "; give a folder written by transformers' save_pretrained"
CASES = [
    ("no config", None, True, {}, "model.init_from: no config.json in the folder (got '{f}')" + FIX),
    ("no weights", LLAMA31_V4, False, {},
     "model.init_from: no model.safetensors or model.safetensors.index.json in the folder (only safetensors "
     "weights are read) (got '{f}')" + FIX),
    ("gpt2", {**LLAMA31_V4, "model_type": "gpt2"}, True, {},
     "model.init_from: config.json has model_type 'gpt2'; supported: llama, mistral, qwen3, mixtral, qwen3_moe "
     "(Llama-architecture decoders and their MoE) (got '{f}')" + FIX),
    ("yarn", {**LLAMA31_V4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, True, {},
     "model.init_from: config.json uses RoPE scaling 'yarn'; supported: none or 'llama3' (got '{f}')" + FIX),
    ("bias", {**LLAMA31_V4, "attention_bias": True}, True, {},
     "model.init_from: config.json has attention_bias: true; the runtime's projections have no biases "
     "(got '{f}')" + FIX),
    ("sparse layers", {**LLAMA31_V4, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 8, "mlp_only_layers": [1]}, True, {},
     "model.init_from: config.json has mlp_only_layers [1]; supported: the first N layers ([0, 1, ..., N-1]) "
     "(got '{f}')" + FIX),
    ("differs", LLAMA31_V4, True, {"layers": 3},
     "model.layers: differs from init_from's config.json (2) (got 3); remove model.layers (it comes from "
     "config.json) or use the folder's value"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unusable_folder_is_one_line(tmp_path, case) -> None:
    _, config, weights, model, expected = case
    assert _lines(tmp_path, config, weights, **model) == ["<dict>:1: " + expected.format(f="hf")]


def test_head_dim_of_its_own_is_taken(tmp_path) -> None:
    model = job_from_dict(_job(_folder(tmp_path, {**LLAMA31_V4, "head_dim": 32}))).model
    assert (model.head_dim, model.hidden // model.heads, model.qk_norm, model.moe) == (32, 16, False, None)


def test_missing_folder_and_seq_len(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"model\.init_from: no such folder"):
        job_from_dict(_job("absent"))
    data = _job(_folder(tmp_path, LLAMA31_V4))
    del data["model"]["seq_len"]
    with pytest.raises(ConfigError) as info:
        job_from_dict(data)
    assert str(info.value).splitlines() == [
        "<dict>:1: model.seq_len: is required with model.init_from (config.json's max_position_embeddings is 64) "
        "(got None); set model.seq_len, the training sequence length"]


def test_preset_is_checked_field_by_field(tmp_path) -> None:
    lines = _lines(tmp_path, LLAMA31_V4, preset="llama3-1b")
    assert lines[0].startswith("<dict>:1: model.layers: differs from init_from's config.json (2) (got 16)")
    assert any(line.startswith("<dict>:1: model.hidden: differs") for line in lines)
    assert not any("model.tie_embeddings" in line or "rope_theta" in line for line in lines)  # those agree


def _cli(args: list[str], capsys) -> tuple[int, list[str]]:
    from hpctrain.cli.main import main

    code = main(args)
    return code, capsys.readouterr().err.strip().splitlines()


BOUNDS = [  # (config.json change, the words of the one line): the schema's bounds hold for config.json too
    ({"num_hidden_layers": 10**12}, "config.json's num_hidden_layers (model.layers) must be at most 4096 "
     "(got 1000000000000)"),
    ({"vocab_size": 10**18}, "config.json's vocab_size (model.vocab) must be at most 16777216"),
    ({"intermediate_size": 2**63}, "config.json's intermediate_size (model.ffn_hidden) must be at most 1048576"),
    ({"rope_theta": float("inf")}, "config.json's rope_theta (model.rope_theta) is not a finite number"),
    ({"num_key_value_heads": "4"}, "config.json has no positive integer num_key_value_heads (got '4')"),
    ({"rope_scaling": {**LLAMA31_V4["rope_scaling"], "factor": 1e300}},
     "config.json's rope_scaling.factor (model.rope_scaling.factor) must be at most 1000000.0"),
]


@pytest.mark.parametrize("change, words", BOUNDS, ids=[next(iter(c)) for c, _ in BOUNDS])
def test_config_json_numbers_meet_the_schema_bounds(tmp_path, capsys, change, words) -> None:
    """Issue 30 Why 5: config.json's numbers bypassed the bounds (10**12 layers hung `plan`)."""
    _folder(tmp_path, {**LLAMA31_V4, **change})
    (tmp_path / "job.yaml").write_text("name: x\nmodel:\n  init_from: hf\n  seq_len: 16\n")
    for command in ("validate", "plan"):
        code, lines = _cli([command, "job.yaml"], capsys)
        assert code == 2 and len(lines) == 1 and words in lines[0], (command, lines)


def test_config_json_nested_deep_is_one_line(tmp_path, capsys) -> None:
    folder = tmp_path / _folder(tmp_path, LLAMA31_V4)
    (folder / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    (tmp_path / "job.yaml").write_text("name: x\nmodel:\n  init_from: hf\n  seq_len: 16\n")
    code, lines = _cli(["validate", "job.yaml"], capsys)
    assert code == 2 and len(lines) == 1 and "config.json is unreadable (nested too deep)" in lines[0], lines
