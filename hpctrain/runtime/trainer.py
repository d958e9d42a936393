"""The training loop (torchtitan's shape): build once, then step, log, checkpoint, until done.

The loop delegates: `Training.train_step` (forward/backward over the micro-batches and the
pipeline; returns the global-batch mean loss, identical on every rank), `clip_grad_norm_` (the
norm over DTensor shards, stages and tied copies), `optimizer_step` (skips on fp16 overflow),
`Checkpointer.save(step)` and `should_continue()`. A signal or a near time limit, agreed by all
ranks at a step boundary (requeue.py), ends the loop with a checkpoint and then asks for the requeue.

One host synchronisation per step: the loss, the gradient norm and the stop flags travel in one
collective and one device-to-host transfer (`Training.finish_step`); nothing else in a step reads
a device value. Python's cyclic garbage collector is off during the loop (a collection in the
middle of a step, or inside `dcp.save`, costs as much as the save itself: issue 12) and runs at
chosen points instead: every GC_EVERY_STEPS steps (young generations only) and in full before a
checkpoint save.
"""

from __future__ import annotations

import gc
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.rundir.events import RESUMED, WEIGHTS_LOADED
from hpctrain.runtime.checkpoint.checkpointer import Checkpointer
from hpctrain.runtime.data.evaluate import Evaluator
from hpctrain.runtime.data.tokens import build_sampler
from hpctrain.runtime.distributed import DistEnv
from hpctrain.runtime.observe.telemetry import MemoryTracker, Telemetry, Throughput
from hpctrain.runtime.observe.trackers import Trackers
from hpctrain.runtime.optim import build_optimizers
from hpctrain.runtime.parallel.build import build_training
from hpctrain.runtime.parallel.precision import local_tensor
from hpctrain.runtime.requeue import RequeueController

if TYPE_CHECKING:
    from hpctrain.config import Job

# "0" is read as checkpoint.final: false (the benchmarks' older way to skip a 1B model's ~15 GB final save).
FINAL_CHECKPOINT_ENV = "HPCTRAIN_FINAL_CHECKPOINT"
# torchtitan's default (training.gc_freq): often enough that cycles from autograd graphs and
# DTensor specs never pile up, rare enough that its cost disappears in the step time.
GC_EVERY_STEPS = 50


class Trainer:
    """One rank's training run in `run_dir`, from scratch or from the newest complete checkpoint."""

    def __init__(self, job: Job, run_dir: str, device: torch.device, env: DistEnv,
                 resume_from: str | None = None) -> None:
        self.job, self.run_dir, self.device, self.env = job, run_dir, device, env
        memory = MemoryTracker(device)
        # No initialisation yet: restore() draws the weights only when no checkpoint is loaded.
        self.training = build_training(job, device, initialise=False)
        dims = self.training.dims
        self.coords = dims.coords(env.rank)
        self.data = build_sampler(job, self.coords["dp"], dims.dp)
        self.evaluator = Evaluator(job, self.training, self.coords["dp"])
        self.optimizers, self.lr_schedulers = build_optimizers(job, self.training.model_parts)
        self.tokens_per_step = int(job.train.global_batch) * self.training.args.seq_len
        self.telemetry = Telemetry(run_dir, env.rank, env.world_size, env.attempt, device,
                                   Throughput.for_job(job, env.world_size, device.type),
                                   self.tokens_per_step, memory)
        self.telemetry.all_to_all = self.training.dims.ep_enabled
        self.telemetry.context = self.training.dims.cp_enabled
        self.telemetry.extra.update(coords=self.coords, local_rank=env.local_rank, launcher=env.launcher,
                                    param_count_local=self.training.param_count_local())
        self.checkpointer = Checkpointer(job, run_dir, self.training.model_parts, self.optimizers,
                                         self.telemetry.event)
        self.step = 0
        self.requeue = RequeueController(job, env, device, self.telemetry.event)
        self.resume_from = resume_from
        self.last_metrics: dict[str, Any] = {}
        self.moe_stats: dict[str, float] = {}  # the last step's MoE metrics (Training.moe_step_stats)
        self.trackers: Trackers | None = None  # started once the resumed step is known
        self._agreed_flags: list[int] | None = None  # the stop flags of the last step, agreed by all ranks

    # -- state -----------------------------------------------------------------------------------
    def train_state(self) -> dict[str, Any]:
        """The JSON part of a checkpoint (model and optimizer go through DCP)."""
        scaler = self.training.loss_scaler
        dims = self.training.dims
        return {
            "tokens_seen": self.step * self.tokens_per_step,
            "data": self.data.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "layout": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "cp": dims.cp,
                       "virtual_stages": len(self.training.model_parts),
                       "schedule": self.job.parallel.schedule if dims.pp_enabled else None,
                       "zero": self.job.parallel.zero if self.training.fsdp else None},
            "job_name": self.job.name,
        }

    def restore(self) -> int:
        """Load the newest complete checkpoint (or --resume-from); return the step resumed from.

        The model was built without initialisation. The weights no checkpoint holds (all of them at a
        fresh start; under LoRA the frozen base at every start, its checkpoints hold the adapters only)
        are read from model.init_from (each rank reads its shards) or drawn from the seed (model/init.py);
        a resume without LoRA draws nothing."""
        path = self.checkpointer.find(self.resume_from)
        if path is None or self.job.train.lora is not None:
            if self.job.transformer.init_from:
                from hpctrain.runtime.model.hf_weights import load_init_from

                self.telemetry.event(WEIGHTS_LOADED, **load_init_from(self.training))
            else:
                self.training.initialise()
        if path is None:
            return 0
        body = self.checkpointer.load(path)
        self.step = int(body["step"])
        self.data.load_state_dict(body["data"])
        self.lr_schedulers.load_state_dict(body["lr_scheduler"])
        if self.training.loss_scaler is not None and body.get("loss_scaler"):
            self.training.loss_scaler.load_state_dict(body["loss_scaler"])
        self.telemetry.event(RESUMED, step=self.step, path=path)
        return self.step

    def state_bytes(self) -> dict[str, int]:
        params = [local_tensor(p) for p in self.training.parameters()]
        grads = [local_tensor(p.grad) for p in self.training.parameters() if p.grad is not None]
        return {"param": sum(t.numel() * t.element_size() for t in params),
                "grad": sum(t.numel() * t.element_size() for t in grads),
                "optimizer_state": self.optimizers.state_bytes()}

    # -- loop ------------------------------------------------------------------------------------
    def should_continue(self) -> bool:
        if self.step >= self.job.train.steps:
            return False
        # Every rank agrees at every step boundary (signal or time limit -> all stop together): with
        # the flags gathered in the last step's one reduction, or before the first step in a
        # collective of its own.
        flags, self._agreed_flags = self._agreed_flags, None
        if flags is None:
            return not self.requeue.should_stop(self.step, self.checkpointer.last_save_s)
        signum, time_short = flags
        return not self.requeue.decide(self.step, signum, time_short)

    def train_step(self) -> tuple[float, float, float]:
        inputs, labels = (torch.from_numpy(a) for a in self.data.next_batch())
        self.optimizers.zero_grad()
        local_loss = self.training.forward_backward(inputs, labels)
        flags = self.requeue.local_flags(self.checkpointer.last_save_s)
        loss, grad_norm, self._agreed_flags = self.training.finish_step(
            local_loss, self.job.train.optimizer.grad_clip, flags)
        lr = self.optimizers.lr
        self.moe_stats = self.training.moe_step_stats()
        self.training.optimizer_step(self.optimizers)  # type: ignore[arg-type]  # duck-typed: step()
        self.lr_schedulers.step()
        return loss, grad_norm, lr

    def train(self) -> dict[str, Any]:
        resumed = self.restore()
        self.telemetry.start(resumed)
        self.trackers = Trackers(self.job, self.run_dir, self.env.rank, resumed)
        gc.collect()
        # What exists now (torch, the model, the optimizer: ~300k objects) lives for the whole run:
        # frozen, the full collections before each save scan only what training made since, which
        # took the save's pause from ~0.2-0.3 s of collecting to nothing (bench/torchtitan_compare.py).
        gc.freeze()
        gc.disable()
        try:
            return self._loop(resumed)
        finally:
            gc.unfreeze()
            gc.enable()

    def _loop(self, resumed: int) -> dict[str, Any]:
        assert self.trackers is not None  # started by train()
        while self.should_continue():
            self.step += 1
            self.telemetry.begin_step()
            start = time.perf_counter()
            # No device synchronisation here: finish_step's transfer already waited for the
            # backward; the optimizer step's kernels are counted in the next step's time.
            loss, grad_norm, lr = self.train_step()
            self.telemetry.end_step(time.perf_counter() - start)
            if self.step % GC_EVERY_STEPS == 0:
                gc.collect(1)
            # Outside the step time: a validation is not part of the training throughput.
            val_loss = self.evaluator.run() if self.evaluator.due(self.step) else None
            if self.step % self.job.train.log_every == 0 or self.step == self.job.train.steps or val_loss is not None:
                self._log(loss, grad_norm, lr, val_loss)
            if self.checkpointer.should_save(self.step):
                gc.collect()  # before the save, never inside it
            if self.checkpointer.save(self.step, self.train_state()):
                self.telemetry.write_rank_summary(self.state_bytes(), "running")
        stopped = self.step < self.job.train.steps
        # A stop request always saves (the requeue resumes from it); checkpoint.final: false skips the last save.
        final = self.job.checkpoint.final and os.environ.get(FINAL_CHECKPOINT_ENV, "1") != "0"
        if stopped or final:
            gc.collect()
            self.checkpointer.save(self.step, self.train_state(), force=True)
        self.checkpointer.wait()
        self.trackers.close(finished=not stopped)
        outcome = self.requeue.finish(self.step, saved=self.checkpointer.last_saved_step == self.step)
        self.telemetry.write_rank_summary(self.state_bytes(), "stopped" if stopped else "finished")
        return {"step": self.step, "resumed_from": resumed, "stopped": stopped, "requeue": outcome,
                "requeue_why_not": self.requeue.why_not, **self.last_metrics}

    def _log(self, loss: float, grad_norm: float, lr: float, val_loss: float | None = None) -> None:
        # The SDPA backend the job asked for (train.attention_kernel; "auto": torch's choice), and fp8's recipe.
        extra: dict[str, Any] = {"attention_kernel": self.job.train.attention_kernel, **self.moe_stats}
        if self.job.train.precision == "fp8":
            extra["fp8_recipe"] = self.job.train.fp8.recipe + (" (emulated)" if self.job.train.fp8.emulate else "")
        if val_loss is not None:
            extra["val_loss"] = val_loss
        if self.training.loss_scaler is not None:
            extra["loss_scale"] = self.training.loss_scaler.scale
        record = self.telemetry.log(self.step, loss, lr, grad_norm, self.step * self.tokens_per_step, **extra)
        self.last_metrics = record
        if self.trackers is not None:
            self.trackers.log(record)
        if self.env.rank == 0:
            val = f" | val_loss {val_loss:.4f}" if val_loss is not None else ""
            print(f"step {self.step:>6} | loss {loss:.4f}{val} | lr {lr:.3e} | grad_norm {grad_norm:.3f} | "
                  f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1e3:.1f} ms", flush=True)

    def close(self) -> None:
        self.telemetry.close()

