"""The data identity rule (rundir/data_identity.py) on real files: what counts as a changed token file."""

from __future__ import annotations

import os

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.rundir.data_identity import check_and_record, check_unchanged


def _job(data: str):
    return job_from_dict({"name": "d", "model": {"preset": "tiny"}, "train": {"data": data},
                          "cluster": {"executor": "local", "gpu": "cpu"}})


def test_a_file_without_sidecar_is_compared_by_size_and_time(tmp_path) -> None:
    data, run = tmp_path / "t.bin", tmp_path / "run"
    run.mkdir()
    data.write_bytes(b"\x01\x00" * 100)
    check_and_record(_job(str(data)), run, write=True)
    check_unchanged(_job(str(data)), run)  # nothing changed
    os.utime(data, ns=(1, 1))  # rewritten (same size)
    with pytest.raises(ConfigError, match="modification time differs"):
        check_unchanged(_job(str(data)), run)


def test_a_sidecar_decides_and_another_path_is_a_choice(tmp_path) -> None:
    data, run = tmp_path / "t.bin", tmp_path / "run"
    run.mkdir()
    data.write_bytes(b"\x01\x00" * 100)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint16", "tokens": 100, "sources": ["a"]}')
    check_and_record(_job(str(data)), run, write=True)
    os.utime(data, ns=(1, 1))  # copied or touched: the sidecar still says the same corpus
    check_unchanged(_job(str(data)), run)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint16", "tokens": 100, "sources": ["b"]}')
    with pytest.raises(ConfigError, match=r"train.data: .*t.bin changed since this run trained on it \(its sidecar"):
        check_unchanged(_job(str(data)), run)
    other = tmp_path / "u.bin"
    other.write_bytes(b"\x02\x00" * 50)
    check_and_record(_job(str(other)), run, write=True)  # --set train.data=OTHER: recorded, not refused
    data.write_bytes(b"\x01\x00" * 7)
    with pytest.raises(ConfigError, match="200 bytes then, 14 now"):
        check_unchanged(_job(str(data)), run)  # the first file's record is kept
