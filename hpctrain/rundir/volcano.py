"""What a Volcano pod is told, and how hpctrain reads it: the contract between vcjob.yaml and its pods.

The manifest (hpctrain/render/vcjob.py) asks for Volcano's `env` and `svc` job plugins
(volcano.sh docs, "job plugins"; volcano-sh/volcano pkg/controller/job/plugins/{env,svc}):

- env: `VC_TASK_INDEX` (and the older `VK_TASK_INDEX`) = the pod's index within its task,
  0..replicas-1. Our one task has one pod per node, so it is the node rank.
- svc: a headless Service named after the job, pod hostnames `<job>-<task>-<i>.<job>`, and for each
  task `VC_<TASK>_HOSTS` (comma-separated, in index order) and `VC_<TASK>_NUM`, plus the same lists
  as files `/etc/volcano/<task>.host` (one per line) and `<task>.num`.

The pytorch plugin is not used: it sets RANK and WORLD_SIZE per pod, which a process per GPU must not
inherit. The pod launcher (hpctrain/launch/volcano/pod.py) starts one rank per GPU with torchrun's variables,
and runtime/distributed.py recognises the pod by VC_TASK_INDEX. Pure functions; no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hpctrain.errors import ConfigError

TASK_NAME = "worker"  # the Volcano task (one pod per node); its name makes the svc plugin's variables
INDEX_ENV = "VC_TASK_INDEX"
OLD_INDEX_ENV = "VK_TASK_INDEX"
HOSTS_ENV = f"VC_{TASK_NAME.upper()}_HOSTS"
NUM_ENV = f"VC_{TASK_NAME.upper()}_NUM"
HOSTS_DIR = "/etc/volcano"
HOSTS_FILE = f"{TASK_NAME}.host"
HOSTS_DIR_ENV = "HPCTRAIN_VOLCANO_DIR"  # where the svc plugin's files are (tests point it elsewhere)
GPUS_ENV = "HPCTRAIN_GPUS_PER_POD"  # set by the manifest: cluster.gpus_per_node
JOB_TEXT_ENV = "HPCTRAIN_RESOLVED_JOB"  # set by the manifest: job.resolved.yaml's text, written by the pod
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class PodRendezvous:
    """This pod's place in the job, from Volcano's environment."""

    node_rank: int
    nodes: int
    master_addr: str
    master_port: int


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "")
    if not re.fullmatch(r"\d+", value.strip()):
        raise ConfigError(f"environment: {name}={value!r} is not a non-negative integer; Volcano's env plugin "
                          "sets it (spec.plugins.env in vcjob.yaml)")
    return int(value)


def _read_hosts(environ: Mapping[str, str]) -> list[str]:
    folder = environ.get(HOSTS_DIR_ENV, HOSTS_DIR)
    try:
        return Path(folder, HOSTS_FILE).read_text(encoding="utf-8").split()
    except OSError:
        return []


HostsReader = Callable[[Mapping[str, str]], list[str]]


def pod_hosts(environ: Mapping[str, str], read_file: Optional[HostsReader] = None) -> list[str]:
    """The task's pod hostnames in index order: VC_WORKER_HOSTS, else /etc/volcano/worker.host."""
    hosts = [h for h in environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    if not hosts:
        hosts = (read_file or _read_hosts)(environ)
    if not hosts:
        raise ConfigError(f"environment: neither {HOSTS_ENV} nor {HOSTS_DIR}/{HOSTS_FILE} names the pods; Volcano's "
                          "svc plugin provides them (spec.plugins.svc in vcjob.yaml)")
    return [h.strip() for h in hosts]


def in_volcano_pod(environ: Mapping[str, str]) -> bool:
    return INDEX_ENV in environ or OLD_INDEX_ENV in environ


def pod_rendezvous(environ: Mapping[str, str], read_file: Optional[HostsReader] = None) -> PodRendezvous:
    """Node rank from the task index, node count and master (the first pod) from the svc plugin's hosts;
    the port from MASTER_PORT (the manifest sets kubernetes.master_port)."""
    if not in_volcano_pod(environ):
        raise ConfigError(f"environment: {INDEX_ENV} is not set; this command runs in the pods of a Volcano Job "
                          "whose env plugin sets it (spec.plugins.env in vcjob.yaml)")
    node_rank = _int(environ, INDEX_ENV if INDEX_ENV in environ else OLD_INDEX_ENV)
    hosts = pod_hosts(environ, read_file)
    nodes = _int(environ, NUM_ENV) if environ.get(NUM_ENV) else len(hosts)
    if nodes != len(hosts) or node_rank >= nodes:
        raise ConfigError(f"environment: task index {node_rank} with {nodes} pod(s) but {len(hosts)} host(s) "
                          f"in {HOSTS_ENV}; the Volcano task must have one pod per node")
    port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    if not 1 <= port <= 65535:
        raise ConfigError(f"environment: MASTER_PORT={port} is not a TCP port")
    return PodRendezvous(node_rank=node_rank, nodes=nodes, master_addr=hosts[0], master_port=port)


_TASK_LOG = re.compile(r"^task-(\d+)\.attempt-(\d+)\.log$")


def pod_attempt(logs_dir: str | os.PathLike[str], first_slot: int) -> int:
    """This pod's attempt: one more than the newest attempt its first slot logged.

    RestartJob replaces every pod at once, and each pod counts only its own task logs (no race on the
    shared volume), so all pods of one attempt agree. Volcano keeps no restart count in the pod.
    """
    try:
        names = os.listdir(logs_dir)
    except OSError:
        return 0
    attempts = [int(m.group(2)) for name in names if (m := _TASK_LOG.match(name)) and int(m.group(1)) == first_slot]
    return max(attempts) + 1 if attempts else 0
