"""Issue 30 Why 6: `model.init_from`'s safetensors files are checked at `validate` and `submit` (headers read
without torch), and a file damaged after that is still bad input on the ranks (exit 2, not requeued).

The folders are real safetensors files (written by the safetensors package from numpy arrays), damaged
the ways a truncated download, a bad disk or a hostile index damages them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli.main import main

CONFIG = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 24, "vocab_size": 32, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}


def _tensors(vocab: int = 32) -> dict[str, np.ndarray]:
    h, hd, ffn = 16, 8, 24
    out = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,),
           "model.layers.0.self_attn.q_proj.weight": (2 * hd, h), "model.layers.0.self_attn.k_proj.weight": (hd, h),
           "model.layers.0.self_attn.v_proj.weight": (hd, h), "model.layers.0.self_attn.o_proj.weight": (h, 2 * hd),
           "model.layers.0.mlp.gate_proj.weight": (ffn, h), "model.layers.0.mlp.up_proj.weight": (ffn, h),
           "model.layers.0.mlp.down_proj.weight": (h, ffn), "model.layers.0.input_layernorm.weight": (h,),
           "model.layers.0.post_attention_layernorm.weight": (h,)}
    return {k: np.full(v, 0.01, dtype=np.float32) for k, v in out.items()}


def _folder(tmp_path: Path, tensors: dict[str, np.ndarray] | None = None) -> Path:
    from safetensors.numpy import save_file

    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors or _tensors(), str(folder / "model.safetensors"))
    return folder


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _header_length(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + path.read_bytes()[8:])


def _rewrite_header(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])


def _dtype(folder: Path) -> None:
    _rewrite_header(folder, lambda h: h["lm_head.weight"].update(dtype="F64"))  # twice the bytes it has


def _shape(folder: Path) -> None:
    _rewrite_header(folder, lambda h: h["model.norm.weight"].update(shape=[2**40, 2**40]))


def _other_model(folder: Path) -> None:
    _folder(folder.parent, _tensors(vocab=48))


def _escaping_index(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../../../../etc/passwd"}}))


DAMAGE = [
    (_truncate, "model.safetensors is truncated ("),
    (_header_length, f"model.safetensors has a header length of {2**62} bytes (at most 100000000): the file is damaged"),
    (_dtype, "model.safetensors: tensor 'lm_head.weight' (F64 [32, 16]) does not fit its data_offsets"),
    (_shape, "model.safetensors: tensor 'model.norm.weight' (F32 [1099511627776, 1099511627776]) does not fit"),
    (_other_model, ".weight has shape [48, 16] but config.json's model needs [32, 16]"),
    (_escaping_index, "model.safetensors.index.json maps 'model.embed_tokens.weight' to '../../../../etc/passwd', "
     "outside the folder"),
]


@pytest.mark.parametrize("damage, words", DAMAGE, ids=[d.__name__.strip("_") for d, _ in DAMAGE])
def test_damaged_weights_are_one_line_at_validate_and_submit(tmp_path, capsys, monkeypatch, damage, words) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _folder(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: w\nmodel:\n  init_from: hf\n  seq_len: 8\ntrain:\n  steps: 1\n  global_batch: 1\n"
                   f"cluster:\n  executor: local\n  gpus_per_node: 1\nruns_dir: {tmp_path / 'runs'}\n")
    assert main(["validate", str(job)]) == 0  # the intact folder is valid
    capsys.readouterr()
    damage(folder)
    for command in (["validate"], ["submit", "--dry-run"], ["sweep", "--dry-run", "--grid", "train.seed=1,2"]):
        code = main([*command, str(job)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and words in lines[0], (command, lines)
        assert len(lines) == (2 if command[0] == "sweep" else 1), lines  # the sweep: one line per point
    assert not (tmp_path / "runs").exists()  # nothing submitted, no run directory


def test_weights_damaged_after_submit_are_bad_input_on_the_rank(tmp_path) -> None:
    """The rank's reader: a file truncated after the login-node check is a ConfigError (exit 2 in
    runtime/__main__.py, not requeued), not the safetensors package's traceback (exit 1)."""
    pytest.importorskip("torch")
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.model.hf_weights import HfShardReader

    folder = _folder(tmp_path)
    reader = HfShardReader(str(folder))
    (folder / "model.safetensors").write_bytes(b"\x00" * 4)
    reader._handles.clear()
    with pytest.raises(ConfigError, match=r"model\.init_from: cannot read lm_head\.weight from .*re-download"):
        reader("output.weight", (32, 16), (slice(0, 32), slice(0, 16)))
    _escaping_index(folder)
    with pytest.raises(ConfigError, match=r"model\.init_from: model\.safetensors\.index\.json maps .* outside"):
        HfShardReader(str(folder))


def test_weights_that_are_not_finite_are_bad_input_on_the_rank(tmp_path) -> None:
    """Issue 30 Why 9: NaN weights trained into a NaN loss (and the doctor's learning-rate advice)."""
    pytest.importorskip("torch")
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.model.hf_weights import HfShardReader

    tensors = _tensors()
    tensors["lm_head.weight"][3, 4] = np.nan
    reader = HfShardReader(str(_folder(tmp_path, tensors)))
    with pytest.raises(ConfigError, match=r"model\.init_from: lm_head\.weight in .* holds values that are not "
                                          r"finite \(NaN or inf\): the weights are damaged"):
        reader("output.weight", (32, 16), (slice(0, 32), slice(0, 16)))
    assert reader("tok_embeddings.weight", (32, 16), (slice(0, 32), slice(0, 16))).shape == (32, 16)
