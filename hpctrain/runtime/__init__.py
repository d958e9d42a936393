"""Runtime: runs on compute nodes, one process per GPU. The only stage that imports torch.

`python -m hpctrain.runtime --job job.resolved.yaml --run-dir DIR` (__main__.py) starts one rank:
distributed.py finds the launcher's ranks and opens the process group, trainer.py runs the loop,
requeue.py stops at a signal or a near time limit and asks for the requeue. By concept:

    model/        the transformer, its norm, sharded initialisation, LoRA, Hugging Face weights
    parallel/     one module per dimension (tensor, sequence, vocab, pipeline, fsdp), ParallelDims,
                  activation checkpointing, compile, precision, the gradient norm, and build.py:
                  the build order (meta -> PP -> FP8 -> TP -> LoRA -> AC -> compile -> host embedding -> FSDP2 -> init)
    checkpoint/   the Checkpointer, durable files, hashing, safe DCP loading, RNG states
    data/         token streams and evaluation
    observe/      telemetry (metrics.jsonl, events, rank summaries), comm timing, trackers
    training.py   `Training`: one rank's share of the model and its step (built by parallel/build.py)
    optim.py      optimizers and the LR schedule

Imports config, plan and rundir only (docs/architecture.md). Login-side tools live elsewhere:
data preparation in hpctrain.data (torch-free), export in hpctrain.export (torch).
data_commands.py and export_commands.py (the CLI registration of those commands, moving to hpctrain.cli)
import them only when the command runs.
"""
