"""NCCL environment per fabric profile. Each variable carries the reason it is set (or left unset),
which the script prints as a comment above it. `nccl.socket_ifname`, `nccl.ib_hca` and `nccl.env`
in job.yaml override any of them.

Sources: NCCL environment variables documentation (docs.nvidia.com/deeplearning/nccl/user-guide/
docs/env.html, NCCL 2.23); PyTorch ProcessGroupNCCL environment variables (torch 2.6 docs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from hpctrain.config import Job


@dataclass(frozen=True)
class NcclVar:
    """One variable: its value (None = deliberately left unset), or a file under the task dir."""

    name: str
    value: Optional[str]
    why: str
    under_task_dir: bool = False  # value is a path suffix appended to "$TASK_DIR" at run time


COMMON = (
    NcclVar("NCCL_DEBUG", "WARN", "NCCL logs warnings only: enough to see why a communicator failed; "
            "set INFO in nccl.env to debug transports"),
    NcclVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a NCCL error or timeout aborts the communicator and "
            "ends the rank, so --kill-on-bad-exit stops the step and the exit path can requeue instead "
            "of hanging until the time limit"),
    NcclVar("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "keeps the last 2000 collectives per rank in the "
            "NCCL flight recorder, to show which rank stopped first when a collective times out"),
    NcclVar("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "writes the flight recorder to a file when a "
            "collective times out"),
    NcclVar("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/nccl-flight-recorder-rank-", "where the flight "
            "recorder dumps go: one file per rank in the run directory", under_task_dir=True),
)

_RDMA_COMMON = (
    NcclVar("NCCL_SOCKET_IFNAME", "^lo,docker", "bootstrap and socket traffic on any interface but "
            "loopback and docker bridges; set nccl.socket_ifname to pin one (e.g. ib0)"),
    NcclVar("NCCL_IB_HCA", None, "every active HCA is used; set nccl.ib_hca (e.g. '=mlx5_0,mlx5_1') "
            "to leave out storage or management ports"),
    NcclVar("NCCL_NET_GDR_LEVEL", "PHB", "GPUDirect RDMA whenever GPU and NIC share a PCIe host bridge, "
            "as on DGX/HGX boards where each NIC sits beside its GPUs; stops a cross-socket NIC from "
            "reading GPU memory over the inter-CPU link"),
    NcclVar("NCCL_ALGO", None, "NCCL's tuner chooses Ring or Tree per message size; forcing one is "
            "slower for the other sizes"),
)

PROFILES: dict[str, tuple[NcclVar, ...]] = {
    "ib": _RDMA_COMMON,
    "roce": _RDMA_COMMON + (
        NcclVar("NCCL_IB_GID_INDEX", None, "NCCL >= 2.21 picks the RoCE v2 GID itself; set it in "
                "nccl.env (often 3, see `show_gids`) for older NCCL"),
        NcclVar("NCCL_IB_TC", None, "the lossless traffic class is site-specific; set it in nccl.env "
                "if the switches reserve one for RDMA"),
    ),
    "ethernet": (
        NcclVar("NCCL_SOCKET_IFNAME", "^lo,docker", "socket transport on any interface but loopback and "
                "docker bridges; set nccl.socket_ifname to pin the fast one (e.g. eth0)"),
        NcclVar("NCCL_IB_DISABLE", "1", "no RDMA on this fabric: stops NCCL from trying a management "
                "HCA it may find"),
        NcclVar("NCCL_SOCKET_NTHREADS", "2", "one TCP stream cannot fill a 100 GbE link: 2 helper "
                "threads per connection ..."),
        NcclVar("NCCL_NSOCKS_PERTHREAD", "4", "... with 4 sockets each give 8 streams (NCCL caps the "
                "product at 64)"),
        NcclVar("NCCL_BUFFSIZE", "8388608", "8 MiB buffers (default 4 MiB) halve the number of socket "
                "round trips per large all-reduce chunk"),
        NcclVar("NCCL_ALGO", None, "NCCL's tuner chooses Ring or Tree per message size"),
    ),
    "none": (),
}

# Fabric names outside the planner's catalog: the profile from the name's first word.
_PREFIX_PROFILE = (("ib", "ib"), ("infiniband", "ib"), ("roce", "roce"), ("eth", "ethernet"),
                   ("tcp", "ethernet"))


def profile_name(job: Job) -> str:
    """The profile for the job: nccl.profile, or for `auto` the fabric's profile in the catalog."""
    if job.nccl.profile != "auto":
        return str(job.nccl.profile)
    fabric = str(job.cluster.fabric)
    try:
        from hpctrain.plan.hardware import FABRICS

        if fabric in FABRICS:
            return str(FABRICS[fabric].nccl_profile)
    except (ImportError, AttributeError):  # the planner's catalog is optional for rendering
        pass
    lowered = fabric.lower()
    return next((profile for prefix, profile in _PREFIX_PROFILE if lowered.startswith(prefix)), "none")


def nccl_environment(job: Job) -> tuple[str, list[NcclVar]]:
    """(profile name, variables in script order): profile defaults, then job.yaml's values over them."""
    profile = profile_name(job)
    table: dict[str, NcclVar] = {v.name: v for v in COMMON + PROFILES[profile]}
    fields = {"NCCL_SOCKET_IFNAME": ("nccl.socket_ifname", job.nccl.socket_ifname),
              "NCCL_IB_HCA": ("nccl.ib_hca", job.nccl.ib_hca)}
    user = {name: (where, value) for name, (where, value) in fields.items() if value is not None}
    user.update({name: (f"nccl.env.{name}", value) for name, value in job.nccl.env.items()})
    for name, (where, value) in user.items():
        default = table.get(name)
        was = f" (profile {profile}: {default.value})" if default and default.value is not None else ""
        table[name] = NcclVar(name, str(value), f"set by {where} in job.yaml{was}")
    return profile, list(table.values())
