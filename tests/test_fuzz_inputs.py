"""Issue 30 acceptance: a fuzz test over the three input sources, job.yaml / `--set` / init_from's config.json,
a token file's sidecar and a safetensors header. Every generated case ends in exit 0 or exit 2 with one
line per problem, within 10 s, and never with a traceback.

The cases come from a fixed seed (the same 240 on every machine): a valid job, folder and token file,
each damaged in one place with a value drawn from a pool of hostile ones (bounds, types, infinities,
huge strings and lists, deep nesting, escapes). They run in-process through `hpctrain.cli.main`
(`validate`, and `submit --dry-run` where the login node reads the token files), so each costs
milliseconds; an exception other than hpctrain's own errors escapes `main` and fails the case.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml

from hpctrain.cli.main import main

SEED = 30
CASES = 240
LIMIT_S = 10

HOSTILE: list[Any] = [0, -1, 1, 2, 3, 7, 2**31, 2**63, -(2**63), 10**18, 10**100, 0.5, -0.0, 1e-300, 1e308,
                      float("inf"), float("-inf"), float("nan"), True, False, None, "", "x", "x" * 5000, "auto",
                      "1e9", "-1", "../../../../etc/passwd", "/dev/zero", "\x1b[31mred\x1b[0m", "a\nb", "\u202e",
                      [], [1] * 3000, [[[[[]]]]], {}, {"a": 1}, {"": None}]
JOB_PATHS = ["name", "runs_dir", "model.preset", "model.layers", "model.hidden", "model.heads", "model.kv_heads",
             "model.vocab", "model.seq_len", "model.ffn_hidden", "model.rope_theta", "model.norm_eps",
             "model.moe", "model.moe.experts", "model.moe.top_k", "train.steps", "train.global_batch",
             "train.micro_batch", "train.seed", "train.optimizer.lr", "train.precision", "train.data",
             "train.log_every", "parallel.tp", "parallel.pp", "parallel.dp", "parallel.zero", "cluster.nodes",
             "cluster.gpus_per_node", "cluster.gpu", "cluster.executor", "checkpoint.every_steps",
             "checkpoint.keep_last", "slurm.time", "slurm.partition", "restart.max_requeues", "monitor.tracker",
             "sweep.grid", "container.image", "nccl", "model", "train", "unknown_key", "model.unknown"]
HF_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "head_dim", "max_position_embeddings",
           "model_type", "hidden_act", "tie_word_embeddings", "sliding_window", "num_experts", "rope_parameters"]
SIDECAR_KEYS = ["dtype", "vocab", "tokens", "documents", "eos_id", "validation", "tokenizer_sha256", "format"]
HF = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
      "num_key_value_heads": 1, "intermediate_size": 24, "vocab_size": 32, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
BASE = {"name": "fuzz", "model": {"preset": "tiny"}, "train": {"steps": 2, "global_batch": 2},
        "cluster": {"executor": "local", "gpus_per_node": 1}}


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    for key in keys[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[keys[-1]] = value


def _job_yaml(rng: random.Random, tmp: Path) -> list[str]:
    data = json.loads(json.dumps(BASE))
    for _ in range(rng.choice([1, 1, 2, 3])):
        _put(data, rng.choice(JOB_PATHS), rng.choice(HOSTILE))
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if rng.random() < 0.15:  # damage the text itself: cut it, nest it, alias it
        body = rng.choice([body[: rng.randrange(len(body))], "[" * 5000 + "]" * 5000, "a: &x [1, 2]\nb: *x\n" * 50,
                           "name: fuzz\nmodel: {preset: tiny}\n" + "\t\x00junk", "- 1\n- 2\n", "{{{"])
    (tmp / "job.yaml").write_text(body, encoding="utf-8")
    return ["validate", str(tmp / "job.yaml")]


def _set(rng: random.Random, tmp: Path) -> list[str]:
    (tmp / "job.yaml").write_text(yaml.safe_dump(BASE, sort_keys=False))
    sets = []
    for _ in range(rng.choice([1, 2, 3])):
        value = rng.choice(HOSTILE)
        text = value if isinstance(value, str) else json.dumps(value)
        path = rng.choice(JOB_PATHS + ["", ".", "model..layers", "a" * 300, "train.optimizer.lr.x"])
        sets += ["--set", rng.choice([f"{path}={text}", path, f"={text}", f"{path}=={text}"])]
    return [rng.choice(["validate", "plan"]), str(tmp / "job.yaml"), *sets]


def _hf_folder(tmp: Path, config: Any, raw: str | None = None) -> None:
    from safetensors.numpy import save_file

    folder = tmp / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    tensors = {"model.embed_tokens.weight": np.zeros((32, 16), np.float32), "model.norm.weight": np.ones(16, np.float32)}
    save_file(tensors, str(folder / "model.safetensors"))
    (tmp / "job.yaml").write_text(yaml.safe_dump({**BASE, "model": {"init_from": "hf", "seq_len": 8}}))


def _config_json(rng: random.Random, tmp: Path) -> list[str]:
    config = dict(HF)
    for _ in range(rng.choice([1, 1, 2])):
        config[rng.choice(HF_KEYS)] = rng.choice(HOSTILE)
    raw = None
    if rng.random() < 0.15:
        raw = rng.choice(['{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 100_000, json.dumps(HF)[:40], "1" * 5000,
                          "\xff\xfe", "null"])
    _hf_folder(tmp, config, raw)
    return [rng.choice(["validate", "validate", "plan"]), str(tmp / "job.yaml")]


def _safetensors(rng: random.Random, tmp: Path) -> list[str]:
    _hf_folder(tmp, HF)
    path = tmp / "hf" / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    kind = rng.randrange(5)
    if kind == 0:  # the length field
        new_length = rng.choice([0, 1, 7, length - 1, length + 1, len(data), 2**62, 2**64 - 1, 100_000_001])
        data = new_length.to_bytes(8, "little") + data[8:]
    elif kind == 1:  # cut the file
        data = data[: rng.randrange(len(data))]
    else:  # one entry's dtype, shape or offsets, or the whole header
        name = rng.choice(sorted(header))
        if kind == 2:
            field = rng.choice(["dtype", "shape", "data_offsets"])
            header[name] = {**header[name], field: rng.choice(HOSTILE + ["F64", "I8", "F8_E4M3", [2**40, 2**40]])}
        elif kind == 3:
            header = rng.choice(HOSTILE)
        else:
            (tmp / "hf" / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {name: rng.choice(HOSTILE + ["model.safetensors", "../x", "/etc/passwd"])}}))
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + length:]
    path.write_bytes(data)
    return [rng.choice(["validate", "validate", "submit"]), str(tmp / "job.yaml")]


def _sidecar(rng: random.Random, tmp: Path) -> list[str]:
    tokens = np.arange(200, dtype=np.uint16) % 256
    tokens.tofile(tmp / "t.bin")
    side: dict[str, Any] = {"format": 1, "split": "train", "dtype": "uint16", "vocab": 256, "eos_id": 0,
                            "tokenizer": "bytes", "documents": 1, "tokens": 200}
    for _ in range(rng.choice([1, 2])):
        side[rng.choice(SIDECAR_KEYS)] = rng.choice(HOSTILE)
    raw = json.dumps(side) if rng.random() > 0.1 else rng.choice(["[" * 100_000, "{", "7", ""])
    (tmp / "t.bin.json").write_text(raw)
    job = {**BASE, "train": {**BASE["train"], "data": str(tmp / "t.bin")}}
    if rng.random() < 0.3:
        job["train"]["eval_every"] = 1
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    return ["submit", str(tmp / "job.yaml")]


SOURCES: list[Callable[[random.Random, Path], list[str]]] = [_job_yaml, _set, _config_json, _safetensors, _sidecar]


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def test_fuzzed_inputs_end_in_exit_0_or_one_line_per_problem(tmp_path: Path, capsys, monkeypatch) -> None:
    rng = random.Random(SEED)
    previous = signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, int] = {}
    try:
        for case in range(CASES):
            source = SOURCES[case % len(SOURCES)]
            folder = tmp_path / f"case-{case}"
            folder.mkdir()
            monkeypatch.chdir(folder)
            argv = source(rng, folder)
            if argv[0] == "submit":  # a dry run: everything the login node checks, nothing started
                argv = ["submit", "--dry-run", *argv[1:]]
            signal.alarm(LIMIT_S)
            try:
                code = main(argv)
            except _Hang:
                pytest.fail(f"case {case} ({source.__name__}): {argv} ran past {LIMIT_S} s")
            except SystemExit as exc:  # argparse refusing the command line: its usage line, exit 2
                code = int(exc.code or 0)
            finally:
                signal.alarm(0)
            out, err = capsys.readouterr()
            label = f"case {case} ({source.__name__}): {argv[:4]} -> {code}\n{err[-2000:]}"
            assert code in (0, 2), label
            assert "Traceback" not in err and "Traceback" not in out, label
            if code == 2:
                lines = err.strip().splitlines()
                assert lines and all(line.strip() and not line.startswith(" ") for line in lines[:1]), label
                assert not any(line.startswith('  File "') for line in lines), label
            counts[f"{source.__name__} exit {code}"] = counts.get(f"{source.__name__} exit {code}", 0) + 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert sum(counts.values()) == CASES
    for source in SOURCES:  # every source produced refusals, not only passes
        assert counts.get(f"{source.__name__} exit 2", 0) > 0, counts
