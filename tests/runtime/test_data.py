"""Data: the synthetic stream, token files from `hpctrain data prepare`, the dp-sharded sampler."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime.data.tokens import ShardedSampler, SyntheticTokens, TokenFile, resolve_dtype
from hpctrain.data.prepare import decode, prepare

from ._entry import REPO, text_files


def test_synthetic_is_a_pure_function_of_seed_and_index() -> None:
    a, b = SyntheticTokens(256, 32, seed=7), SyntheticTokens(256, 32, seed=7)
    batch = a.samples(10, 4)
    assert batch.shape == (4, 33) and batch.dtype == np.int64
    assert np.array_equal(batch[2], b.sample(12))
    assert batch.min() >= 0 and batch.max() < 256
    assert not np.array_equal(SyntheticTokens(256, 32, seed=8).sample(12), batch[2])


def test_synthetic_follows_its_chain() -> None:
    src = SyntheticTokens(64, 50, seed=1)
    seq = src.sample(3)
    for t in range(50):  # every next token is one of the current token's successors: learnable
        assert seq[t + 1] in src.successors[seq[t]]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_slices_concatenate_to_the_global_batch(dp: int) -> None:
    src = SyntheticTokens(128, 8, seed=3)
    reference = ShardedSampler(src, 8, 0, 1)
    shards = [ShardedSampler(src, 8, r, dp) for r in range(dp)]
    for _ in range(3):
        want_x, want_y = reference.next_batch()
        got = [s.next_batch() for s in shards]
        assert np.array_equal(np.concatenate([x for x, _ in got]), want_x)
        assert np.array_equal(np.concatenate([y for _, y in got]), want_y)
        assert np.array_equal(want_x[:, 1:], want_y[:, :-1])  # labels are the inputs shifted by one


def test_sampler_position_resumes_on_another_layout() -> None:
    src = SyntheticTokens(128, 8, seed=3)
    first = ShardedSampler(src, 8, 0, 1)
    first.next_batch(), first.next_batch()
    state = first.state_dict()
    assert state["samples_seen"] == 16
    resumed = [ShardedSampler(src, 8, r, 2) for r in range(2)]
    for s in resumed:
        s.load_state_dict(json.loads(json.dumps(state)))
    want = first.next_batch()[0]
    assert np.array_equal(np.concatenate([s.next_batch()[0] for s in resumed]), want)


def test_global_batch_must_split_over_dp() -> None:
    with pytest.raises(ConfigError, match="train.global_batch"):
        ShardedSampler(SyntheticTokens(16, 4, 0), 6, 0, 4)


def test_prepare_bytes_round_trip(tmp_path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("héllo")  # no trailing newline: a separator is added
    b.write_text("world\n")
    out = str(tmp_path / "tokens.bin")
    done = prepare([str(a), str(b)], out)
    tokens = np.fromfile(out, dtype=np.uint16)
    assert done.tokens == tokens.size == len("héllo".encode()) + 1 + 6
    assert decode(tokens) == "héllo\nworld\n"
    side = json.loads(open(out + ".json").read())
    assert side["dtype"] == "uint16" and side["vocab"] == 256 and side["tokens"] == done.tokens
    assert resolve_dtype(out, "auto", 50000) == np.uint16


def test_prepare_bytes_keeps_undecodable_bytes(tmp_path) -> None:
    raw = b"caf\xe9 latin-1\n\xff\xfe"
    (tmp_path / "a.txt").write_bytes(raw)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"))
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == list(raw)


def test_prepare_rejects_bad_inputs(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "t.bin"))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "file" / "t.bin"))
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"))
    assert not os.path.exists(tmp_path / "t.bin")


def test_data_prepare_command_needs_no_torch(tmp_path) -> None:
    """The CLI module imports only argparse; the command itself runs without torch."""
    files = text_files()[:3]
    code = (
        "import argparse, sys\n"
        "from hpctrain.cli import data as data_commands\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules\n"
        "p = argparse.ArgumentParser(); data_commands.register(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); rc = a.handler(a)\n"
        "assert 'torch' not in sys.modules, 'data prepare imported torch'\n"
        "sys.exit(rc)\n"
    )
    out = str(tmp_path / "tokens.bin")
    proc = subprocess.run([sys.executable, "-c", code, "data", "prepare", *files, "-o", out],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tokens (uint16, byte-level vocab 256)" in proc.stdout
    tokens = json.loads(open(out + ".json").read())["tokens"]
    assert os.path.getsize(out) == 2 * tokens
    assert 0 <= tokens - sum(os.path.getsize(f) for f in files) <= len(files) - 1  # newline separators


def test_data_command_usage_without_action() -> None:
    from hpctrain.cli import data as data_commands

    parser = argparse.ArgumentParser()
    data_commands.register(parser.add_subparsers())
    args = parser.parse_args(["data"])
    assert args.handler(args) == 2


def _token_file(tmp_path, values, dtype=np.uint16) -> str:
    path = str(tmp_path / "t.bin")
    np.asarray(values, dtype=dtype).tofile(path)
    return path


def test_token_file_windows_cover_each_epoch_once(tmp_path) -> None:
    path = _token_file(tmp_path, np.arange(41) % 200)
    src = TokenFile(path, np.dtype(np.uint16), vocab=256, seq_len=8, seed=0)
    assert src.windows == 5
    starts = sorted(int(src.sample(i)[0]) for i in range(5))
    assert starts == [0, 8, 16, 24, 32]
    assert np.array_equal(src.sample(2)[1:], src.sample(2)[:-1] + 1)
    epoch2 = [int(src.sample(i)[0]) for i in range(5, 10)]
    assert sorted(epoch2) == starts and epoch2 != [int(src.sample(i)[0]) for i in range(5)]


def test_token_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        TokenFile(str(tmp_path / "nope.bin"), np.dtype(np.uint16), 256, 8, 0)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        TokenFile(str(odd), np.dtype(np.uint16), 256, 8, 0)
    short = _token_file(tmp_path, [1, 2, 3])
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        TokenFile(short, np.dtype(np.uint16), 256, 8, 0)
    big = _token_file(tmp_path, np.arange(100))
    with pytest.raises(ConfigError, match="outside model.vocab=64"):
        TokenFile(big, np.dtype(np.uint16), 64, 8, 0)


def test_dtype_from_vocab_without_sidecar(tmp_path) -> None:
    path = _token_file(tmp_path, [1, 2, 3])
    assert resolve_dtype(path, "auto", 70000) == np.uint32
    assert resolve_dtype(path, "auto", 65536) == np.uint16
    assert resolve_dtype(path, "uint32", 10) == np.uint32
