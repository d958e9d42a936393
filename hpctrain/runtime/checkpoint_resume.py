"""Which checkpoint a run starts from: ownership, writability, verified contents, fall-back.

Rank 0 makes the decisions that touch the checkpoint directory (is it writable, whose is it, which
folders are complete by the cheap checks: hpctrain.rundir.checkpoints) and broadcasts the candidates,
newest first. Then every rank hashes its share of the newest candidate's files; if any file is
damaged the candidate is skipped (said on stderr and as a `checkpoint skipped` event) and the next
older one is tried. Checkpoints newer than the one chosen are set aside (`.superseded` after an
explicit older --resume-from, `.corrupt` when damaged), so that pruning keeps the new saves and a
requeue does not meet them again.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch.distributed as dist

from hpctrain.errors import ConfigError
from hpctrain.rundir.checkpoints import (STEP_DIR, InvalidCheckpoint, claim, foreign_owner, ownership_error,
                                         read_metadata, run_identity, scan, share, verify_files)
from hpctrain.runtime.checkpoint import Checkpointer, gather
from hpctrain.runtime.safe_dcp import UnsafeIndex, read_index


def _broadcast(value: Any, world_size: int) -> Any:
    box = [value]
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def find(ck: Checkpointer, resume_from: str | None) -> str | None:
    """The verified checkpoint to start from, the same on every rank; None: start afresh."""
    plan: Any = None
    if ck.rank == 0:
        plan = _prepare(ck) or _candidates(ck, resume_from)
    plan = _broadcast(plan, ck.world_size)
    if isinstance(plan, ConfigError):
        raise plan
    candidates, explicit_one = plan
    chosen, damaged, first_problem = None, [], ""
    for path in candidates:
        problems = _verify_share(ck, path)
        if not problems:
            chosen = path
            break
        damaged.append(path)
        first_problem = first_problem or problems[0]
        if ck.rank == 0:
            _skip(ck, path, problems[0])
        if explicit_one:
            raise ConfigError(f"--resume-from {path}: not a complete checkpoint: {problems[0]}")
    if chosen is None and damaged:
        # Starting afresh would overwrite the run's history with step 1 (and a torch whose DCP index
        # the allow-list does not know would look exactly like this): stop, keep every folder as it is.
        raise ConfigError(f"checkpoint.dir {ck.folder}: none of its {len(damaged)} checkpoint(s) passed "
                          f"verification ({os.path.basename(damaged[0])}: {first_problem}); nothing was loaded "
                          "or moved: restore the files, or move the damaged step-N folders away to start afresh")
    if ck.rank == 0:
        step = int(read_metadata(chosen)["step"]) if chosen else 0
        if resume_from is not None or damaged:
            _set_aside_newer(ck, step, damaged)
    _broadcast(None, ck.world_size)  # nobody loads before the folders are where they will stay
    return chosen


def _prepare(ck: Checkpointer) -> ConfigError | None:
    """This run's id, the directory's owner, and a claim written there (which proves it writable)."""
    try:
        ck.run_id = run_identity(ck.run_dir)
    except (OSError, InvalidCheckpoint) as exc:
        return ConfigError(f"--run-dir {ck.run_dir}: cannot read or write its run id ({exc})")
    other = foreign_owner(ck.folder, ck.run_id, ck.run_dir)
    if other is not None and not ck.adopt:
        return ConfigError(ownership_error(ck.folder, other))
    if other is not None:
        print(f"hpctrain.runtime: checkpoint.adopt: continuing from the checkpoints of run {other.get('dir')} "
              f"in {ck.folder}", file=sys.stderr, flush=True)
        ck.event("checkpoint adopted", path=ck.folder, previous_run=other)
    try:
        claim(ck.folder, ck.run_id, ck.run_dir)
    except OSError as exc:
        return ConfigError(f"checkpoint.dir {ck.folder}: cannot write there ({exc.strerror or exc}); the run "
                           "could not save a checkpoint: choose a writable checkpoint.dir")
    return None


def _candidates(ck: Checkpointer, resume_from: str | None) -> tuple[list[str], bool] | ConfigError:
    """(complete checkpoints by the cheap checks, newest first; whether it is one explicit folder)."""
    if resume_from is not None and STEP_DIR.match(os.path.basename(os.path.normpath(resume_from))):
        try:
            read_metadata(resume_from)
        except InvalidCheckpoint as exc:
            return ConfigError(f"--resume-from {resume_from}: not a complete checkpoint: {exc}")
        return [os.path.abspath(resume_from)], True
    folder = resume_from if resume_from is not None else ck.folder
    found = scan(folder)
    for path, reason in found.rejected:
        _skip(ck, path, reason)
    if resume_from is not None and found.newest is None:
        return ConfigError(f"--resume-from {resume_from}: no complete checkpoint (step-N/ folder with verified "
                           "metadata.json) there")
    return [os.path.abspath(path) for _, path in reversed(found.complete)], False


def _verify_share(ck: Checkpointer, path: str) -> list[str]:
    """Every rank hashes its share of path's files; the problems of all ranks (a collective)."""
    try:
        files = read_metadata(path).get("files")
        problems = ([] if not isinstance(files, dict)  # format 1: no manifest, the cheap checks are all
                    else verify_files(path, files, share(files, ck.rank, ck.world_size)))
        if ck.rank == 0 and not problems:
            read_index(path)  # refuses an index that would run code when DCP unpickles it
    except (InvalidCheckpoint, UnsafeIndex) as exc:
        problems = [str(exc)]
    except OSError as exc:
        problems = [f"unreadable ({exc.strerror or exc})"]
    return [p for rank_problems in gather(problems) for p in rank_problems]


def _skip(ck: Checkpointer, path: str, reason: str) -> None:
    print(f"hpctrain.runtime: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
    ck.event("checkpoint skipped", path=path, reason=reason)


def _set_aside_newer(ck: Checkpointer, step: int, damaged: list[str]) -> None:
    """Resuming from an older step starts a new timeline: move this run's later checkpoints aside
    (step-N.superseded, or step-N.corrupt when damaged), so that pruning keeps the new saves and a
    requeue resumes from them."""
    for newer_step, path in scan(ck.folder).complete:
        if newer_step > step:
            bad = os.path.abspath(path) in damaged
            target = f"{path}.corrupt" if bad else f"{path}.superseded"
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            why = "it is damaged" if bad else "a later checkpoint"
            print(f"hpctrain.runtime: resuming from step {step}: moved {path} ({why}) to {target}",
                  file=sys.stderr, flush=True)
            ck.event("checkpoint superseded", path=target, step=newer_step, resumed_step=step,
                     reason="damaged" if bad else "older step resumed")
