"""`hpctrain submit/status/cancel/logs` with cluster.executor: volcano (issue 17, item 2).

No Kubernetes cluster and no kubectl exist on these machines, so kubectl is a stub script that records
its argv and answers as kubectl would (a mock by necessity: nothing real here can create a Volcano
Job). What is tested is hpctrain's side: which kubectl calls, in which order, with which arguments,
and what hpctrain prints and returns when kubectl is missing, has no context, or refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "llama3-8b-volcano.yaml")

STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["KUBECTL_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
mode = os.environ.get("KUBECTL_MODE", "ok")
if args[:2] == ["config", "current-context"]:
    if mode == "no-context":
        sys.stderr.write("error: current-context is not set\\n")
        sys.exit(1)
    print("lab-cluster")
elif args[0] == "create":
    if mode == "refuse":
        sys.stderr.write('Error from server (AlreadyExists): jobs.batch.volcano.sh "x" already exists\\n')
        sys.exit(1)
    import yaml
    name = yaml.safe_load(open(args[2]))["metadata"]["name"]
    print("job.batch.volcano.sh/" + name)
elif args[0] == "get":
    print("Running", end="")
elif args[0] == "logs":
    print("[pod/llama3-8b-volcano-worker-0/trainer] python -m hpctrain.launch.volcano.pod: pod 0 of 2")
"""


@pytest.fixture
def kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stub kubectl first on PATH; returns the file of its recorded calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "kubectl"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    log = tmp_path / "kubectl.calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_LOG", str(log))
    return log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def submit(tmp_path: Path, *extra: str) -> int:
    return main(["submit", EXAMPLE, "--set", f"runs_dir={tmp_path / 'runs'}", *extra])


def run_dir_of(out: str) -> Path:
    return Path(next(line for line in out.splitlines() if line.startswith("run ")).split(" ", 1)[1])


def test_dry_run_only_renders(tmp_path: Path, kubectl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert submit(tmp_path, "--dry-run") == 0
    out = capsys.readouterr().out
    run = run_dir_of(out)
    manifest = run / "submit" / "vcjob.yaml"
    assert f"manifest {manifest}" in out and calls(kubectl) == []
    doc = yaml.safe_load(manifest.read_text())
    command = doc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--run-dir") + 1] == f"/runs/{run.name}"  # same run name on the shared claim


def test_without_kubectl_the_manifest_stays_and_one_line_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert submit(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kubectl is not on PATH" in err[0], err
    manifest = Path(err[0].split("the manifest is ", 1)[1].split(":", 1)[0])
    assert manifest.name == "vcjob.yaml" and yaml.safe_load(manifest.read_text())["kind"] == "Job"


def test_without_a_context_nothing_is_created(tmp_path: Path, kubectl: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECTL_MODE", "no-context")
    assert submit(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no current context" in err[0]
    assert calls(kubectl) == [["config", "current-context"]]


def test_a_refused_create_is_exit_3(tmp_path: Path, kubectl: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECTL_MODE", "refuse")
    assert submit(tmp_path) == 3
    err = capsys.readouterr().err
    assert "kubectl create -f failed (exit 1)" in err and "AlreadyExists" in err


def test_submit_status_logs_cancel_go_through_kubectl(tmp_path: Path, kubectl: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert submit(tmp_path) == 0
    out = capsys.readouterr().out
    run = run_dir_of(out)
    assert "job ml-training/llama3-8b-volcano" in out
    manifest = str(run / "submit" / "vcjob.yaml")
    assert calls(kubectl) == [["config", "current-context"],
                              ["create", "-f", manifest, "--namespace", "ml-training", "-o", "name"]]

    assert main(["status", str(run), "--json"]) == 0
    status: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert (status["state"], status["executor"], status["job_id"]) == \
        ("RUNNING", "volcano", "ml-training/llama3-8b-volcano")
    assert calls(kubectl)[-1] == ["get", "jobs.batch.volcano.sh", "llama3-8b-volcano", "--namespace", "ml-training",
                                  "-o", "jsonpath={.status.state.phase}"]

    assert main(["logs", str(run)]) == 0
    assert "pod 0 of 2" in capsys.readouterr().out
    assert calls(kubectl)[-1][:5] == ["logs", "--namespace", "ml-training", "--selector",
                                      "volcano.sh/job-name=llama3-8b-volcano"]

    path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path / "nowhere")  # kubectl gone: status still answers, from the run dir
    try:
        assert main(["status", str(run), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "UNKNOWN"
    finally:
        os.environ["PATH"] = path

    assert main(["cancel", str(run)]) == 0
    assert "cancelled job ml-training/llama3-8b-volcano" in capsys.readouterr().out
    assert calls(kubectl)[-1] == ["delete", "jobs.batch.volcano.sh", "llama3-8b-volcano", "--namespace",
                                  "ml-training", "--wait=false"]


def test_the_volcano_login_path_and_pod_launcher_import_no_torch() -> None:
    code = ("import sys, hpctrain.render.vcjob, hpctrain.launch.volcano.pod, hpctrain.launch.volcano.executor, "
            "hpctrain.rundir.volcano, hpctrain.config.kubernetes; sys.exit(3 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 0


def test_the_real_kubectl_without_a_context_leaves_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The same refusal from a real kubectl (when one is installed): an empty kubeconfig has no context."""
    import shutil

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here; the stub tests above cover the refusal")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert submit(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no current context" in err[0] and "vcjob.yaml" in err[0]
    assert len(list((tmp_path / "runs").glob("*/submit/vcjob.yaml"))) == 1
