"""The parallel degrees of a run and the device mesh they span.

`ParallelDims` is a plain dataclass: it validates the degrees against the world size without a
process group (so tests and the planner-facing code can check a layout cheaply) and builds the
`DeviceMesh` only when asked. The rank grid is `arange(world).view(pp, dp, tp)`: tp is innermost so
tensor-parallel peers are neighbouring ranks (same node, fastest links), pp is outermost.
With context parallelism (cp > 1) the grid is `arange(world).view(pp, dp, cp, tp)`, torchtitan's order
(torchtitan/distributed/parallel_dims.py: cp between the data-parallel dims and tp), and the mesh is 4-D
("pp", "dp", "cp", "tp"); FSDP shards over the flattened ("dp", "cp") dim, "dp_cp" (runtime/parallel/context.py).

Expert parallelism borrows its ranks from a stage's dp x cp x tp ranks (Megatron-Core's "MoE parallel folding":
the attention's cp is folded into the experts' grouping, megatron/core/transformer/moe/README.md "MoE Parallel
Folding"; the expert grid of megatron/core/parallel_state.py spans the same ranks with cp=1): ep divides
dp x cp x tp, and an ep group is ep consecutive ranks of the flattened (dp, cp, tp) grid, tp innermost
(runtime/parallel/expert.py); the routed experts are FSDP-sharded over the other efsdp = dp x cp x tp / ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpctrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hpctrain.config import Job

MESH_DIM_NAMES = ("pp", "dp", "tp")
CP_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")  # cp > 1 only: a run without context parallelism keeps the 3-D mesh


def _degree_problems(degrees: dict[str, object]) -> list[str]:
    """One message per degree that is not an integer >= 1."""
    problems = []
    for name, value in degrees.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(
                f"parallel.{name}: got {value!r}; must be an integer >= 1 "
                "(resolve 'auto' with `hpctrain plan` before starting the runtime)"
            )
    return problems


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data and tensor parallelism; `pp * dp * tp == world_size`."""

    pp: int
    dp: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallelism borrows its ranks from dp, cp and tp: dp x cp x tp = efsdp x ep (expert.py)
    cp: int = 1  # context parallelism: ranks of its own, pp * dp * cp * tp == world_size (runtime/parallel/context.py)

    def __post_init__(self) -> None:
        problems = _degree_problems({name: getattr(self, name) for name in ("pp", "dp", "tp", "world_size", "ep", "cp")})
        if problems:
            raise ConfigError(problems)
        region = self.dp * self.cp * self.tp
        if region % self.ep:
            cp = " x parallel.cp" if self.cp > 1 else ""
            raise ConfigError(f"parallel.ep: got {self.ep}; must divide parallel.dp{cp} x parallel.tp = {region} "
                              f"(expert parallelism borrows its ranks from dp{', cp' if self.cp > 1 else ''} and tp); "
                              f"use a divisor of {region}")
        if self.ep > 1 and self.ep % self.tp:
            raise ConfigError(f"parallel.ep: got {self.ep}; must be a multiple of parallel.tp={self.tp} "
                              "(the experts are not tensor-parallel: an ep group spans whole tp groups)")
        if self.pp * self.dp * self.cp * self.tp != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ConfigError(
                f"parallel: pp={self.pp} x dp={self.dp}{cp} x tp={self.tp} = "
                f"{self.pp * self.dp * self.cp * self.tp}, but the world size is {self.world_size}; "
                "the product of the degrees must equal the number of processes "
                "(change the degrees or cluster.nodes x cluster.gpus_per_node)"
            )

    @classmethod
    def from_job(cls, job: Job, world_size: int) -> ParallelDims:
        """Degrees from a resolved job (`job.parallel.{pp,dp,tp}` must be integers)."""
        pp, dp, tp, ep = job.parallel.pp, job.parallel.dp, job.parallel.tp, job.parallel.ep
        if not (isinstance(pp, int) and isinstance(dp, int) and isinstance(tp, int)):  # 'auto' left
            raise ConfigError(_degree_problems({"pp": pp, "dp": dp, "tp": tp, "world_size": world_size}))
        if not isinstance(ep, int):  # parallel.ep: auto left unresolved (the planner fills it)
            raise ConfigError(f"parallel.ep: got {ep!r}; the runtime needs an integer (run `hpctrain plan` to "
                              "resolve auto, or set parallel.ep)")
        return cls(pp=pp, dp=dp, tp=tp, world_size=world_size, ep=ep, cp=job.parallel.cp)

    def validate_model(self, model_cfg: Any, virtual_stages: int = 1) -> None:
        """Check the degrees against a model shape; raises ConfigError naming each problem."""
        problems = []
        if self.tp > 1:
            for field in ("heads", "kv_heads", "ffn_hidden"):
                value = getattr(model_cfg, field)
                if value % self.tp:
                    problems.append(
                        f"model.{field}: got {value}; must be divisible by parallel.tp={self.tp} "
                        "(tensor parallelism splits it evenly across ranks)"
                    )
            moe = getattr(model_cfg, "moe", None)
            if moe is not None and moe.shared_ffn_hidden % self.tp:
                problems.append(
                    f"model.moe.shared_experts x shared_ffn_hidden: got {moe.shared_ffn_hidden}; must be divisible "
                    f"by parallel.tp={self.tp} (the shared experts are tensor-parallel like a dense FFN)"
                )
        stages = self.pp * virtual_stages
        if self.pp > 1 and model_cfg.layers < stages:
            problems.append(
                f"model.layers: got {model_cfg.layers}; a pipeline of pp={self.pp} x "
                f"virtual_stages={virtual_stages} = {stages} stages needs at least that many layers"
            )
        if problems:
            raise ConfigError(problems)

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp(self) -> int:
        """The ranks FSDP shards over: dp x cp (context-parallel ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The data-parallel degree of the routed experts: dp x cp x tp / ep (each expert shard's FSDP group)."""
        return self.dp * self.cp * self.tp // self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """A rank's (pp, dp, tp) coordinates in the grid `arange(world).view(pp, dp, tp)`; with cp > 1
        (pp, dp, cp, tp) in `arange(world).view(pp, dp, cp, tp)`."""
        if self.cp_enabled:
            return {
                "pp": rank // (self.dp * self.cp * self.tp),
                "dp": (rank // (self.cp * self.tp)) % self.dp,
                "cp": (rank // self.tp) % self.cp,
                "tp": rank % self.tp,
            }
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": (rank // self.tp) % self.dp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 3-D mesh named ("pp", "dp", "tp") over `arange(world).view(pp, dp, tp)`; needs an
        initialised default process group (every rank must call it).

        The grid is never permuted: c10d sorts the ranks of every subgroup, so a permuted grid
        would give group ranks that disagree with mesh coordinates and DTensor would assemble
        shards in the wrong order. A physical placement (the planner's `placement.rank_order`)
        is applied where global ranks are assigned, i.e. by the entry point, not here.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self.cp_enabled:
            return init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=CP_MESH_DIM_NAMES)
        return init_device_mesh(
            device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIM_NAMES
        )
