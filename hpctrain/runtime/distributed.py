"""Who am I and where is rank 0: rank, world size, local rank and the rendezvous address.

Three launchers are recognised, in this order:

1. torchrun (or anything that sets RANK and WORLD_SIZE): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
   MASTER_PORT are used as given. torchrun inside an srun step also sets SLURM_PROCID (the node's
   task, not the process), so torchrun's variables win.
2. srun, one task per GPU: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the first host of
   SLURM_JOB_NODELIST (expanded with python-hostlist, else `scontrol show hostnames`), the port
   MASTER_PORT if set, else derived from SLURM_JOB_ID and SLURM_RESTART_COUNT (`port_for_job`), so
   every rank computes the same port without talking and a requeued attempt does not meet the
   previous attempt's sockets in TIME_WAIT.
3. A Volcano pod (VC_TASK_INDEX, hpctrain/rundir/volcano.py): the pod launcher (hpctrain/launch/volcano/pod.py)
   gives each rank torchrun's variables, so case 1 applies with launcher "volcano" and the attempt
   from HPCTRAIN_ATTEMPT; a pod started without the launcher is one rank: node rank = task index,
   world = the svc plugin's host count, master = its first host.
4. Otherwise a single process.

`detect_env` is a pure function of the environment mapping (table-tested); `init_distributed`
joins the process group: NCCL on GPUs, gloo on CPU. Nothing here imports torch at module level.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.ports import master_port
from hpctrain.rundir.ranks import ATTEMPT_ENV, check_rank_order, global_rank
from hpctrain.rundir.volcano import in_volcano_pod, pod_rendezvous

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm", "volcano" or "single"
    attempt: int = 0  # the run directory's attempt (HPCTRAIN_ATTEMPT), else SLURM_RESTART_COUNT


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment: {name}={value!r} is not an integer; the launcher set it wrongly "
                          "(unset it, or launch with srun / torchrun)") from None


def port_for_job(job_id: str, restart_count: int = 0) -> int:
    """A rendezvous port every rank of a Slurm job derives alike: the one formula, rundir.ports.master_port
    (the batch script computes the same one)."""
    return master_port(job_id, restart_count)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as 'gpu[003-005,9],login1'."""
    try:
        import hostlist  # python-hostlist

        hosts = hostlist.expand_hostlist(nodelist)
    except ImportError:  # pragma: no cover - python-hostlist is a dependency; scontrol is the fallback
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=False, timeout=30)
        hosts = out.stdout.split()
    except Exception as exc:  # hostlist raises its own BadHostlist
        raise ConfigError(f"environment: SLURM_JOB_NODELIST={nodelist!r} cannot be expanded ({exc})") from None
    if not hosts:
        raise ConfigError(f"environment: SLURM_JOB_NODELIST={nodelist!r} names no host")
    return str(hosts[0])


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank, world size and rendezvous from torchrun's or Slurm's variables, or a single process."""
    env = os.environ if environ is None else environ
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    attempt = run_attempt(env, restarts)
    if in_volcano_pod(env):
        return _volcano_env(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            launcher="torchrun",
            attempt=attempt,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        port = (_int(env, "MASTER_PORT") if "MASTER_PORT" in env
                else port_for_job(env.get("SLURM_JOB_ID", "0"), restarts))
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
            master_port=port,
            launcher="slurm",
            attempt=attempt,
        )
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                   launcher="single", attempt=attempt)


def run_attempt(env: Mapping[str, str], default: int = 0) -> int:
    """The attempt this start is, as its launcher counted it from the run directory (HPCTRAIN_ATTEMPT: the
    local supervisor, the Ray driver, a Volcano pod and the batch script set it; the logs are named by it),
    else `default` (SLURM_RESTART_COUNT under a bare srun or torchrun)."""
    return _int(env, ATTEMPT_ENV) if env.get(ATTEMPT_ENV) else default


def _volcano_env(env: Mapping[str, str]) -> DistEnv:
    """A rank in a Volcano pod: the pod launcher's torchrun variables, or the pod itself as one rank."""
    attempt = run_attempt(env)
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return DistEnv(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                       local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                       master_addr=env["MASTER_ADDR"], master_port=_int(env, "MASTER_PORT"),
                       launcher="volcano", attempt=attempt)
    pod = pod_rendezvous(env)
    return DistEnv(rank=pod.node_rank, world_size=pod.nodes, local_rank=0, master_addr=pod.master_addr,
                   master_port=pod.master_port, launcher="volcano", attempt=attempt)


def place_rank(env: DistEnv, rank_order: Optional[list[int]], gpus_per_node: int) -> DistEnv:
    """The global rank this process takes: rank_order[slot] from the planner's placement.

    The launcher's rank is the slot (SLURM_PROCID = node * gpus_per_node + local GPU); the planner
    orders slots so that TP peers share an NVLink island and pipelines stay on few nodes
    (plan/placement.py). The mesh itself stays `arange(world).view(pp, dp, tp)`: c10d sorts the
    ranks of every subgroup, so permuting the mesh instead would hand DTensor the wrong shards.
    Rank 0 must stay on the first node, where MASTER_ADDR points.
    """
    if not rank_order or env.world_size == 1:
        return env
    check_rank_order(rank_order, env.world_size, gpus_per_node)
    return dataclasses.replace(env, rank=global_rank(env.rank, rank_order))


def _gpu_index(local_rank: int, visible: int) -> int:
    """This rank's GPU: the local_rank-th of its node's GPUs (the rendered srun shows every task
    all of them, keeping peer-to-peer), or the only one when a launcher bound one GPU per task;
    never two ranks on one GPU by wrap-around."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ConfigError(f"environment: local rank {local_rank} but only {visible} GPU(s) visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          "start one task per GPU (cluster.gpus_per_node)")
    return local_rank


def check_env(env: DistEnv) -> None:
    """Reject impossible launcher values with a message naming them."""
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ConfigError(f"environment: rank {env.rank} of world size {env.world_size} is impossible "
                          f"(from {env.launcher}'s variables)")
    if not 1 <= env.master_port <= 65535 and env.world_size > 1:
        raise ConfigError(f"environment: MASTER_PORT={env.master_port} is not a TCP port")


def default_omp_threads(environ: Any = None) -> None:
    """OMP_NUM_THREADS=1 unless the launcher chose (torchrun sets it; srun does not). Before torch."""
    env = os.environ if environ is None else environ
    env.setdefault("OMP_NUM_THREADS", "1")


def no_cuda_reason(cuda_build: Optional[str], device_count: int, environ: Mapping[str, str]) -> Optional[str]:
    """Why this process has no usable CUDA device (None: it has one). A pure function, table-tested.

    cuda_build: torch.version.cuda (None for a CPU-only wheel); device_count: the devices torch sees.
    """
    if cuda_build is None:
        return "this torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of torch"
    if device_count > 0:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process; unset it or let the "
                "launcher set it (srun --gpus-per-node)")
    where = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES is unset"
    return (f"torch (CUDA {cuda_build}) sees no CUDA device ({where}); check the node has GPUs, the driver "
            "loads (nvidia-smi) and the job asked the scheduler for them")


def check_device(gpu: str, allow_cpu: bool, cuda_build: Optional[str], device_count: int,
                 environ: Mapping[str, str]) -> None:
    """A job whose cluster.gpu names a GPU must not train on the CPU without being told to (ConfigError,
    exit 2, before any step): a CPU torch or a wrong CUDA_VISIBLE_DEVICES would make it ~1000x slower."""
    if gpu == "cpu" or allow_cpu:
        return
    reason = no_cuda_reason(cuda_build, device_count, environ)
    if reason is not None:
        raise ConfigError(f"cluster.gpu: {gpu!r} but this rank has no usable CUDA device: {reason}; to train "
                          "on the CPU on purpose set cluster.gpu: cpu or runtime.allow_cpu: true")


# FP8 tensor cores: compute capability 8.9 (Ada) and 9.0+ (Hopper, Blackwell); torch._scaled_mm needs them
# (CUDA C++ Programming Guide, "Compute Capabilities": FP8 tensor-core support starts at 8.9).
FP8_MIN_CAPABILITY = (8, 9)
# MX block-scaled FP8 (train.fp8.recipe mxfp8): the block-scaled tcgen05 MMA of data-center Blackwell, sm_100
# (B200, GB200) and sm_103 (B300, GB300) (PTX ISA, tcgen05.mma "kind::mxf8f6f4 ... block_scale", sm_100a/sm_103a);
# torchao's MX training kernels are built for those ("AUTO = best sm100 kernel", torchao mxfp8_linear.py).
# Other Blackwell parts (sm_110, sm_120) are not among them: refused rather than guessed.
MXFP8_CAPABILITY_MAJOR = 10


def fp8_device_reason(device_type: str, capability: Optional[tuple[int, int]], recipe: str = "tensorwise"
                      ) -> Optional[str]:
    """Why this rank cannot run the recipe's fp8 GEMMs (None: it can). A pure function, table-tested."""
    if device_type != "cuda":
        return f"this rank runs on the {device_type}, which has no FP8 tensor cores"
    got = f"sm_{capability[0]}{capability[1]}" if capability else "an unknown GPU"
    if capability is None or capability < FP8_MIN_CAPABILITY:
        return f"this rank's GPU is {got}; FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper)"
    if recipe == "mxfp8" and capability[0] != MXFP8_CAPABILITY_MAJOR:
        return (f"this rank's GPU is {got}; recipe mxfp8 needs MX block-scaled tensor cores, compute capability "
                "10.x (B200, B300, GB200, GB300)")
    return None


def check_fp8_device(precision: str, emulate: bool, device_type: str, capability: Optional[tuple[int, int]],
                     recipe: str = "tensorwise") -> None:
    """train.precision fp8 without emulation on a device without the recipe's FP8 tensor cores: ConfigError (exit
    2), before any step; validate refuses such GPU types from the catalog already (plan/hardware.py)."""
    if precision != "fp8" or emulate:
        return
    reason = fp8_device_reason(device_type, capability, recipe)
    if reason is not None:
        raise ConfigError(f"train.precision: fp8 but {reason}; set train.precision: bf16, or train.fp8.emulate: "
                          "true for tests and CPU checks (torchao's emulation, slower than bf16)")


def torch_build() -> dict[str, Any]:
    """The torch this rank runs: {"torch": torch.__version__, "cuda": torch.version.cuda (None: CPU build)}."""
    import torch

    return {"torch": str(torch.__version__), "cuda": torch.version.cuda}


def init_distributed(env: DistEnv, need_group: bool = False, *, gpu: str = "cpu", allow_cpu: bool = True) -> Any:
    """Join the process group (NCCL on GPUs, gloo on CPU) and return this rank's torch.device.

    `gpu` (cluster.gpu) names a GPU and `allow_cpu` is false: a rank without a usable CUDA device raises
    ConfigError (check_device) instead of falling back to the CPU. A single process gets a process group
    only when `need_group` (e.g. FSDP for optimizer offload); it then rendezvous through an in-memory
    store, no port needed.
    """
    import datetime

    import torch
    import torch.distributed as dist

    available = torch.cuda.is_available()
    check_device(gpu, allow_cpu, torch.version.cuda, torch.cuda.device_count() if available else 0, os.environ)
    if available:
        device = torch.device("cuda", _gpu_index(env.local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if env.world_size == 1 and not need_group:
        return device
    timeout = datetime.timedelta(seconds=float(os.environ.get("HPCTRAIN_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    kwargs: dict[str, Any] = {"backend": backend, "rank": env.rank, "world_size": env.world_size,
                              "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device
    if env.world_size == 1:
        kwargs["store"] = dist.HashStore()
    else:
        kwargs["init_method"] = f"tcp://{_bracket(env.master_addr)}:{env.master_port}"
    dist.init_process_group(**kwargs)
    return device


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def barrier() -> None:
    """dist.barrier() when there is a process group; nothing for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
