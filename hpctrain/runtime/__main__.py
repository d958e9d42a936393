"""`python -m hpctrain.runtime --job RESOLVED.yaml --run-dir DIR [--resume-from CKPT]`

One process per GPU (srun, torchrun, or a single process). Exit codes (docs/architecture.md section 4):
0 trained (or stopped cleanly after a checkpoint on restart.signal / SIGTERM / a near time limit, having
asked for the requeue: requeue.py), 1 this rank failed (or, on rank 0, it stopped and nothing will
requeue it: the `stopped` event says why), 2 the job, the run dir,
the checkpoint or the launcher's variables are wrong (one line per problem, no traceback).
Without --resume-from the run continues from the newest complete checkpoint in its checkpoint
folder, if there is one, so a requeued job picks up where it left.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.config import Job

from hpctrain.process_exit import exit_now
from hpctrain.rundir.events import FAILED, FINISHED, STARTED, STOPPED, append_event

PROG = "python -m hpctrain.runtime"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="Train a resolved hpctrain job on this process's rank.")
    parser.add_argument("--job", required=True, metavar="RESOLVED.yaml", help="the resolved job (job.resolved.yaml)")
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory (metrics, events, checkpoints)")
    parser.add_argument("--resume-from", metavar="CKPT",
                        help="a step-N checkpoint folder, or a folder of them (newest complete one is used); "
                             "default: the newest complete checkpoint of this run, if any")
    return parser.parse_args(argv)


def unresolved(job: Job) -> list[str]:
    """Fields still 'auto' that this run needs concrete (the planner fills them)."""
    fix = "run `hpctrain plan` (launch writes job.resolved.yaml with every auto filled)"
    p, t = job.parallel, job.train
    fields = [("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.dp", p.dp),
              ("train.micro_batch", t.micro_batch), ("train.activation_checkpointing", t.activation_checkpointing)]
    if p.pp != 1:
        fields += [("parallel.schedule", p.schedule), ("parallel.virtual_stages", p.virtual_stages)]
    if p.dp != 1 or p.cp != 1 or p.offload_optimizer:  # FSDP shards over dp x cp
        fields.append(("parallel.zero", p.zero))
    return [f"{name}: got 'auto'; the runtime needs a resolved job: {fix}" for name, value in fields if value == "auto"]


def _load(args: argparse.Namespace) -> Job:
    from hpctrain.config import load_job
    from hpctrain.errors import ConfigError

    if not os.path.isfile(args.job):
        raise ConfigError(f"--job {args.job}: no such file")
    job = load_job(args.job)
    problems = unresolved(job)
    if problems:
        raise ConfigError(problems)
    from hpctrain.config.data_files import check_data

    check_data(job)  # token files vs their sidecars, before any process group starts
    try:
        os.makedirs(args.run_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--run-dir {args.run_dir}: cannot create it ({exc.strerror})") from None
    return job


def _write_resolved(job: Job, run_dir: str) -> None:
    """Keep a copy of the job next to the results when the launcher did not put one there."""
    from hpctrain.rundir.layout import RESOLVED_FILE

    path = os.path.join(run_dir, RESOLVED_FILE)
    if not os.path.exists(path):
        from hpctrain.config import dump_job

        from hpctrain.rundir.safe_files import write_atomic

        write_atomic(path, dump_job(job))


def _hosts() -> list[str]:
    import socket

    import torch.distributed as dist

    me = socket.gethostname()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [me]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return sorted(set(everyone))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from hpctrain.runtime.distributed import default_omp_threads

    default_omp_threads()  # before torch is imported
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.distributed import check_env, detect_env, place_rank

    rank = 0
    try:
        env = detect_env()
        rank = env.rank
        check_env(env)
        job = _load(args)
        slot = env.rank
        env = place_rank(env, job.placement.rank_order if job.placement else None, job.cluster.gpus_per_node)
        rank = env.rank
        _to_rank_log(env.rank, slot, env.world_size)
    except ConfigError as exc:
        return _user_error(exc, rank)
    return _run(job, env, args)


def _to_rank_log(rank: int, slot: int, world_size: int) -> None:
    """From here on, stdout and stderr (Python's and C's: NCCL, faulthandler) go to logs/rank-R.attempt-A.log,
    R the GLOBAL rank: the launcher captured this process by slot (srun's %t), which differs from the rank
    under a placement that reorders ranks (rundir/ranks.py). Only when the launcher asks (HPCTRAIN_LOG_DIR)."""
    from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, redirect_to_rank_log

    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    try:
        attempt = int(os.environ.get(ATTEMPT_ENV, "") or 0)
    except ValueError:
        attempt = 0
    if not redirect_to_rank_log(folder, rank, attempt, PROG):  # keep the launcher's capture rather than fail
        return
    import socket

    # Which process this log belongs to (ranks/rank-R.json has the same pid and host).
    print(f"{PROG}: rank {rank} of {world_size} (slot {slot}, pid {os.getpid()}, host {socket.gethostname()}, "
          f"attempt {attempt})", flush=True)


def _user_error(exc: Exception, rank: int) -> int:
    """Exit 2: the job, the run dir or the launcher's variables are wrong. Say so, and tell the batch
    script (HPCTRAIN_BAD_INPUT_MARKER) that a requeue would fail the same way."""
    prefix = f"{PROG} [rank {rank}]: " if rank else f"{PROG}: "
    for line in str(exc).splitlines():
        print(prefix + line, file=sys.stderr, flush=True)
    from hpctrain.rundir.layout import BAD_INPUT_MARKER_ENV

    marker = os.environ.get(BAD_INPUT_MARKER_ENV)
    if marker:
        first = (str(exc).splitlines() or ["bad input"])[0][:300]
        from hpctrain.rundir.read import RunDirError
        from hpctrain.rundir.safe_files import append

        try:
            append(marker, f"rank {rank}: {first}\n".encode("utf-8"))
        except (OSError, RunDirError):
            pass  # the exit code 2 still says it; the marker only spares the requeue
    return 2


def _run(job: Job, env: Any, args: argparse.Namespace) -> int:
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.checkpoint.checkpointer import CheckpointSaveError
    from hpctrain.config import job_to_dict
    from hpctrain.rundir.data_identity import check_and_record
    from hpctrain.rundir.layouts import layout_of
    from hpctrain.runtime.distributed import init_distributed, shutdown, torch_build
    def event(name: str, every_rank: bool = False, **fields: Any) -> None:
        if env.rank == 0 or every_rank:
            append_event(args.run_dir, name, attempt=env.attempt, **fields)

    from hpctrain.runtime.requeue import FLAG

    # Before the slow start-up (a signal then is kept for the first step boundary), and never removed: a
    # signal after the last step (a late preemption) must not kill a rank that is exiting 0.
    FLAG.install(job.restart.signal)
    trainer = None
    try:
        # Before the process group: the token files this run recorded at its first start are still the same.
        check_and_record(job, args.run_dir, write=env.rank == 0)
        device = init_distributed(env, need_group=bool(job.parallel.offload_optimizer), gpu=job.cluster.gpu,
                                  allow_cpu=job.runtime.allow_cpu)
        _check_fp8(job, device)
        if env.rank == 0:
            _write_resolved(job, args.run_dir)
        event(STARTED, world_size=env.world_size, launcher=env.launcher, hosts=_hosts(), device=device.type,
              gpu=job.cluster.gpu, **torch_build(), layout=layout_of(job_to_dict(job)))
        from hpctrain.runtime.trainer import Trainer

        trainer = Trainer(job, args.run_dir, device, env, resume_from=args.resume_from)
        result = trainer.train()
        stop: dict[str, Any] = ({"requeue": result.get("requeue"), "why_not": result.get("requeue_why_not")}
                                if result["stopped"] else {})
        event(STOPPED if result["stopped"] else FINISHED, step=result["step"],
              loss=result.get("loss"), resumed_from=result["resumed_from"], **stop)
        trainer.close()
        shutdown()
        # Stopped early and nothing will bring it back (budget spent, scontrol failed, no checkpoint, not under
        # Slurm at all): the job did not do its work, so it must not end COMPLETED (exit codes:
        # docs/architecture.md). A launcher that asked for the stop (a local cancel) records CANCELLED
        # whatever rank 0 says.
        if result["stopped"] and result.get("requeue") == "not-requeued":
            return 1
        return 0
    except ConfigError as exc:
        # Every rank that refuses says so: the first to exit 2 gets the others killed (srun --kill-on-bad-exit,
        # the rank group), so rank 0 may never reach this line.
        event(FAILED, every_rank=True, reason=str(exc).splitlines()[0], rank=env.rank, exit_code=2)
        return _user_error(exc, env.rank)
    except CheckpointSaveError as exc:  # e.g. a full disk: what it is, in one line, no traceback
        print(f"{PROG} [rank {env.rank}]: failed: {exc}", file=sys.stderr, flush=True)
        event(FAILED, reason=str(exc), exit_code=1)
        return 1
    except BaseException as exc:  # a crash: say which rank, keep the traceback for the log
        if isinstance(exc, KeyboardInterrupt):
            reason = "interrupted"
        else:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        traceback.print_exc()
        print(f"{PROG} [rank {env.rank}]: failed: {reason}", file=sys.stderr, flush=True)
        try:
            event(FAILED, every_rank=True, reason=reason, rank=env.rank, exit_code=1)
            if trainer is not None:
                trainer.telemetry.write_rank_summary(trainer.state_bytes(), "failed")
        except Exception:  # noqa: BLE001 - reporting must not hide the original failure
            pass
        return 1


def _check_fp8(job: Job, device: Any) -> None:
    """train.precision fp8: the device this rank got has FP8 tensor cores, unless emulated (exit 2 if not)."""
    if job.train.precision != "fp8":
        return
    import torch

    from hpctrain.runtime.distributed import check_fp8_device

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    check_fp8_device(job.train.precision, job.train.fp8.emulate, device.type, capability, job.train.fp8.recipe)


if __name__ == "__main__":
    CODE = main()
    exit_now(CODE, wait=CODE != 1)  # a failed rank does not wait (process_exit.py)
