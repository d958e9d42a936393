"""vcjob.yaml: the Volcano Job API's schema, the gang/restart contract, and hostile strings as data.

`kubectl create --dry-run=client` runs only where kubectl has a cluster: even its client-side dry run
asks the API server for the OpenAPI schema and the Volcano CRD's mapping (tried here with the installed
kubectl 1.32: "connection refused" on localhost:8080, no cluster exists). The schema in
volcano_schema.py (written from the API's Go types) stands in for it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hpctrain.cli import main
from hpctrain.config import job_from_dict, load_job
from hpctrain.render.nccl import nccl_environment
from hpctrain.render.vcjob import JOB_NAME_ANNOTATION, k8s_name, render_vcjob
from hpctrain.rundir.volcano import JOB_TEXT_ENV, TASK_NAME

from .hostile import HOSTILE
from .volcano_schema import VOLCANO_JOB_SCHEMA

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
VALIDATOR = jsonschema.Draft202012Validator(VOLCANO_JOB_SCHEMA)
KUBERNETES = {"image": "registry.example.com/hpctrain:1", "pvc": {"claim_name": "runs", "mount_path": "/runs"}}


def as_volcano(path: Path) -> dict[str, Any]:
    """An example as a volcano job: unchanged when it is one, else with a kubernetes section added."""
    data = yaml.safe_load(path.read_text())
    if data["cluster"].get("executor") != "volcano":
        data["cluster"]["executor"] = "volcano"
        data["kubernetes"] = copy.deepcopy(KUBERNETES)
        data.pop("sweep", None)
        data.pop("container", None)  # a Singularity image; the pods run kubernetes.image
        data.get("checkpoint", {}).pop("dir", None)  # off the shared volume
    return data


def manifest(data: dict[str, Any], run_dir: str | None = None) -> dict[str, Any]:
    text = render_vcjob(job_from_dict(data), run_dir=run_dir)
    docs = list(yaml.safe_load_all(text))
    assert len(docs) == 1
    return docs[0]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]


def env_of(doc: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(doc)["env"]}


def test_the_schema_itself_is_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(VOLCANO_JOB_SCHEMA)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_every_example_renders_a_valid_volcano_job(example: Path) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(manifest(as_volcano(example)))]
    assert errors == []


BAD_EDITS = [
    ("spec.minAvailabel", lambda d: d["spec"].update(minAvailabel=2)),
    ("task field", lambda d: d["spec"]["tasks"][0].update(replica=2)),
    ("container field", lambda d: container(d).update(imagePullPolicyy="Always")),
    ("event", lambda d: d["spec"]["policies"][1].update(events=["PodKilled"])),
    ("action", lambda d: d["spec"]["policies"][1].update(action="Restart")),
    ("event and exitCode", lambda d: d["spec"]["policies"][2].update(exitCode=3)),
    ("pull policy", lambda d: container(d).update(imagePullPolicy="Sometimes")),
    ("minAvailable type", lambda d: d["spec"].update(minAvailable="2")),
    ("emptyDir medium", lambda d: d["spec"]["tasks"][0]["template"]["spec"]["volumes"][1]["emptyDir"].update(
        medium="Disk")),
    ("metadata.name", lambda d: d["metadata"].update(name="Not_A_Label")),
]


@pytest.mark.parametrize("what,edit", BAD_EDITS, ids=[b[0] for b in BAD_EDITS])
def test_the_schema_rejects_what_the_api_rejects(what: str, edit: Any) -> None:
    doc = manifest(as_volcano(REPO / "examples" / "llama3-8b-volcano.yaml"))
    assert list(VALIDATOR.iter_errors(doc)) == []
    edit(doc)
    assert list(VALIDATOR.iter_errors(doc)), what


def test_gang_restart_and_resources_follow_the_job() -> None:
    data = as_volcano(REPO / "examples" / "llama3-8b-volcano.yaml")
    job = job_from_dict(data)
    doc = manifest(data)
    spec, task = doc["spec"], doc["spec"]["tasks"][0]
    assert (spec["schedulerName"], spec["minAvailable"], task["replicas"], task["name"]) == ("volcano", 2, 2, TASK_NAME)
    assert spec["maxRetry"] == data["restart"]["max_requeues"] == 5
    restart = data.pop("restart")
    old = {**data, "slurm": {**data.get("slurm", {}), **restart}}  # the old name still sets maxRetry
    assert manifest(old)["spec"]["maxRetry"] == 5
    assert {"events": ["PodEvicted", "PodFailed"], "action": "RestartJob"} in spec["policies"]
    assert {"event": "TaskCompleted", "action": "CompleteJob"} in spec["policies"]
    assert spec["policies"][0] == {"exitCode": 2, "action": "AbortJob"}  # bad input: a restart would fail alike
    assert set(spec["plugins"]) == {"env", "svc"}  # not pytorch: its per-pod RANK must not reach the ranks
    assert spec["queue"] == "research" and spec["priorityClassName"] == "high-priority"
    pod = task["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 120
    assert container(doc)["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/hca_shared_devices_a": 1}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "65536Mi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(doc)["volumeMounts"]
    assert {"name": "run", "persistentVolumeClaim": {"claimName": "training-runs"}} in pod["volumes"]
    assert container(doc)["command"] == ["python3", "-m", "hpctrain.launch.volcano.pod", "--run-dir",
                                         "/runs/llama3-8b-volcano", "--gpus", "8"]
    env = env_of(doc)
    profile, variables = nccl_environment(job)
    assert profile == "ib" and env["NCCL_NET_GDR_LEVEL"] == "PHB" and env["MASTER_PORT"] == "29500"
    assert all(env[v.name] == v.value for v in variables if v.value is not None and not v.under_task_dir)
    assert yaml.safe_load(env[JOB_TEXT_ENV])["parallel"]["dp"] == 2  # the planner's resolved job


def test_rdma_only_when_the_fabric_asks_and_max_retry_overrides() -> None:
    data = as_volcano(REPO / "examples" / "llama3-8b-volcano.yaml")
    data["cluster"]["fabric"] = "ethernet"
    data["kubernetes"]["max_retry"] = 9
    doc = manifest(data)
    assert container(doc)["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert doc["spec"]["maxRetry"] == 9


def shape(value: Any) -> Any:
    """The structure of a manifest without its string values: keys, list lengths, types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def mount_for(text: str) -> str:
    return "/runs/" + text.replace(":", "_")  # a core/v1 mountPath cannot hold ':' (refused at validate, below)


def hostile_job(text: str) -> dict[str, Any]:
    data = as_volcano(REPO / "examples" / "quickstart.yaml")
    data["name"] = text
    data["nccl"] = {"env": {"NCCL_HOSTILE": text}}
    data["runtime"] = {"python": text}
    data["checkpoint"]["dir"] = mount_for(text) + "/ck"
    data["train"]["data"] = text
    data["kubernetes"].update(image=text, annotations={"example.com/note": text},
                              pvc={"claim_name": "runs", "mount_path": mount_for(text)})
    return data


def test_hostile_strings_are_data_in_every_free_text_field() -> None:
    benign = shape(manifest(hostile_job("benign")))
    for text in HOSTILE:
        doc = manifest(hostile_job(text))
        assert shape(doc) == benign, text  # no key, item or document added or lost
        assert list(VALIDATOR.iter_errors(doc)) == [], text
        pod = doc["spec"]["tasks"][0]["template"]
        assert doc["metadata"]["annotations"][JOB_NAME_ANNOTATION] == text
        assert pod["metadata"]["annotations"] == {"example.com/note": text, JOB_NAME_ANNOTATION: text}
        assert doc["metadata"]["name"] == k8s_name(text)
        command = container(doc)["command"]
        # The command is an argv list: the job's strings are single arguments, never shell code.
        assert command == [text, "-m", "hpctrain.launch.volcano.pod", "--run-dir", f"{mount_for(text)}/{k8s_name(text)}",
                           "--gpus", "2"]
        assert container(doc)["image"] == text and "args" not in container(doc)
        assert {"name": "run", "mountPath": mount_for(text)} in container(doc)["volumeMounts"]
        env = env_of(doc)
        assert env["NCCL_HOSTILE"] == text
        carried = yaml.safe_load(env[JOB_TEXT_ENV])
        assert (carried["name"], carried["train"]["data"], carried["kubernetes"]["image"]) == (text, text, text)
        assert carried["checkpoint"]["dir"] == mount_for(text) + "/ck"


def test_mount_path_with_a_colon_is_refused_at_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = hostile_job("x")
    data["kubernetes"]["pvc"]["mount_path"] = "/runs/a:b"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kubernetes.pvc.mount_path" in err[0] and "'/runs/a:b'" in err[0]


@pytest.mark.parametrize("section,value,field", [
    (None, None, "kubernetes: is required"),
    ("namespace", "ML_Team", "kubernetes.namespace"),
    ("image_pull_policy", "Sometimes", "kubernetes.image_pull_policy"),
    ("node_selector", {"gpu": "a b"}, "kubernetes.node_selector.gpu"),
    ("tolerations", [{"operator": "Maybe"}], "kubernetes.tolerations.0.operator"),
    ("nodes", "1-2", "cluster.nodes: a volcano job is gang-scheduled on a fixed node count"),
])
def test_validate_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], section: Any,
                                             value: Any, field: str) -> None:
    data = as_volcano(REPO / "examples" / "quickstart.yaml")
    if section is None:
        del data["kubernetes"]
    elif section == "nodes":
        data["cluster"]["nodes"] = value
        data["parallel"]["dp"] = "auto"  # else the elastic check says first that a range needs a free degree
    else:
        data["kubernetes"][section] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


def test_render_cli_writes_vcjob_and_refuses_a_run_dir_off_the_volume(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    example = str(REPO / "examples" / "llama3-8b-volcano.yaml")
    assert main(["render", example, "-o", str(tmp_path / "out"), "--run-dir", "/runs/x"]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["job.resolved.yaml", "vcjob.yaml"]
    doc = yaml.safe_load((tmp_path / "out" / "vcjob.yaml").read_text())
    assert container(doc)["command"][4] == "/runs/x"
    assert load_job(str(tmp_path / "out" / "job.resolved.yaml")).parallel.dp == 2
    capsys.readouterr()
    assert main(["render", example, "-o", str(tmp_path / "out2"), "--run-dir", "/scratch/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run-dir /scratch/x" in err[0] and "kubernetes.pvc.mount_path=/runs" in err[0]


def test_kubectl_client_dry_run_accepts_every_volcano_example(tmp_path: Path) -> None:
    """`kubectl create --dry-run=client` where kubectl and a cluster that knows the Volcano CRD exist: its
    client side needs the CRD from discovery, so it cannot run offline (skipped on these machines)."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (and its client dry run needs a cluster's CRD discovery); "
                    "volcano_schema.py checks the manifests instead")
    context = subprocess.run([kubectl, "config", "current-context"], capture_output=True, text=True, timeout=30)
    if context.returncode != 0:
        pytest.skip("kubectl has no current context: no cluster to discover the Volcano CRD from")
    for example in EXAMPLES:
        path = tmp_path / f"{example.stem}.yaml"
        path.write_text(render_vcjob(job_from_dict(as_volcano(example))))
        proc = subprocess.run([kubectl, "create", "--dry-run=client", "-f", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
