"""One rank's share of the model and how to run a training step on it: `Training`.

`hpctrain.runtime.parallel.build.build_training(job, device)` builds it (the build order is there);
the training loop then only sees `Training`:

    training = build_training(job, device)
    optimizer = torch.optim.AdamW(training.parameters(), ...)
    for step ...:
        optimizer.zero_grad()
        loss = training.train_step(inputs, labels)     # this dp rank's slice of the global batch
        grad_norm = training.clip_grad_norm_(max_norm)
        training.optimizer_step(optimizer)             # skips the step on fp16 overflow
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.init import ShardFill, init_parameters, random_fill
from hpctrain.runtime.model.lora import init_lora, is_adapter
from hpctrain.runtime.model.moe import MoE, expert_rank_loads
from hpctrain.runtime.model.transformer import ModelArgs, Transformer, cross_entropy_loss
from hpctrain.runtime.parallel.context import shard_sequence
from hpctrain.runtime.parallel.dims import ParallelDims
from hpctrain.runtime.parallel.fsdp import sync_every_microbatch, zero_stage
from hpctrain.runtime.parallel.grad_norm import clip_to, is_sharded, weighted_grad_sq
from hpctrain.runtime.parallel.pipeline import step_kwargs
from hpctrain.runtime.parallel.float8 import compute_precision, precompute_scales
from hpctrain.runtime.parallel.host_embedding import average_over_dp
from hpctrain.runtime.parallel.precision import SDPA_BACKENDS, LossScaler, autocast_context, local_tensor, sdpa_kernel

if TYPE_CHECKING:
    from hpctrain.config import Job


@dataclass
class Training:
    """One rank's share of the model and how to run a step on it.

    train_step(inputs, labels) takes this dp rank's slice of the global batch
    ([global_batch / dp, seq] int64, the same slice on every tp and pp rank of that dp group),
    runs forward and backward over its micro-batches, and returns the global-batch mean loss
    (identical on every rank). Afterwards every gradient is the global-batch mean gradient.
    """

    job: Job
    args: ModelArgs
    dims: ParallelDims
    mesh: Any  # DeviceMesh, or None for a single process without a process group
    device: torch.device
    model_parts: list[Transformer]
    schedule: Any  # the pipeline schedule, or None without pipelining
    n_microbatches: int
    has_first_stage: bool = True
    has_last_stage: bool = True
    loss_scaler: LossScaler | None = None
    fsdp: bool = False
    tied_group: Any = None  # process group pairing first and last stage (tied embeddings, pp > 1)
    float8_scales: bool = False  # fp8 tensorwise under FSDP: the weights' scales after each optimizer step
    host_embedding_group: Any = None  # train.embedding_on_cpu with dp > 1: the group averaging its gradient
    _float8_scales_ready: bool = False
    _norm_weights: list[tuple[nn.Parameter, float]] = field(default_factory=list)
    _params: list[nn.Parameter] = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.mesh is not None else 0

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank updates (each once), for the optimizer."""
        if not self._params:
            seen: dict[int, nn.Parameter] = {}
            for part in self.model_parts:
                for p in part.parameters():
                    seen.setdefault(id(p), p)
            self._params = list(seen.values())
        return list(self._params)

    def initialise(self, fill: ShardFill | None = None) -> None:
        """Fill this rank's shard of every parameter: from the seed (drawn on the device), or `fill`;
        LoRA adapters always start as PEFT's (lora.init_lora)."""
        fill = fill or random_fill(self.job.train.seed, self.args.layers, self.device)
        lora = self.job.train.lora is not None
        for part in self.model_parts:
            init_parameters(part, fill, select=(lambda name: not is_adapter(name)) if lora else None)
            if lora:
                init_lora(part, self.job.train.seed)

    def param_count_local(self) -> int:
        """Elements this rank stores (its TP/FSDP shards of its pipeline stages)."""
        return sum(local_tensor(p).numel() for p in self.parameters())

    def param_count_before_dp(self) -> int:
        """Elements this rank holds after TP sharding but before FSDP sharding: the planner's
        per-rank count (`hpctrain.plan.model_stats.stage_param_count`). Expert parallelism splits
        over ranks borrowed from dp, so its split of the routed experts is not undone here either."""
        from torch.distributed.tensor import DTensor

        total = 0
        for p in self.parameters():
            shape = list(p.shape)
            if isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or ()
                for i, placement in enumerate(p.placements):
                    if i < len(names) and names[i] == "tp" and is_sharded(placement):
                        dim, size = getattr(placement, "dim") % len(shape), p.device_mesh.size(i)
                        chunk = -(-shape[dim] // size)  # torch.chunk: the last shards may be short
                        rank = p.device_mesh.get_local_rank(i)
                        shape[dim] = max(0, min(chunk, shape[dim] - rank * chunk))
            total += math.prod(shape)
        return total

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank() if self.mesh is not None and self.dims.cp_enabled else 0

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's columns of [batch, seq] inputs or labels: under context parallelism its head and
        tail chunks (runtime/parallel/context.py), else all of them."""
        return shard_sequence(tokens, self.dims.cp, self.cp_rank)

    @property
    def loss_replicas(self) -> int:
        """Ranks whose loss terms the global mean averages: the last stage's dp x cp x tp ranks."""
        return self.dims.dp * self.dims.cp * self.dims.tp

    def _contexts(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.dims.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        stack.enter_context(autocast_context(self.device, compute_precision(self.job.train), self.fsdp))
        backends = SDPA_BACKENDS[self.job.train.attention_kernel]
        if backends is not None:  # train.attention_kernel; auto leaves the choice to torch
            stack.enter_context(sdpa_kernel(backends))
        return stack

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_loss(logits, labels)
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        return self._global_mean(self.forward_backward(inputs, labels))

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """train_step without blocking the host: this rank's loss term as a device tensor (the
        mean over its dp rank's batch on last-stage ranks, 0 elsewhere); `finish_step` reduces it."""
        inputs, labels = self.local_tokens(inputs.to(self.device)), self.local_tokens(labels.to(self.device))
        if inputs.shape[0] % self.n_microbatches:
            raise ConfigError(
                f"train_step: a local batch of {inputs.shape[0]} sequences does not split into "
                f"{self.n_microbatches} micro-batches"
            )
        self._prepare_moe()
        if self.float8_scales and not self._float8_scales_ready:
            # The first step's (after initialisation or a checkpoint load): without precomputed scales FSDP's
            # fp8 all-gather would scale each tp shard by its own amax; these are the whole tensor's, as one
            # process computes them (float8.py).
            precompute_scales(self.model_parts)
            self._float8_scales_ready = True
        with self._contexts():
            if self.schedule is not None:
                local_loss = self._pipelined_step(inputs, labels)
            else:
                local_loss = self._plain_step(inputs, labels)
        self._match_grad_placements()
        self._sync_tied_grads()
        self._average_host_embedding()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.parameters())
        return local_loss

    def moe_layers(self) -> dict[int, MoE]:
        """This rank's MoE FFNs by global layer index."""
        return {int(key): block.feed_forward for part in self.model_parts for key, block in part.layers.items()
                if isinstance(block.feed_forward, MoE)}

    def _prepare_moe(self) -> None:
        """Each MoE layer's balancing-loss gradient for this step (runtime/model/moe.py): coeff / MoE layers
        (the loss is their mean) / micro-batches where the loop divides the loss (the pipeline schedule
        divides the gradients itself), times the fp16 loss scale."""
        moe = self.args.moe
        if moe is None or moe.aux_loss_coeff <= 0:
            return
        n_moe = sum(1 for layer in range(self.args.layers) if self.args.is_moe_layer(layer))
        scale = moe.aux_loss_coeff / n_moe
        if self.schedule is None:
            scale /= self.n_microbatches
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        for layer in self.moe_layers().values():
            layer.backward_scale = scale

    def moe_step_stats(self) -> dict[str, float]:
        """After a step's backward: every MoE layer's tokens per expert, summed over all ranks (one
        all-reduce of [MoE layers, experts + 2]), applied to the routing biases, and the step's metrics:
        `aux_loss` (the balancing loss, mean over layers and micro-batches), `expert_load_max_over_mean`
        (the worst layer's busiest expert over its mean), `expert_load_ep<N>` for every ep that divides the
        experts (`expert_rank_loads`: what `hpctrain plan --expert-load` prices), `tokens_dropped` (capacity
        overflow); {} without MoE."""
        moe = self.args.moe
        if moe is None:
            return {}
        moe_ids = [layer for layer in range(self.args.layers) if self.args.is_moe_layer(layer)]
        row_of = {layer: i for i, layer in enumerate(moe_ids)}
        table = torch.zeros(len(moe_ids), moe.experts + 3, dtype=torch.float64, device=self.device)
        for layer, module in self.moe_layers().items():
            row = table[row_of[layer]]
            if module.stat_counts is not None:
                row[:moe.experts] = module.stat_counts.to(self.device, torch.float64)
            row[moe.experts] = module.stat_dropped
            if module.stat_aux:
                row[moe.experts + 1] = torch.stack(module.stat_aux).sum().to(self.device, torch.float64)
                row[moe.experts + 2] = module.stat_aux_count  # 1 / tp per term under sequence parallelism
        if self.mesh is not None and self.dims.world_size > 1:
            dist.all_reduce(table)
        counts = table[:, :moe.experts]
        for layer, module in self.moe_layers().items():
            module.update_bias(counts[row_of[layer]])
            module.clear_stats()
        mean = counts.mean(dim=1).clamp(min=1e-12)
        stats = {"expert_load_max_over_mean": float((counts.max(dim=1).values / mean).max()),
                 "tokens_dropped": float(table[:, moe.experts].sum()),
                 **expert_rank_loads(counts)}
        if moe.aux_loss_coeff > 0:
            n = table[:, moe.experts + 2].clamp(min=1)
            stats["aux_loss"] = float((table[:, moe.experts + 1] / n).mean())
        return stats

    def _plain_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        model: Any = self.model_parts[0]  # an FSDPModule too when fsdp
        total = torch.zeros((), device=self.device)
        chunks = zip(inputs.chunk(self.n_microbatches), labels.chunk(self.n_microbatches))
        for i, (x, y) in enumerate(chunks):
            if self.fsdp and not sync_every_microbatch(zero_stage(self.job.parallel)):
                model.set_requires_gradient_sync(i == self.n_microbatches - 1)
            loss = self._loss_fn(model(x), y)
            (loss / self.n_microbatches).backward()
            total += local_tensor(loss.detach()).float()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return total / (self.n_microbatches * scale)

    def _pipelined_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        self.schedule.step(*args, target=labels, losses=losses, **step_kwargs(self.schedule))
        if not self.has_last_stage:
            return torch.zeros((), device=self.device)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        mean = torch.stack([local_tensor(loss.detach()).float() for loss in losses]).mean()
        return mean / scale

    def _global_mean(self, local_loss: torch.Tensor) -> float:
        """Mean over dp (and cp: each rank holds S/cp tokens of every sequence) of the per-rank losses,
        known on the last stage, sent to every rank."""
        if self.mesh is None or self.dims.world_size == 1:
            return float(local_loss)
        total = local_loss.detach().reshape(1).float().to(self.device)
        dist.all_reduce(total)  # every (dp, tp) rank of the last stage contributes its dp's loss
        return float(total) / self.loss_replicas

    def _match_grad_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements.

        Autograd does not guarantee it: norm-weight gradients can come out Partial (a pending
        sum over tp). (The vocab-sharded embedding's gradient is Shard(0) already: its lookup
        computes only the rank's rows, parallel/vocab.py.) Clipping, loss scaling and the
        tied-embedding sync work on local shards, so they need gradients laid out exactly like
        their parameters."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.placement_types import Partial

        pending: dict[Any, list[torch.nn.Parameter]] = {}  # (1-D mesh, dtype) -> replicated, Partial-sum grads
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                if (g.device_mesh.ndim == 1 and tuple(p.placements) == (Replicate(),)
                        and tuple(g.placements) == (Partial("sum"),) and g.device_mesh == p.device_mesh):
                    pending.setdefault((g.device_mesh, g.dtype), []).append(p)
                else:
                    p.grad = g.redistribute(g.device_mesh, p.placements)
        for (mesh, _), params in pending.items():
            # The pending sums of one mesh in one all-reduce (what redistribute does per tensor: with
            # sequence parallelism every norm weight's gradient is one, ~9 collectives a step of a 4-layer model).
            grads = [cast(DTensor, p.grad) for p in params]
            flat = torch.cat([g.to_local().reshape(-1) for g in grads])
            dist.all_reduce(flat, group=mesh.get_group())
            offset = 0
            for p, g in zip(params, grads):
                n = g.to_local().numel()
                local = flat[offset:offset + n].view_as(g.to_local())
                offset += n
                p.grad = DTensor.from_local(local, mesh, [Replicate()], run_check=False, shape=g.shape,
                                            stride=g.stride())

    def _sync_tied_grads(self) -> None:
        """Tied embeddings across pipeline stages: both copies get the sum of their gradients."""
        if self.tied_group is None or self.job.train.lora is not None:  # LoRA: the embedding is frozen
            return
        part = self.model_parts[0] if self.has_first_stage else self.model_parts[-1]
        holder = part.tok_embeddings if self.has_first_stage else part.output
        assert holder is not None and holder.weight.grad is not None  # the tied group holds only these ranks
        grad = local_tensor(holder.weight.grad)
        buf = grad.to(self.device)
        dist.all_reduce(buf, group=self.tied_group)
        grad.copy_(buf)

    def _average_host_embedding(self) -> None:
        """train.embedding_on_cpu: the host table's gradient is no FSDP gradient; average it over dp here."""
        if self.host_embedding_group is None or not self.has_first_stage:
            return
        embedding = self.model_parts[0].tok_embeddings
        if embedding is not None and embedding.weight.requires_grad:
            average_over_dp(embedding, self.host_embedding_group, self.dims.dp)

    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Global L2 norm of the full-model gradient (each element once, across TP/FSDP shards,
        pipeline stages and tied copies); scales gradients so it is at most max_norm (None or
        inf: measure only). Returns the norm before clipping."""
        sq = self._grad_sq_local()
        if self.mesh is not None and self.dims.world_size > 1:
            dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        self._clip(norm, max_norm)
        return norm

    def finish_step(self, local_loss: torch.Tensor, max_norm: float | None,
                    flags: Sequence[int] = ()) -> tuple[float, float, list[int]]:
        """The end of a step with one collective and one device-to-host transfer: gathers every
        rank's loss term, squared gradient norm and `flags` (small integers, e.g. the stop
        request), clips, and returns (global mean loss, gradient norm, each flag's maximum over
        ranks). Replaces train_step's loss reduction, clip_grad_norm_'s and the stop agreement's,
        each of which blocked the host (on a GPU: a device synchronisation each)."""
        parts = [local_loss.detach().reshape(1).double().to(self.device),
                 self._grad_sq_local().reshape(1),
                 torch.tensor([float(f) for f in flags], dtype=torch.float64, device=self.device)]
        vec = torch.cat(parts)
        if self.mesh is not None and self.dims.world_size > 1:
            # A gather as a sum: each rank fills its own row (an all-reduce exists on every
            # backend and torch version; the rows are a few numbers each).
            table = torch.zeros(self.dims.world_size, vec.numel(), dtype=vec.dtype, device=self.device)
            table[dist.get_rank()] = vec
            dist.all_reduce(table)
            rows = table.tolist()  # the step's one host transfer
        else:
            rows = [vec.tolist()]
        loss = sum(row[0] for row in rows) / self.loss_replicas
        norm = math.sqrt(sum(row[1] for row in rows))
        agreed = [int(max(row[2 + i] for row in rows)) for i in range(len(flags))]
        self._clip(norm, max_norm)
        return loss, norm, agreed

    def _clip(self, norm: float, max_norm: float | None) -> None:
        clip_to(self.parameters(), norm, max_norm)

    def _grad_sq_local(self) -> torch.Tensor:
        """This rank's weighted sum of squared gradient elements (float64, on the device)."""
        return weighted_grad_sq(self._norm_weights, self.device)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """optimizer.step(), unless fp16 loss scaling found inf/nan; returns whether it stepped."""
        stepped = self.loss_scaler is None or not self.loss_scaler.found_inf
        if stepped:
            optimizer.step()
            if self.float8_scales:
                precompute_scales(self.model_parts)
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        return stepped
