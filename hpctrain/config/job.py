"""The whole job: one model per section, plus the cross-field checks that span sections."""

from typing import TYPE_CHECKING, Annotated, Any, Optional

from pydantic import Field

from hpctrain.config.base import Section
from hpctrain.config.infra import (
    CheckpointConfig,
    ClusterConfig,
    ContainerConfig,
    MonitorConfig,
    NcclConfig,
    RestartConfig,
    RuntimeConfig,
    SlurmConfig,
    SweepConfig,
)
from hpctrain.config.lazy import LazySection
from hpctrain.config.model import ModelConfig
from hpctrain.config.problem import Problem
from hpctrain.config.training import ParallelConfig, Placement, TrainConfig
from hpctrain.config.types import Text

if TYPE_CHECKING:
    from hpctrain.config.entrypoint import EntrypointConfig as EntrypointSection
    from hpctrain.config.kubernetes import KubernetesConfig as KubernetesSection
else:  # built on first use (config/lazy.py)
    EntrypointSection = Annotated[Any, LazySection("hpctrain.config.entrypoint", "EntrypointConfig")]
    KubernetesSection = Annotated[Any, LazySection("hpctrain.config.kubernetes", "KubernetesConfig")]

class Job(Section):
    """A training job: model, training, layout, cluster, scheduler, container, checkpoints."""

    name: Text = Field(..., description="Job name (free text; quoted wherever it reaches a shell).")
    runs_dir: Text = Field("runs", description="Where run directories are created.")
    template_dir: Optional[Text] = Field(None, description="Folder of user templates that override the shipped "
                                         "sbatch/recipe templates of the same name.")
    model: Optional[ModelConfig] = Field(None, description="The built-in transformer; optional with entrypoint "
                                         "(then, when given, `plan` advises the script's layout).")
    entrypoint: Optional[EntrypointSection] = Field(None, description="Your own training program instead of the "
                                                   "built-in model: every rank runs it with torchrun's variables.")
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(), description="Training settings.")
    parallel: ParallelConfig = Field(default_factory=lambda: ParallelConfig(), description="Parallel layout.")
    placement: Optional[Placement] = Field(None, description="Filled by the planner; leave unset.")
    cluster: ClusterConfig = Field(default_factory=lambda: ClusterConfig(), description="The machines.")
    slurm: SlurmConfig = Field(default_factory=lambda: SlurmConfig(), description="sbatch options.")
    restart: RestartConfig = Field(default_factory=lambda: RestartConfig(), description="The restart policy every "
                                   "backend follows (requeue, max_requeues, signal, signal_seconds).")
    container: ContainerConfig = Field(default_factory=lambda: ContainerConfig(),
                                       description="Singularity/Apptainer image.")
    runtime: RuntimeConfig = Field(default_factory=lambda: RuntimeConfig(), description="How the ranks are started.")
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig(), description="Checkpoints.")
    nccl: NcclConfig = Field(default_factory=lambda: NcclConfig(), description="NCCL environment.")
    monitor: MonitorConfig = Field(default_factory=lambda: MonitorConfig(), description="Optional monitors.")
    sweep: Optional[SweepConfig] = Field(None, description="Grid for `hpctrain sweep`.")
    kubernetes: Optional[KubernetesSection] = Field(None, description="Kubernetes with Volcano "
                                                   "(cluster.executor: volcano).")

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def transformer(self) -> ModelConfig:
        """The model section, for the stages that need the built-in model (the planner, the runtime)."""
        if self.model is None:
            from hpctrain.errors import ConfigError

            raise ConfigError("model: not given; the built-in runtime and the planner need it: set model.preset, "
                              "or run your own program with entrypoint")
        return self.model


def _fixed(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _model_problems(job: Job) -> list[Problem]:
    m = job.model
    if m is None:
        if job.entrypoint is None:
            return [Problem("model", "is required unless entrypoint is given", None,
                            "set model.preset (the built-in transformer) or entrypoint.script (your own program)")]
        return []
    init = [Problem(path, message, got, fix) for path, message, got, fix in m.init_problems]
    if init:
        return init
    out = [Problem(f"model.{name}", "is required when no preset is given", None,
                   f"set model.{name} or choose model.preset") for name in m.missing_fields()]
    if out:
        return out
    assert m.hidden and m.heads and m.kv_heads and m.seq_len  # filled: missing_fields() is empty
    explicit_head_dim = m.head_dim is not None
    if m.hidden % m.heads and not explicit_head_dim:
        out.append(Problem("model.hidden", f"must be divisible by model.heads={m.heads}", m.hidden,
                           f"use a multiple of {m.heads}, or set model.head_dim"))
    if m.heads % m.kv_heads:
        out.append(Problem("model.kv_heads", f"must divide model.heads={m.heads}", m.kv_heads,
                           "use a divisor of heads (GQA groups must be equal)"))
    rs = m.rope_scaling
    if rs is not None and rs.high_freq_factor <= rs.low_freq_factor:
        out.append(Problem("model.rope_scaling.high_freq_factor", "must be above low_freq_factor="
                           f"{rs.low_freq_factor}", rs.high_freq_factor, "use e.g. low 1, high 4 (Llama 3.1)"))
    head_dim = m.head_dim or m.hidden // m.heads
    if head_dim % 2:
        field = "model.head_dim" if explicit_head_dim else "model.hidden"
        out.append(Problem(field, "the head size must be even for RoPE", head_dim if explicit_head_dim else m.hidden,
                           "choose hidden and heads (or head_dim) so the head size is even"))
    return out + _moe_problems(job)


def _moe_problems(job: Job) -> list[Problem]:
    m = job.transformer
    moe = m.moe
    if moe is None:
        return []
    out: list[Problem] = []
    if moe.top_k > moe.experts:
        out.append(Problem("model.moe.top_k", f"is more than model.moe.experts={moe.experts}", moe.top_k,
                           f"use top_k <= {moe.experts}"))
    if m.layers and moe.dense_layers >= m.layers:
        out.append(Problem("model.moe.dense_layers", f"leaves no MoE block of the {m.layers} layers",
                           moe.dense_layers, f"use dense_layers < {m.layers}, or remove model.moe"))
    if m.activation != "swiglu":
        out.append(Problem("model.activation", "experts are SwiGLU: model.moe needs activation swiglu",
                           m.activation, "set model.activation: swiglu"))
    lora = job.train.lora
    ffn_targets = sorted({"w1", "w2", "w3"} & set(lora.targets)) if lora is not None else []
    if ffn_targets:
        out.append(Problem("train.lora.targets", "with model.moe LoRA adapts the attention projections only",
                           ffn_targets, "remove w1/w2/w3 (gate/down/up_proj) from the targets"))
    return out


def _parallel_problems(job: Job) -> list[Problem]:
    p, c, t = job.parallel, job.cluster, job.train
    m = job.model if job.model is not None else ModelConfig.model_construct()  # no model: no model bounds
    out: list[Problem] = []
    tp, pp, dp = _fixed(p.tp), _fixed(p.pp), _fixed(p.dp)
    world = job.world_size
    if tp is not None:
        if tp > c.gpus_per_node:
            out.append(Problem("parallel.tp", f"exceeds cluster.gpus_per_node={c.gpus_per_node}; TP must stay "
                               "inside a node's NVLink island", tp, f"use tp <= {c.gpus_per_node}"))
        if m.heads and m.heads % tp:
            out.append(Problem("parallel.tp", f"must divide model.heads={m.heads}", tp, "use a divisor of heads"))
        elif m.kv_heads and m.kv_heads % tp:
            out.append(Problem("parallel.tp", f"must divide model.kv_heads={m.kv_heads}", tp,
                               "use a divisor of kv_heads"))
    if pp is not None and m.layers and pp > m.layers:
        out.append(Problem("parallel.pp", f"exceeds model.layers={m.layers}", pp, f"use pp <= {m.layers}"))
    degrees = [d for d in (tp, pp, dp) if d is not None]
    product = p.cp  # context parallelism takes its ranks beside tp, pp and dp (1 without it)
    for d in degrees:
        product *= d
    cp_tag, cp_term = (f" cp={p.cp}", "*cp") if p.cp > 1 else ("", "")
    if len(degrees) == 3 and product != world:
        out.append(Problem("parallel", f"tp*pp*dp{cp_term} = {product} but the cluster has {world} GPUs "
                           f"({c.nodes} nodes x {c.gpus_per_node})", f"tp={tp} pp={pp} dp={dp}{cp_tag}",
                           f"make tp*pp*dp{cp_term} equal nodes*gpus_per_node, or set one of them to auto"))
    elif (degrees or p.cp > 1) and world % product:
        out.append(Problem("parallel", f"the fixed degrees multiply to {product}, which does not divide the "
                           f"{world} GPUs", f"tp={p.tp} pp={p.pp} dp={p.dp}{cp_tag}", "choose divisors of the GPU count"))
    mb = _fixed(t.micro_batch)
    if mb is not None and dp is not None and t.global_batch % (mb * dp):
        out.append(Problem("train.global_batch", f"must be divisible by micro_batch*dp = {mb}*{dp}",
                           t.global_batch, f"use a multiple of {mb * dp}"))
    elif dp is not None and t.global_batch % dp:
        out.append(Problem("train.global_batch", f"must be divisible by parallel.dp={dp}", t.global_batch,
                           f"use a multiple of {dp}"))
    v = _fixed(p.virtual_stages)
    if v is not None and v > 1 and p.schedule not in ("auto", "interleaved-1f1b"):
        out.append(Problem("parallel.virtual_stages", f"> 1 needs schedule interleaved-1f1b (got {p.schedule})",
                           v, "set parallel.schedule=interleaved-1f1b or virtual_stages=1"))
    if v is not None and pp is not None and m.layers and pp * v > m.layers:
        out.append(Problem("parallel.virtual_stages", f"pp*virtual_stages = {pp * v} exceeds model.layers="
                           f"{m.layers}", v, "use fewer virtual stages"))
    if p.schedule == "interleaved-1f1b" and v == 1:
        out.append(Problem("parallel.schedule", "interleaved-1f1b needs virtual_stages >= 2", p.schedule,
                           "set parallel.virtual_stages=2 (or auto), or use 1f1b"))
    if p.sequence_parallel and tp == 1:
        out.append(Problem("parallel.sequence_parallel", "needs tp > 1", True, "set parallel.tp >= 2 or disable it"))
    out += _ep_problems(job, dp, tp)
    out += _cp_problems(job, tp)
    if t.compile and tp is not None and tp > 1:
        out.append(Problem("train.compile", f"does not combine with tensor parallel yet (parallel.tp={tp}): "
                           "its blocks do not compile", True, "set train.compile: false, or parallel.tp: 1"))
    return out


def _cp_problems(job: Job, tp: int | None) -> list[Problem]:
    """parallel.cp: each sequence in 2 x cp chunks, a head and its mirror tail per rank (runtime/parallel/context.py)."""
    cp, m = job.parallel.cp, job.model
    if cp == 1:
        return []
    out = []
    seq = m.seq_len if m is not None else None
    if isinstance(seq, int) and seq % (2 * cp):
        out.append(Problem("model.seq_len", f"must be a multiple of 2 x parallel.cp = {2 * cp} (each context-parallel "
                           "rank holds a head chunk and its mirror tail chunk)", seq,
                           f"use a multiple of {2 * cp}, or a smaller parallel.cp"))
    elif isinstance(seq, int) and job.parallel.sequence_parallel and tp is not None and (seq // cp) % tp:
        out.append(Problem("model.seq_len", f"seq_len / cp = {seq // cp} must be divisible by parallel.tp={tp} "
                           "(sequence parallelism splits each context-parallel rank's tokens over tp)", seq,
                           f"use a multiple of {2 * cp * tp}"))
    return out


def _ep_problems(job: Job, dp: int | None, tp: int | None) -> list[Problem]:
    """parallel.ep: experts split over ep of the dp x cp x tp ranks (runtime/parallel/expert.py; context parallelism
    folds into the experts' grouping, Megatron-Core's "MoE parallel folding")."""
    ep, moe = job.parallel.ep, (job.model.moe if job.model is not None else None)
    out: list[Problem] = []
    if moe is not None and tp is not None and tp > 1:
        # The experts are not tensor-parallel (torchtitan's ParallelDims with etp=1): each tp rank routes
        # its own sequence shard, and an ep group spans whole tp groups.
        if not job.parallel.sequence_parallel:
            out.append(Problem("parallel.sequence_parallel", f"must be true with model.moe and parallel.tp={tp} "
                               "(each tp rank routes its own sequence shard)", False,
                               "set parallel.sequence_parallel: true"))
        if isinstance(ep, int) and ep % tp:
            out.append(Problem("parallel.ep", f"must be a multiple of parallel.tp={tp} with model.moe (the experts "
                               "are not tensor-parallel: an ep group spans whole tp groups)", ep,
                               f"set parallel.ep to a multiple of {tp}"))
    if ep == 1 or not isinstance(ep, int):  # auto: the planner picks a fitting ep (plan/space.py)
        return out
    if moe is None:
        return [Problem("parallel.ep", "> 1 needs model.moe (expert parallelism splits routed experts)", ep,
                        "set parallel.ep: 1, or give the model experts (model.moe)")]
    if moe.experts % ep:
        out.append(Problem("parallel.ep", f"must divide model.moe.experts={moe.experts}", ep,
                           "use a divisor of the expert count"))
    cp = job.parallel.cp
    if dp is not None and tp is not None and (dp * cp * tp) % ep:
        names, dims = ("dp x cp x tp", "dp, cp and tp") if cp > 1 else ("dp x tp", "dp and tp")
        fields = " x ".join(f"parallel.{n}" for n in names.split(" x "))
        out.append(Problem("parallel.ep", f"must divide {fields} = {dp * cp * tp} (ep borrows its ranks "
                           f"from {dims})", ep, f"use a divisor of {dp * cp * tp}, or set parallel.dp so that {names} "
                           f"is a multiple of {ep} (or auto)"))
    return out


def _elastic_problems(job: Job) -> list[Problem]:
    """A node range: well formed, and every count in it fits the fixed degrees (the planner fills the rest
    at each start, for the nodes Slurm allocated; a fixed layout stays fixed, so it cannot take a range)."""
    c, p, t = job.cluster, job.parallel, job.train
    if (c.min_nodes is None) != (c.max_nodes is None):
        given = "min_nodes" if c.min_nodes is not None else "max_nodes"
        return [Problem(f"cluster.{given}", "a node range needs both cluster.min_nodes and cluster.max_nodes",
                        getattr(c, given), "set both, or write cluster.nodes: '4-8'")]
    if c.min_nodes is None or c.max_nodes is None:
        return []
    if c.min_nodes > c.max_nodes:
        return [Problem("cluster.nodes", "the range's low end is above its high end", f"{c.min_nodes}-{c.max_nodes}",
                        f"write {c.max_nodes}-{c.min_nodes}")]
    if not c.min_nodes <= c.nodes <= c.max_nodes:
        return [Problem("cluster.nodes", f"is outside cluster.min_nodes..max_nodes = {c.min_nodes}-{c.max_nodes}",
                        c.nodes, "leave cluster.nodes out (it defaults to max_nodes) or write the range there")]
    tp, pp, dp = _fixed(p.tp), _fixed(p.pp), _fixed(p.dp)
    if not c.elastic or job.placement is not None:
        return []  # a resolved job (placement set) holds the layout planned for cluster.nodes alone
    if tp is not None and pp is not None and dp is not None:
        return [Problem("cluster.nodes", f"a node range needs a layout that can change, but tp, pp and dp are all "
                        f"fixed (tp*pp*dp = {tp * pp * dp} GPUs)", f"{c.min_nodes}-{c.max_nodes}",
                        "set parallel.dp: auto, or use a fixed node count")]
    fixed = (tp or 1) * (pp or 1) * (dp or 1) * p.cp
    misfits = [n for n in c.node_counts if (n * c.gpus_per_node) % fixed]
    if misfits:
        return [Problem("cluster.nodes", f"the fixed degrees multiply to {fixed}, which does not divide the GPUs of "
                        f"{', '.join(map(str, misfits))} node(s) x {c.gpus_per_node}", f"{c.min_nodes}-{c.max_nodes}",
                        "narrow the range to counts that fit, or set the degrees to auto")]
    mb = _fixed(t.micro_batch) or 1
    if tp is not None and pp is not None:
        bad = [n for n in c.node_counts if t.global_batch % (mb * n * c.gpus_per_node // (tp * pp * p.cp))]
        if bad:
            return [Problem("train.global_batch", f"must be divisible by micro_batch*dp at every node count of the "
                            f"range; it is not at {', '.join(map(str, bad))} node(s)", t.global_batch,
                            "choose a global batch that every data-parallel degree of the range divides")]
    return []


def _other_problems(job: Job) -> list[Problem]:
    t, s, out = job.train, job.slurm, []
    if t.lr_schedule.warmup_steps >= t.steps and t.steps > 1:
        out.append(Problem("train.lr_schedule.warmup_steps", f"must be below train.steps={t.steps}",
                           t.lr_schedule.warmup_steps, f"use fewer than {t.steps} warm-up steps"))
    if job.container.image is not None and not job.container.image.endswith(".sif"):
        out.append(Problem("container.image", "must be a .sif file", job.container.image,
                           "build one with `singularity build IMAGE.sif <recipe>` and give its path"))
    if s.time is not None and job.monitor.py_spy:
        from hpctrain.config.types import slurm_time_seconds

        if slurm_time_seconds(s.time) <= job.monitor.py_spy_seconds_before_limit:
            out.append(Problem("monitor.py_spy_seconds_before_limit", f"is not below slurm.time={s.time}",
                               job.monitor.py_spy_seconds_before_limit, "use a smaller value"))
    lora = t.lora
    if lora is not None and "w3" in lora.targets and job.model is not None and job.model.activation != "swiglu":
        out.append(Problem("train.lora.targets", "w3 (up_proj) exists only with model.activation swiglu",
                           lora.targets, "remove w3 / up_proj from the targets"))
    first, last = job.monitor.nsys_steps
    if first > last or first < 0:
        out.append(Problem("monitor.nsys_steps", "must be [first, last] with 0 <= first <= last",
                           job.monitor.nsys_steps, "use e.g. [10, 12]"))
    return out


def _memory_lever_problems(job: Job) -> list[Problem]:
    """train.embedding_on_cpu and train.attention_kernel against the layout and the model."""
    t, out = job.train, []
    tp = _fixed(job.parallel.tp)
    if t.embedding_on_cpu and tp is not None and tp > 1:
        out.append(Problem("train.embedding_on_cpu", f"does not combine with tensor parallel (parallel.tp={tp}): "
                           "the vocabulary-parallel lookup reduces over the tp group on the device", True,
                           "set train.embedding_on_cpu: false, or parallel.tp: 1"))
    if t.embedding_on_cpu and job.model is not None and job.model.tie_embeddings:
        out.append(Problem("train.embedding_on_cpu", "does not combine with model.tie_embeddings: the head shares "
                           "the table and computes on the device", True,
                           "set train.embedding_on_cpu: false, or model.tie_embeddings: false"))
    if t.precision == "fp8" and t.fp8.recipe == "mxfp8" and job.model is not None:
        # MX blocks run along every GEMM's reduction, the weight gradient's too: a micro-batch's tokens on a rank
        # (with micro_batch auto, one sequence's: any micro-batch then holds whole blocks)
        micro = _fixed(t.micro_batch) or 1
        tokens = micro * int(job.model.seq_len or 0) // job.parallel.cp
        if tokens % MX_BLOCK:
            out.append(Problem("train.fp8.recipe", f"mxfp8 scales blocks of {MX_BLOCK} along every GEMM's reduction, "
                               f"the weight gradient's over a micro-batch's tokens on a rank (train.micro_batch x "
                               f"model.seq_len / parallel.cp = {tokens})", "mxfp8",
                               f"make that a multiple of {MX_BLOCK} (model.seq_len, or a fixed train.micro_batch), "
                               "or use recipe tensorwise"))
    compute = t.fp8.high_precision if t.precision == "fp8" else t.precision  # what attention computes in
    if t.attention_kernel == "flash" and compute == "fp32" and job.cluster.gpu != "cpu":
        out.append(Problem("train.attention_kernel", "flash needs 16-bit inputs on a GPU (train.precision: fp32)",
                           "flash", "use attention_kernel: efficient or auto, or train.precision: bf16"))
    if t.attention_kernel == "efficient" and job.cluster.gpu == "cpu":
        out.append(Problem("train.attention_kernel", "torch has no memory-efficient SDPA kernel for the CPU "
                           "(cluster.gpu: cpu)", "efficient", "use flash, math or auto on the CPU"))
    return out


# The MX block: 32 elements share one E8M0 scale (OCP Microscaling Formats (MX) Specification v1.0, section 5: the
# MXFP8 formats' block size k = 32).
MX_BLOCK = 32

# monitor.tracker name -> the module its runtime writer imports, and the extra that installs it
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "mlflow": ("mlflow", "mlflow")}


def _tracker_problems(job: Job) -> list[Problem]:
    """A tracker whose package is missing fails here, at validate time, not on the compute node."""
    import importlib.util

    out = []
    names = [job.monitor.tracker] if isinstance(job.monitor.tracker, str) else list(job.monitor.tracker)
    if "none" in names and len(set(names)) > 1:
        out.append(Problem("monitor.tracker", "'none' cannot be combined with other trackers", names,
                           "remove 'none' or the others"))
    for name in job.monitor.trackers:
        module, extra = TRACKER_PACKAGES[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(Problem("monitor.tracker", f"{name} needs the {module} package, which is not installed",
                               name, f"pip install 'hpctrain[{extra}]', or remove {name} from monitor.tracker"))
    return out


def cross_field_problems(job: Job) -> list[Problem]:
    """Checks that span fields or sections; pydantic has already checked each field alone."""
    model = _model_problems(job)
    if job.entrypoint is not None:
        from hpctrain.config.entrypoint import entrypoint_problems

        model += entrypoint_problems(job)
    if model:
        return model
    from hpctrain.config.kubernetes_checks import kubernetes_problems

    return _elastic_problems(job) or (_parallel_problems(job) + _other_problems(job) + _memory_lever_problems(job)
                                      + _tracker_problems(job) + kubernetes_problems(job))
