"""vcjob.yaml: a Volcano Job (batch.volcano.sh/v1alpha1) for `cluster.executor: volcano`.

The manifest is built as Python data and written with yaml.safe_dump, so every job.yaml value is a
YAML scalar and nothing is a template: a name or path cannot add a key, a document or a command.
The pod's command is an argv list (no shell), `python3 -m hpctrain.launch.volcano.pod`, which starts one
`python -m hpctrain.runtime` per GPU (hpctrain/launch/volcano/pod.py); the contract with the pods (plugins,
variables, task name) is hpctrain/rundir/volcano.py.

Field names follow volcano-sh/apis pkg/apis/batch/v1alpha1/job.go (JobSpec, TaskSpec,
LifecyclePolicy), pkg/apis/bus/v1alpha1/{events,actions}.go and k8s.io/api core/v1 (PodSpec,
Container, Volume); tests/render/volcano_job.schema.json checks them.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import RenderError
from hpctrain.render.nccl import nccl_environment
from hpctrain.rundir.volcano import GPUS_ENV, JOB_TEXT_ENV, TASK_NAME

if TYPE_CHECKING:
    from hpctrain.config import Job
    from hpctrain.config.kubernetes import KubernetesConfig

VCJOB_FILE = "vcjob.yaml"
API_VERSION = "batch.volcano.sh/v1alpha1"
CONTAINER_NAME = "trainer"
NAME_MAX = 40  # pods are <job>-worker-<i> and the svc plugin's Service is <job>: room for both in 63
JOB_NAME_ANNOTATION = "hpctrain.dev/job-name"  # the exact job name; metadata.name is a DNS label
RDMA_PROFILES = ("ib", "roce")
BAD_INPUT_EXIT = 2  # exit codes (docs/architecture.md): the input is wrong, a restart would fail the same way


def k8s_name(name: str) -> str:
    """metadata.name: `name` as a DNS-1123 label of at most 40 characters, with a short hash of the exact
    name when it had to change (two names that differ only in case or punctuation stay apart)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if slug == name and len(slug) <= NAME_MAX:
        return slug
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    slug = slug[:NAME_MAX - 7].strip("-")
    return f"{slug}-{digest}" if slug else f"job-{digest}"


def _kubernetes(job: Job) -> KubernetesConfig:
    if job.kubernetes is None:
        raise RenderError("kubernetes: a volcano job needs the kubernetes section (image, pvc.claim_name)")
    return job.kubernetes


def pod_run_dir(job: Job, run_dir: Optional[str]) -> str:
    """The run directory inside the pods: --run-dir, else <pvc.mount_path>/<k8s name>; on the shared volume."""
    mount = _kubernetes(job).pvc.mount_path
    if not run_dir:
        return mount.rstrip("/") + "/" + k8s_name(job.name)
    folder, path = posixpath.normpath(mount), posixpath.normpath(run_dir)
    if not (path == folder or path.startswith(folder.rstrip("/") + "/")):
        raise RenderError(f"--run-dir {run_dir}: must be under kubernetes.pvc.mount_path={mount}, the volume every "
                          "pod shares (checkpoints must survive a restart on another node); use a path below it")
    return run_dir


def _quantity_gib(gib: float) -> str:
    return f"{round(gib * 1024)}Mi"  # a core/v1 Quantity: binary suffix, whole MiB


def _env(job: Job, run_dir: str, job_text: str) -> list[dict[str, str]]:
    profile, variables = nccl_environment(job)
    env = [{"name": v.name, "value": run_dir + v.value if v.under_task_dir else v.value}
           for v in variables if v.value is not None]
    env += [{"name": "MASTER_PORT", "value": str(_kubernetes(job).master_port)},
            {"name": GPUS_ENV, "value": str(job.cluster.gpus_per_node)},
            {"name": "HPCTRAIN_NCCL_PROFILE", "value": profile},
            {"name": JOB_TEXT_ENV, "value": job_text}]
    return env


def _resources(job: Job) -> dict[str, Any]:
    k8s = _kubernetes(job)
    limits: dict[str, Any] = {k8s.gpu_resource: job.cluster.gpus_per_node}
    profile, _ = nccl_environment(job)
    if k8s.rdma_resource is not None and profile in RDMA_PROFILES:
        limits[k8s.rdma_resource] = k8s.rdma_per_pod
    return {"limits": limits}  # extended resources: requests default to the limits


def _toleration(t: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": t.operator}
    for key, value in (("key", t.key), ("value", t.value), ("effect", t.effect),
                       ("tolerationSeconds", t.toleration_seconds)):
        if value is not None:
            out[key] = value
    return out


def _pod_spec(job: Job, run_dir: str, job_text: str) -> dict[str, Any]:
    k8s = _kubernetes(job)
    python = job.runtime.python or "python3"  # the image's interpreter; a login-node path means nothing there
    shm: dict[str, Any] = {"medium": "Memory"}
    if k8s.shm_size_gib is not None:
        shm["sizeLimit"] = _quantity_gib(k8s.shm_size_gib)
    container = {
        "name": CONTAINER_NAME,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": [python, "-m", "hpctrain.launch.volcano.pod", "--run-dir", run_dir,
                    "--gpus", str(job.cluster.gpus_per_node)],
        "env": _env(job, run_dir, job_text),
        "resources": _resources(job),
        "volumeMounts": [{"name": "run", "mountPath": k8s.pvc.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    spec: dict[str, Any] = {
        # Volcano restarts the whole Job (RestartJob); the kubelet must not restart one container alone.
        "restartPolicy": "Never",
        # On deletion or eviction the ranks get SIGTERM and save a checkpoint (runtime/requeue.py) before this.
        "terminationGracePeriodSeconds": k8s.termination_grace_s,
        "containers": [container],
        "volumes": [{"name": "run", "persistentVolumeClaim": {"claimName": k8s.pvc.claim_name}},
                    {"name": "dshm", "emptyDir": shm}],
    }
    if k8s.service_account is not None:
        spec["serviceAccountName"] = k8s.service_account
    if k8s.node_selector:
        spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        spec["tolerations"] = [_toleration(t) for t in k8s.tolerations]
    return spec


def vcjob_manifest(job: Job, *, run_dir: Optional[str] = None) -> dict[str, Any]:
    """The Volcano Job for a resolved job, as plain data."""
    from hpctrain.config import dump_job

    k8s, nodes = _kubernetes(job), job.cluster.nodes
    path = pod_run_dir(job, run_dir)
    labels = {"app.kubernetes.io/managed-by": "hpctrain"}
    annotations = {**k8s.annotations, JOB_NAME_ANNOTATION: job.name}
    spec: dict[str, Any] = {
        "schedulerName": "volcano",
        "minAvailable": nodes,  # gang scheduling: all pods or none
        "queue": k8s.queue,
        "maxRetry": k8s.max_retry if k8s.max_retry is not None else job.restart.max_requeues,
        # Volcano's job controller (applyPolicies) takes the first policy, in order, whose event or exit
        # code matches; a failed pod brings both, so the exit-code policy must come first to win.
        "policies": [
            {"exitCode": BAD_INPUT_EXIT, "action": "AbortJob"},
            {"events": ["PodEvicted", "PodFailed"], "action": "RestartJob"},
            {"event": "TaskCompleted", "action": "CompleteJob"},
        ],
        "plugins": {"env": [], "svc": []},
        "tasks": [{
            "name": TASK_NAME,
            "replicas": nodes,
            "template": {"metadata": {"labels": dict(labels), "annotations": annotations},
                         "spec": _pod_spec(job, path, dump_job(job))},
        }],
    }
    if k8s.priority_class is not None:
        spec["priorityClassName"] = k8s.priority_class
    return {"apiVersion": API_VERSION, "kind": "Job",
            "metadata": {"name": k8s_name(job.name), "namespace": k8s.namespace, "labels": labels,
                         "annotations": {JOB_NAME_ANNOTATION: job.name}},
            "spec": spec}


def render_vcjob(job: Job, *, run_dir: Optional[str] = None) -> str:
    """vcjob.yaml's text: the manifest dumped by yaml's SafeDumper (every value a scalar, quoted as needed)."""
    import yaml

    from hpctrain.render.rendering import resolve

    job = resolve(job)
    header = "# Volcano Job rendered by hpctrain; create it with `kubectl create -f vcjob.yaml`.\n"
    return header + yaml.dump(vcjob_manifest(job, run_dir=run_dir), Dumper=_dumper(), sort_keys=False, width=120)


def _dumper() -> Any:
    """yaml.SafeDumper writing multi-line strings (the resolved job) as `|` blocks, one line per line, so a
    golden diff shows the changed line. The emitter itself falls back to a quoted scalar for any string a
    block cannot carry exactly (trailing spaces, control characters), so this changes layout, never values."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: Any, value: str) -> Any:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return Dumper


def write_vcjob(job: Job, out_dir: str | Path, *, run_dir: Optional[str] = None) -> dict[str, Path]:
    """Resolve once, then write vcjob.yaml and job.resolved.yaml to out_dir."""
    from hpctrain.config import dump_job
    from hpctrain.render.rendering import RESOLVED_FILE, resolve

    resolved = resolve(job)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"vcjob": out / VCJOB_FILE, "resolved": out / RESOLVED_FILE}
    paths["vcjob"].write_text(render_vcjob(resolved, run_dir=run_dir), encoding="utf-8")
    paths["resolved"].write_text(dump_job(resolved), encoding="utf-8")
    return paths
