"""The `kubernetes:` section: where and how a `cluster.executor: volcano` job runs as a Volcano Job.

Names Kubernetes itself validates (namespace, queue, priority class, claim name, label keys and
values, resource names) are checked here with the API server's own patterns, so a typo fails at
`hpctrain validate` with the field's name rather than at `kubectl create`. Free text (the image,
annotation values, paths) is data in the manifest: hpctrain/render/vcjob.py dumps it with
yaml.safe_dump, never through a template.
"""

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

from pydantic import Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from hpctrain.config import limits as L
from hpctrain.config.base import Section, new_dict, new_list
from hpctrain.config.types import Text

# k8s.io/apimachinery/pkg/util/validation/validation.go: IsDNS1123Label, IsDNS1123Subdomain,
# IsQualifiedName (label and annotation keys), IsValidLabelValue.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_QUALIFIED = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
              r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _name_type(pattern: str, max_length: int, what: str, example: str) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise PydanticCustomError("k8s_name", "expected a string")
        name_part = value.rsplit("/", 1)[-1] if what.startswith("a label key") else value
        # re.match compiles the pattern at the first check (and keeps it): a job without a kubernetes section
        # does not pay for compiling these four at import (issue 23 item 8)
        if not re.match(pattern, value) or len(name_part) > max_length:
            raise PydanticCustomError("k8s_name", f"must be {what} (at most {max_length} characters), e.g. {example}")
        return value

    schema = {"type": "string", "pattern": pattern, "maxLength": max_length + (253 if "key" in what else 0)}
    return Annotated[str, PlainValidator(check), WithJsonSchema(schema)]


if TYPE_CHECKING:  # pydantic types built at run time (_name_type); mypy sees the strings they hold
    DnsLabel = str
    DnsSubdomain = str
    QualifiedName = str
    LabelValue = str
else:
    DnsLabel = _name_type(_DNS_LABEL, 63, "a DNS-1123 label (lower-case letters, digits and '-')", "'ml-team'")
    DnsSubdomain = _name_type(_DNS_SUBDOMAIN, 253, "a DNS-1123 subdomain (lower-case letters, digits, '-' and '.')",
                              "'high-priority'")
    QualifiedName = _name_type(_QUALIFIED, 63, "a label key: [prefix/]name of letters, digits, '-', '_', '.'",
                               "'nvidia.com/gpu.product'")
    LabelValue = _name_type(_LABEL_VALUE, 63, "a label value: letters, digits, '-', '_', '.' (or empty)",
                            "'NVIDIA-H100-80GB-HBM3'")


class PvcConfig(Section):
    """The PersistentVolumeClaim that holds the run directory and the checkpoints (shared by all pods)."""

    claim_name: DnsSubdomain = Field(..., description="Name of an existing PersistentVolumeClaim (ReadWriteMany) "
                                     "in kubernetes.namespace.")
    mount_path: Text = Field("/runs", description="Where the claim is mounted in every pod; the run directory "
                             "is <mount_path>/<job name> unless `hpctrain render --run-dir` says otherwise.")


class Toleration(Section):
    """One pod toleration (core/v1 Toleration)."""

    key: Optional[QualifiedName] = Field(None, description="Taint key; unset with operator Exists matches every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists: any value; Equal: value must match.")
    value: Optional[LabelValue] = Field(None, description="Taint value (operator Equal).")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        None, description="Taint effect to tolerate; unset tolerates every effect.")
    toleration_seconds: Optional[int] = Field(None, ge=0, le=L.MAX_SECONDS, description="With effect NoExecute: how long the pod "
                                              "stays bound after the taint appears.")


class KubernetesConfig(Section):
    """Kubernetes with Volcano (cluster.executor: volcano): the Job's namespace, queue, image and volumes."""

    namespace: DnsLabel = Field("default", description="Namespace the Volcano Job is created in.")
    queue: DnsSubdomain = Field("default", description="Volcano queue (spec.queue).")
    image: Text = Field(..., description="OCI image of the pods; it must contain python3 with hpctrain and torch.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="core/v1 imagePullPolicy of the container.")
    priority_class: Optional[DnsSubdomain] = Field(None, description="PriorityClass of the Job "
                                                   "(spec.priorityClassName); unset: the cluster's default.")
    pvc: PvcConfig = Field(..., description="Shared volume for the run directory and checkpoints.")
    node_selector: dict[QualifiedName, LabelValue] = Field(default_factory=new_dict, max_length=L.MAX_LIST_ITEMS,
                                                           description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS,
                                          description="Taints the pods tolerate.")
    annotations: dict[QualifiedName, Text] = Field(default_factory=new_dict, max_length=L.MAX_LIST_ITEMS,
                                                   description="Extra pod annotations (values are free text).")
    service_account: Optional[DnsSubdomain] = Field(None, description="ServiceAccount of the pods; unset: "
                                                    "the namespace's default.")
    max_retry: Optional[int] = Field(None, ge=0, le=1000, description="Job restarts Volcano allows "
                                     "(spec.maxRetry); unset: restart.max_requeues.")
    gpu_resource: QualifiedName = Field("nvidia.com/gpu", description="Extended resource name of a GPU "
                                        "(cluster.gpus_per_node of them per pod).")
    rdma_resource: Optional[QualifiedName] = Field(None, description="Extended resource of an RDMA/IB device "
                                                   "(e.g. rdma/hca_shared_devices_a), requested when the fabric "
                                                   "is InfiniBand or RoCE; unset: none requested.")
    rdma_per_pod: int = Field(1, ge=1, le=64, description="How many rdma_resource devices each pod requests.")
    shm_size_gib: Optional[float] = Field(None, gt=0, le=L.MAX_GPU_MEMORY_GIB, description="sizeLimit of the memory-backed /dev/shm; "
                                          "unset: no limit (NCCL and data loaders use it).")
    termination_grace_s: int = Field(120, ge=1, le=L.MAX_SECONDS, description="Seconds from SIGTERM to SIGKILL "
                                     "when a pod is deleted or evicted (terminationGracePeriodSeconds): time for "
                                     "the ranks to save a checkpoint.")
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the first pod (each "
                             "attempt gets new pods, so a fixed port is safe).")
