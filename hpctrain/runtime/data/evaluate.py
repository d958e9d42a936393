"""Validation loss: forward only, on a held-out token file, the same batches every time.

An evaluation reads `train.eval_batches` global batches from the validation file, starting at sample 0
each time (a fresh sampler: the windows are drawn in the file's seeded order, so the batches never
change between evaluations, restarts or layouts). Each dp rank takes its slice, splits it into the
training's micro-batches and runs them forward (through the pipeline schedule's `eval` when pp > 1);
the loss is the global-batch mean exactly as in `Training.train_step`, averaged over the batches.
Every rank gets the same number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from hpctrain.config.data_files import eval_file
from hpctrain.runtime.data.tokens import ShardedSampler, TokenFile, resolve_dtype
from hpctrain.runtime.model.transformer import cross_entropy_loss
from hpctrain.runtime.parallel.precision import local_tensor

if TYPE_CHECKING:
    from hpctrain.config import Job
    from hpctrain.runtime.training import Training


class Evaluator:
    """Computes the validation loss of a `Training` (runtime/training.py) on its dp rank's slices."""

    def __init__(self, job: Job, training: Training, dp_rank: int) -> None:
        self.job, self.training, self.dp_rank = job, training, dp_rank
        self.every = int(job.train.eval_every)
        self.batches = int(job.train.eval_batches)
        path = eval_file(job.train)
        self.source: Optional[TokenFile] = None
        if self.every and path:
            model = training.args  # the resolved shape
            dtype = resolve_dtype(path, job.train.data_dtype, model.vocab)
            self.source = TokenFile(path, dtype, model.vocab, model.seq_len, int(job.train.seed),
                                    field="train.eval_data")

    def due(self, step: int) -> bool:
        """Evaluate after this step? Every `eval_every` steps and after the last one."""
        return self.source is not None and (step % self.every == 0 or step == int(self.job.train.steps))

    @torch.no_grad()
    def run(self) -> float:
        training = self.training
        sampler = ShardedSampler(self.source, int(self.job.train.global_batch), self.dp_rank, training.dims.dp)
        for part in training.model_parts:
            part.eval()
        try:
            total = 0.0
            for _ in range(self.batches):
                inputs, labels = (training.local_tokens(torch.from_numpy(a).to(training.device))
                                  for a in sampler.next_batch())
                with training._contexts():
                    local = self._pipelined(inputs, labels) if training.schedule is not None \
                        else self._plain(inputs, labels)
                total += training._global_mean(local)
            return total / self.batches
        finally:
            for part in training.model_parts:
                part.train()

    def _plain(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        training = self.training
        model: Any = training.model_parts[0]
        total = torch.zeros((), device=training.device)
        for x, y in zip(inputs.chunk(training.n_microbatches), labels.chunk(training.n_microbatches)):
            total += local_tensor(cross_entropy_loss(model(x), y).detach()).float()
        return total / training.n_microbatches

    def _pipelined(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        training = self.training
        losses: list[torch.Tensor] = []
        args = (inputs,) if training.has_first_stage else ()
        training.schedule.eval(*args, target=labels, losses=losses)
        if not training.has_last_stage:
            return torch.zeros((), device=training.device)
        scale = training.loss_scaler.scale if training.loss_scaler is not None else 1.0
        return torch.stack([local_tensor(loss.detach()).float() for loss in losses]).mean() / scale
