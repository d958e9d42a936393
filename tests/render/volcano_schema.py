"""A JSON Schema (draft 2020-12) of the Volcano Job API, for the parts of it hpctrain writes.

Written from the API's Go types, not from our renderer:
- volcano-sh/apis pkg/apis/batch/v1alpha1/job.go (commit 032c8b66): Job, JobSpec, TaskSpec,
  LifecyclePolicy (json tags give the field names; int32 fields are integers);
- volcano-sh/apis pkg/apis/bus/v1alpha1/events.go (the kubebuilder Enum of Event) and actions.go
  (the Action constants a user may set: those above "only used internally");
- k8s.io/api core/v1 types.go: ObjectMeta (name, namespace, labels, annotations), PodTemplateSpec,
  PodSpec, Container, EnvVar, ResourceRequirements, VolumeMount, Volume (persistentVolumeClaim,
  emptyDir), Toleration, with the enums PullPolicy, RestartPolicy, StorageMedium,
  TolerationOperator and TaintEffect; name patterns from apimachinery's validation.go.
Every object has additionalProperties false, so a misspelt or invented field fails. Objects of core/v1
list only the fields hpctrain may write (a subset of the real type: a field outside it fails here and
must be added from types.go, never guessed).
"""

from __future__ import annotations

from typing import Any

DNS_LABEL = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
DNS_SUBDOMAIN = {"type": "string", "maxLength": 253,
                 "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
QUALIFIED_NAME = {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"}
LABEL_VALUE = {"type": "string", "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"}
INT32 = {"type": "integer", "minimum": -2147483648, "maximum": 2147483647}
NON_NEGATIVE_INT32 = {"type": "integer", "minimum": 0, "maximum": 2147483647}
# resource.Quantity: an integer, or a string such as "64Gi", "500m", "1e3".
QUANTITY = {"anyOf": [{"type": "integer", "minimum": 0},
                      {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"}]}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# events.go: +kubebuilder:validation:Enum=*;PodFailed;PodEvicted;Unknown;TaskCompleted;OutOfSync;CommandIssued;
#                                          JobUpdated;TaskFailed
EVENTS = ["*", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted", "OutOfSync", "CommandIssued", "JobUpdated",
          "TaskFailed"]
# actions.go: the actions a Job may name (SyncJob, EnqueueJob, SyncQueue, OpenQueue, CloseQueue are internal).
ACTIONS = ["AbortJob", "RestartJob", "RestartTask", "TerminateJob", "CompleteJob", "ResumeJob", "ManualResumeJob"]


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


OBJECT_META = _object({"name": DNS_SUBDOMAIN, "namespace": DNS_LABEL,
                       "labels": {"type": "object", "propertyNames": QUALIFIED_NAME,
                                  "additionalProperties": LABEL_VALUE},
                       "annotations": {"type": "object", "propertyNames": QUALIFIED_NAME,
                                       "additionalProperties": {"type": "string"}}})
ENV_VAR = _object({"name": {"type": "string", "pattern": "^[-._a-zA-Z][-._a-zA-Z0-9]*$"},
                   "value": {"type": "string"}}, ("name",))
CONTAINER = _object({
    "name": DNS_LABEL,
    "image": {"type": "string"},
    "imagePullPolicy": {"enum": ["Always", "Never", "IfNotPresent"]},
    "command": {"type": "array", "items": {"type": "string"}},
    "args": {"type": "array", "items": {"type": "string"}},
    "workingDir": {"type": "string"},
    "env": {"type": "array", "items": ENV_VAR},
    "resources": _object({"limits": {"type": "object", "propertyNames": QUALIFIED_NAME,
                                     "additionalProperties": QUANTITY},
                          "requests": {"type": "object", "propertyNames": QUALIFIED_NAME,
                                       "additionalProperties": QUANTITY}}),
    "volumeMounts": {"type": "array", "items": _object({
        "name": DNS_LABEL, "mountPath": {"type": "string", "pattern": "^/[^:]*$"}, "readOnly": {"type": "boolean"},
        "subPath": {"type": "string"}}, ("name", "mountPath"))},
}, ("name",))
VOLUME = {**_object({
    "name": DNS_LABEL,
    "persistentVolumeClaim": _object({"claimName": DNS_SUBDOMAIN, "readOnly": {"type": "boolean"}}, ("claimName",)),
    "emptyDir": _object({"medium": {"anyOf": [{"enum": ["", "Memory", "HugePages"]},
                                              {"type": "string", "pattern": "^HugePages-"}]},
                         "sizeLimit": QUANTITY}),
}, ("name",)), "minProperties": 2, "maxProperties": 2}  # a name and exactly one volume source
TOLERATION = _object({"key": QUALIFIED_NAME, "operator": {"enum": ["Exists", "Equal"]}, "value": LABEL_VALUE,
                      "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                      "tolerationSeconds": {"type": "integer"}})
POD_SPEC = _object({
    "containers": {"type": "array", "items": CONTAINER, "minItems": 1},
    "volumes": {"type": "array", "items": VOLUME},
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
    "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
    "serviceAccountName": DNS_SUBDOMAIN,
    "nodeSelector": {"type": "object", "propertyNames": QUALIFIED_NAME, "additionalProperties": LABEL_VALUE},
    "tolerations": {"type": "array", "items": TOLERATION},
    "schedulerName": {"type": "string"},
    "priorityClassName": DNS_SUBDOMAIN,
}, ("containers",))
# LifecyclePolicy: event, events, exitCode, action, timeout; "only one of Event or ExitCode" (job.go);
# exit code 0 is refused by Volcano's admission webhook.
POLICY = {**_object({"action": {"enum": ACTIONS}, "event": {"enum": EVENTS},
                     "events": {"type": "array", "items": {"enum": EVENTS}, "minItems": 1},
                     "exitCode": {**INT32, "not": {"const": 0}},
                     "timeout": {"type": "string"}}, ("action",)),
          "not": {"anyOf": [{"required": ["event", "exitCode"]}, {"required": ["events", "exitCode"]}]}}
TASK = _object({
    "name": DNS_LABEL,
    "replicas": NON_NEGATIVE_INT32,
    "minAvailable": NON_NEGATIVE_INT32,
    "template": _object({"metadata": OBJECT_META, "spec": POD_SPEC}),
    "policies": {"type": "array", "items": POLICY},
    "topologyPolicy": {"enum": ["none", "best-effort", "restricted", "single-numa-node"]},
    "maxRetry": NON_NEGATIVE_INT32,
}, ("name", "replicas", "template"))
JOB_SPEC = _object({
    "schedulerName": {"type": "string"},
    "minAvailable": NON_NEGATIVE_INT32,
    "volumes": {"type": "array"},
    "tasks": {"type": "array", "items": TASK, "minItems": 1},
    "policies": {"type": "array", "items": POLICY},
    "plugins": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
    "runningEstimate": {"type": "string"},
    "queue": {"type": "string"},
    "maxRetry": NON_NEGATIVE_INT32,
    "ttlSecondsAfterFinished": INT32,
    "priorityClassName": DNS_SUBDOMAIN,
    "minSuccess": {**INT32, "minimum": 1},
})
VOLCANO_JOB_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Volcano Job (batch.volcano.sh/v1alpha1), the fields hpctrain writes",
    **_object({"apiVersion": {"const": "batch.volcano.sh/v1alpha1"}, "kind": {"const": "Job"},
               "metadata": {**OBJECT_META, "required": ["name"],
                            "properties": {**OBJECT_META["properties"], "name": DNS_LABEL}},
               "spec": JOB_SPEC}, ("apiVersion", "kind", "metadata", "spec")),
}
