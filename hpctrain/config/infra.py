"""The sections about where and how the job runs: cluster, slurm, container, checkpoint, nccl, monitor, sweep."""

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, PlainValidator, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from hpctrain.config import limits as L
from hpctrain.config.base import Section, new_dict, new_list
from hpctrain.config.types import EnvName, SbatchOption, SlurmTime, Text


class Topology(Section):
    """Optional topology files; the planner parses them for NVLink islands and leaf switches."""

    nvidia_smi: Optional[Text] = Field(None, description="Path to saved `nvidia-smi topo -m` output of one node.")
    slurm_topology: Optional[Text] = Field(None, description="Path to the cluster's Slurm topology.conf.")


class GpuSpec(Section):
    """A GPU not in the catalog (or a correction to one)."""

    memory_gib: float = Field(..., gt=0, le=L.MAX_GPU_MEMORY_GIB, description="Device memory in GiB.")
    peak_tflops: float = Field(..., gt=0, le=L.MAX_GPU_TFLOPS, description="Dense bf16/fp16 tensor-core peak, TFLOP/s.")
    nvlink_gbps: float = Field(0.0, ge=0, le=L.MAX_LINK_GBPS, description="NVLink bandwidth per GPU, GB/s (one direction); 0 = none.")
    fp8_peak_tflops: Optional[float] = Field(None, ge=0, le=L.MAX_GPU_TFLOPS, description="Dense FP8 tensor-core "
                                             "peak, TFLOP/s; 0 = no FP8 (train.precision: fp8 refused); default: "
                                             "the catalog's figure for cluster.gpu, else 0.")
    mxfp8: Optional[bool] = Field(None, description="The GPU has MX block-scaled FP8 tensor cores (train.fp8.recipe "
                                  "mxfp8); default: the catalog's for cluster.gpu, else false.")


_NODE_RANGE = re.compile(r"([0-9]{1,6})\s*-\s*([0-9]{1,6})")
_NODES_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 100000},
                           {"type": "string", "pattern": r"^\s*[0-9]{1,6}\s*-\s*[0-9]{1,6}\s*$",
                            "maxLength": 32}]}


def _node_count(value: Any) -> int:
    """A whole number of nodes (a valid range string was already split by ClusterConfig._node_range)."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100000:
        return value
    raise PydanticCustomError("node_count", "expected a whole number of nodes (1-100000) or a range such as '4-8'")


class RayConfig(Section):
    """Where `cluster.executor: ray` submits (the Ray Jobs API of a running Ray cluster)."""

    address: Optional[Text] = Field(None, description="Ray dashboard address, e.g. http://head:8265; default: "
                                    "RAY_ADDRESS, else http://127.0.0.1:8265.")
    cpus_per_worker: float = Field(1.0, gt=0, le=1024, description="CPUs each worker reserves (one worker per "
                                   "GPU; on a CPU cluster, per CPU slot).")


class ClusterConfig(Section):
    """The machines: how many nodes and GPUs, which GPU, node profile and fabric."""

    executor: Literal["auto", "slurm", "local", "volcano", "ray"] = Field(
        "auto", description="slurm if sbatch is on PATH, else local; volcano: a Volcano Job on Kubernetes "
        "(needs the kubernetes section); ray: a Ray job through the Ray Jobs API (cluster.ray).")
    nodes: Annotated[int, PlainValidator(_node_count), WithJsonSchema(_NODES_SCHEMA)] = Field(1, description="Number of nodes, or a range such as '4-8' (elastic: Slurm "
                       "starts the job on any count in it and each start re-plans the layout for the nodes it got).")
    min_nodes: Optional[int] = Field(None, ge=1, le=100000, description="Elastic: the fewest nodes the job runs on "
                                     "(with max_nodes; `nodes: 4-8` sets both).")
    max_nodes: Optional[int] = Field(None, ge=1, le=100000, description="Elastic: the most nodes the job runs on.")
    gpus_per_node: int = Field(8, ge=1, le=64, description="GPUs (= tasks) per node.")
    gpu: str = Field("a100-80gb", min_length=1, max_length=L.MAX_NAME_CHARS, description="GPU catalog name (see `hpctrain plan --help`).")
    gpu_spec: Optional[GpuSpec] = Field(None, description="Override or define the GPU's figures.")
    node: Optional[str] = Field(None, min_length=1, max_length=L.MAX_NAME_CHARS, description="Node catalog profile (e.g. dgx-a100).")
    fabric: str = Field("ib-hdr200", min_length=1, max_length=L.MAX_NAME_CHARS, description="Inter-node fabric catalog name.")
    nvlink_domain_gpus: Optional[int] = Field(
        None, ge=1, le=L.MAX_WORLD, description="GPUs that NVLink joins across nodes (multi-node "
        "NVLink), counted in the job's nodes in Slurm's order: 72 on a GB200/GB300 NVL72 rack, 64 when the job takes 16 "
        "of a rack's 18 trays (sbatch --segment=16). Groups inside one domain ride NVLink. A multiple of "
        "gpus_per_node; default: the node profile's, else one node.")
    topology: Topology = Field(default_factory=lambda: Topology(),
                               description="Topology files for islands and leaf switches.")
    runtime_overhead_gib: Optional[float] = Field(None, ge=0, le=L.MAX_GPU_MEMORY_GIB, description="Per-GPU memory the planner reserves.")
    ray: RayConfig = Field(default_factory=lambda: RayConfig(), description="The Ray cluster (cluster.executor: ray).")

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, data: Any) -> Any:
        """`nodes: "4-8"` -> min_nodes 4, max_nodes 8, nodes 8 (the count planned at submit); min_nodes/max_nodes
        alone -> nodes = max_nodes. A malformed string stays in `nodes`, whose type check names it."""
        if not isinstance(data, dict):
            return data
        nodes = data.get("nodes")
        if isinstance(nodes, str):
            match = _NODE_RANGE.fullmatch(nodes.strip())
            if match and "min_nodes" not in data and "max_nodes" not in data:
                low, high = int(match.group(1)), int(match.group(2))
                return {**data, "nodes": high, "min_nodes": low, "max_nodes": high}
        elif nodes is None and isinstance(data.get("max_nodes"), int):
            return {**data, "nodes": data["max_nodes"]}
        return data

    @property
    def elastic(self) -> bool:
        """A node-count range: each start re-plans for the nodes Slurm allocated."""
        return self.min_nodes is not None and self.max_nodes is not None and self.min_nodes < self.max_nodes

    @property
    def node_counts(self) -> list[int]:
        """Every node count the job may run on (one for a fixed count)."""
        if self.min_nodes is None or self.max_nodes is None:
            return [self.nodes]
        return list(range(self.min_nodes, self.max_nodes + 1))

    @property
    def nodes_spec(self) -> str:
        """`--nodes` for sbatch: "4-8" for a range, else the count."""
        return f"{self.min_nodes}-{self.max_nodes}" if self.elastic else str(self.nodes)


SignalName = Literal["USR2", "USR1", "TERM", "INT", "HUP"]


class RestartConfig(Section):
    """The restart policy every backend follows (rundir/restart.py decides): when a stopped or crashed attempt
    starts again from the newest checkpoint, and how the ranks are warned before a time limit."""

    requeue: bool = Field(True, description="Start the job again after a preemption, a signal or a crashed rank, "
                          "within max_requeues (Slurm: scontrol requeue; Ray: a new attempt; Volcano: maxRetry). "
                          "Never after bad input (exit 2) or a second crash at the same step.")
    max_requeues: int = Field(3, ge=0, le=1000, description="Restarts allowed before giving up (Volcano: the "
                              "default of kubernetes.max_retry).")
    signal: SignalName = Field("USR2", description="Signal sent to every rank signal_seconds before the time limit "
                               "(sbatch --signal); the ranks save a checkpoint and ask for a restart. USR1 is "
                               "taken by NCCL.")
    signal_seconds: int = Field(120, ge=10, le=65535, description="How long before the time limit the signal "
                                "comes: enough for a checkpoint save and one step.")
    script_signal: SignalName = Field("TERM", description="entrypoint only: the signal every rank of your program "
                                      "gets when restart.signal (or SIGTERM) arrives; it then has grace_s to save "
                                      "and exit (exit 0 after it: saved, requeue me).")
    grace_s: int = Field(60, ge=1, le=65535, description="entrypoint only: seconds your program has after "
                         "script_signal to save and exit before it is killed (keep it below signal_seconds).")


# slurm.<old name> -> restart.<name>: still accepted (config/loader.py merges them, with a notice).
RESTART_ALIASES = ("requeue", "max_requeues", "signal", "signal_seconds")


class SlurmConfig(Section):
    """sbatch options (the restart policy is the restart section)."""

    partition: Optional[Text] = Field(None, description="--partition.")
    account: Optional[Text] = Field(None, description="--account.")
    qos: Optional[Text] = Field(None, description="--qos.")
    time: Optional[SlurmTime] = Field(None, description="--time, e.g. 04:00:00 or 2-00:00:00.")
    constraint: Optional[Text] = Field(None, description="--constraint (node features).")
    exclusive: bool = Field(True, description="--exclusive (whole nodes).")
    mem: Optional[Text] = Field(None, description="--mem, e.g. 0 (all) or 500G; unset with exclusive means all.")
    cpus_per_task: Optional[int] = Field(None, ge=1, le=1024, description="--cpus-per-task.")
    # The restart policy's old names (now the restart section): read as restart.*, with a notice (config/loader.py).
    requeue: Optional[bool] = Field(None, description="Old name of restart.requeue (read as it, with a notice).")
    signal: Optional[SignalName] = Field(None, description="Old name of restart.signal (read as it, with a notice).")
    signal_seconds: Optional[int] = Field(None, ge=10, le=65535, description="Old name of restart.signal_seconds "
                                          "(read as it, with a notice).")
    max_requeues: Optional[int] = Field(None, ge=0, le=1000, description="Old name of restart.max_requeues (read "
                                        "as it, with a notice).")
    setup: list[Text] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS, description="Shell lines run before training (module load ...). "
                             "These are shell by design: they run as written.")
    extra: dict[SbatchOption, Union[str, int, bool]] = Field(default_factory=new_dict, description="Further sbatch options.")


class RecipeConfig(Section):
    """What goes into the Singularity/Apptainer image."""

    base_image: Text = Field("docker://nvcr.io/nvidia/pytorch:24.12-py3", description="Bootstrap image (CUDA + PyTorch).")
    pip: list[Text] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS, description="Extra pip packages.")
    apt: list[Text] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS, description="Extra Debian/Ubuntu packages.")
    hpctrain: Optional[Text] = Field(None, description="pip requirement that installs hpctrain in the image, e.g. "
                                     "a VCS URL (default: the checkout hpctrain runs from, copied in by %files).")


class ContainerConfig(Section):
    """Run the ranks inside a Singularity/Apptainer image (with --nv)."""

    image: Optional[Text] = Field(None, description="Path to the .sif image; unset runs on the host.")
    binds: list[Text] = Field(default_factory=new_list, max_length=L.MAX_LIST_ITEMS, description="--bind specs, src[:dst[:opts]].")
    runtime: Literal["singularity", "apptainer"] = Field("singularity", description="Container command.")
    recipe: RecipeConfig = Field(default_factory=lambda: RecipeConfig(), description="Image recipe options.")


class RuntimeConfig(Section):
    """How each rank's process is started."""

    python: Optional[Text] = Field(None, description="Interpreter the ranks run (`PYTHON -m hpctrain.runtime`). "
                                   "Default: the one hpctrain was submitted from (sys.executable), or python3 "
                                   "inside container.image, where a host path means nothing.")
    allow_cpu: bool = Field(False, description="Train on the CPU (gloo) when a rank finds no usable CUDA device "
                            "although cluster.gpu names a GPU, e.g. to try a GPU job on a laptop (~1000x slower). "
                            "Default: such a rank stops before its first step (exit 2) saying why. Not needed "
                            "with cluster.gpu: cpu.")


class CheckpointConfig(Section):
    """Distributed checkpoints (torch.distributed.checkpoint) in step-N/ folders."""

    dir: Optional[Text] = Field(None, description="Checkpoint folder; default <run dir>/checkpoints.")
    every_steps: int = Field(100, ge=1, le=L.MAX_STEPS, description="Save every N steps (and on signal / at the end).")
    keep_last: int = Field(2, ge=1, le=L.MAX_CHECKPOINTS_KEPT, description="Complete checkpoints to keep.")
    async_: bool = Field(False, alias="async", description="Save in a background thread (DCP async_save).")
    final: bool = Field(True, description="Save a checkpoint after the last step (a stop on a signal always "
                        "saves). false: only the every_steps ones, e.g. for a benchmark whose final save would "
                        "take longer than its steps (HPCTRAIN_FINAL_CHECKPOINT=0 is read as false too).")
    adopt: bool = Field(False, description="Continue from checkpoints another run wrote in dir (refused "
                        "otherwise: a checkpoint folder belongs to one run); this run then owns the folder.")


class NcclConfig(Section):
    """NCCL environment for the fabric."""

    profile: Literal["auto", "ib", "roce", "ethernet", "none"] = Field("auto", description="Tuning profile.")
    socket_ifname: Optional[Text] = Field(None, description="NCCL_SOCKET_IFNAME (bootstrap/socket interface).")
    ib_hca: Optional[Text] = Field(None, description="NCCL_IB_HCA (which HCAs to use).")
    env: dict[EnvName, Text] = Field(default_factory=new_dict, description="Extra or overriding environment variables.")


TrackerName = Literal["none", "tensorboard", "wandb", "mlflow"]


class MonitorConfig(Section):
    """Optional monitors around the training processes."""

    nvidia_smi: bool = Field(False, description="Per-node nvidia-smi CSV every interval.")
    nvidia_smi_interval_s: int = Field(5, ge=1, le=3600, description="nvidia-smi sampling interval.")
    nsys: bool = Field(False, description="Wrap the ranks in `nsys profile` for nsys_steps.")
    nsys_steps: list[Annotated[int, Field(ge=0, le=L.MAX_STEPS)]] = Field([10, 12], min_length=2, max_length=2, description="[first, last] profiled step.")
    torch_profiler: bool = Field(False, description="PyTorch profiler traces for a few steps.")
    py_spy: bool = Field(False, description="py-spy dump of every rank when the job nears its limit.")
    py_spy_seconds_before_limit: int = Field(300, ge=10, le=L.MAX_SECONDS, description="When to dump.")
    tracker: Union[TrackerName, Annotated[list[TrackerName], Field(max_length=8)]] = Field(
        "none", description="Experiment trackers fed by rank 0 from the metrics.jsonl records: none, tensorboard "
        "(event files in <run dir>/tensorboard), wandb, mlflow; one name or a list. Each needs its package "
        "(pip install 'hpctrain[tensorboard]' / '[wandb]' / '[mlflow]').")
    wandb_project: Optional[Text] = Field(None, description="W&B project; default: the job name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline (compute nodes rarely reach the internet; `wandb sync` the "
        "run's wandb/ folder later) or online.")
    mlflow_tracking_uri: Optional[Text] = Field(None, description="MLflow tracking URI; default: a file store in "
                                                "<run dir>/mlruns.")
    mlflow_experiment: Optional[Text] = Field(None, description="MLflow experiment name; default: the job name.")

    @property
    def trackers(self) -> list[str]:
        """The trackers asked for, without 'none', each once, in the order given."""
        names = [self.tracker] if isinstance(self.tracker, str) else list(self.tracker)
        return [n for i, n in enumerate(names) if n != "none" and n not in names[:i]]


class SweepConfig(Section):
    """A grid over dotted job keys, submitted as one job array."""

    grid: dict[Text, Annotated[list[Any], Field(max_length=L.MAX_GRID_POINTS)]] = Field(..., min_length=1, max_length=L.MAX_GRID_KEYS, description="Dotted key -> list of values.")
    max_parallel: int = Field(4, ge=1, le=100000, description="Array tasks running at once (%K).")
