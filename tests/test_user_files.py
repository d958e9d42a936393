"""Files the user names (issue 18, findings 6 and 7): output paths that cannot be written, and inputs
that are not regular files or have no end. Each is one line and exit 2, never a traceback or a hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main

JOB = """\
name: files
model: {preset: tiny}
train: {global_batch: 8, micro_batch: 2}
parallel: {tp: 1, pp: 1, dp: 2}
cluster: {executor: local, nodes: 1, gpus_per_node: 2, gpu: cpu}
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    (tmp_path / "afile").write_text("a file where a folder should be\n")
    (tmp_path / "doc.txt").write_text("some text to tokenize\n")
    return path


def _hpctrain(argv: list[str], cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process, with a timeout: the faults below used to hang it."""
    return subprocess.run([sys.executable, "-m", "hpctrain", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("command", [
    ["render", "job.yaml", "-o", "afile/sub"], ["render", "job.yaml", "-o", "afile"],
    ["schema", "-o", "afile/sub"], ["schema", "-o", "."], ["schema", "-o", "/dev/full"],
    ["data", "prepare", "doc.txt", "-o", "afile/sub/tokens.bin"],
], ids=["render-under-file", "render-onto-file", "schema-under-file", "schema-onto-folder", "schema-disk-full",
        "data-prepare-under-file"])
def test_unwritable_output_is_one_line(command: list[str], job: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(job.parent)
    if command[-1] == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"-o '{command[-1]}': cannot write there: ") or "is not a folder" in err, err


def test_data_prepare_never_replaces_a_device_or_folder(job: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The token file is renamed over -o: as root, `-o /dev/full` replaced the device with a file."""
    monkeypatch.chdir(job.parent)
    (job.parent / "folder").mkdir()
    os.mkfifo(job.parent / "fifo")
    for target in ("folder", "fifo"):
        assert main(["data", "prepare", "doc.txt", "-o", target]) == 2
        assert "exists and is not a regular file" in capsys.readouterr().err
    assert (job.parent / "folder").is_dir() and not (job.parent / "folder.json").exists()


def test_fifo_as_job_file_is_refused_without_blocking(job: Path) -> None:
    os.mkfifo(job.parent / "fifo.yaml")
    proc = _hpctrain(["validate", "fifo.yaml"], job.parent, timeout_s=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "fifo.yaml:0: (file): 'fifo.yaml' is a FIFO, not a regular file; give the path " \
                                  "of a saved file"


@pytest.mark.parametrize("field", ["nvidia_smi", "slurm_topology"])
@pytest.mark.parametrize("source", ["/dev/zero", "fifo"])
def test_topology_file_must_be_a_regular_file(field: str, source: str, job: Path) -> None:
    """A topology file of /dev/zero grew to 4 GB; a FIFO blocked forever."""
    if source == "fifo":
        os.mkfifo(job.parent / "fifo")
    proc = _hpctrain(["plan", "job.yaml", f"--set=cluster.topology.{field}={source}"], job.parent, timeout_s=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"cluster.topology.{field}: ") and "not a regular file" in proc.stderr
    proc = _hpctrain(["topo", source], job.parent, timeout_s=30)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr


def test_topology_file_size_and_hostlists_are_bounded(job: Path) -> None:
    big = job.parent / "big.conf"
    with open(big, "wb") as handle:  # sparse: 17 MiB of NUL bytes without writing them
        handle.truncate(17 << 20)
    proc = _hpctrain(["topo", str(big)], job.parent, timeout_s=30)
    assert proc.returncode == 2 and "is larger than" in proc.stderr
    many = job.parent / "many.conf"  # 20 lines of 100,000 hosts each: two million names
    many.write_text("".join(f"SwitchName=s{i} Nodes=n[0-99999]\n" for i in range(20)))
    proc = _hpctrain(["topo", str(many)], job.parent, timeout_s=60)
    assert proc.returncode == 2 and "more than 1000000 nodes and switches" in proc.stderr
