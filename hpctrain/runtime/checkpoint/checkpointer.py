"""Atomic distributed checkpoints in `step-N/` folders (torch.distributed.checkpoint).

Protocol (issue 7 item 1, issue 18): every rank writes its shards with DCP into `step-N.partial/`,
and its RNG states into `step-N.partial/rng/rank-R.pt` (plain tensors: rng_state.py); each rank
hashes its share of the files (its own DCP shard while writing it: hashing.py); rank 0
writes `metadata.json` (step, tokens seen, layout, data position, LR-scheduler and loss-scaler
state, the run that wrote it, the size and sha256 of every file, versions, and the sha256 of all
that) and renames the folder to `step-N/`. What counts as complete, and how folders are found, is
hpctrain.rundir.checkpoints (torch-free, shared with launch). Before loading, the ranks hash the
chosen checkpoint's files (each a share) and fall back to the next older one when any is damaged.
`keep_last` prunes older complete checkpoints only after the new one is complete (renamed out of
sight at once, deleted by a thread while training goes on). A save that fails (a full disk) fails
on every rank with one line saying so.

Loading (`find`, then `load`): rank 0 makes the decisions that touch the checkpoint directory (is
it writable, whose is it, which folders are complete by the cheap checks) and broadcasts the
candidates, newest first. Then every rank hashes its share of the newest candidate's files; if any
file is damaged the candidate is skipped (said on stderr and as a `checkpoint skipped` event) and
the next older one is tried. Checkpoints newer than the one chosen are set aside (`.superseded`
after an explicit older --resume-from, `.corrupt` when damaged), so that pruning keeps the new saves
and a requeue does not meet them again.

Model and optimizer go through `get_state_dict` / `set_state_dict` with
`flatten_optimizer_state_dict=True` (with PP the nested form loads but fails at the next step with
KeyError 'betas'), one (part, optimizer) pair per model part, merged under full-model names: the
same checkpoint loads into any layout (DCP reshards). Each parameter's optimizer settings are saved as
one entry (settings.py).

Async (`checkpoint.async: true`): DCP `async_save` in a thread, on its own gloo group so its
collectives never interleave with training's; the metadata + rename happen at the next save or
at the end of training, on every rank at the same point.

Sync saves block training for the DCP write only (issue 12: the whole save within 1.15x of a bare
`dcp.save`), without its fsyncs: the finalize (fsync and sha256 of every file, read back from the
page cache, manifest gather, metadata, fsyncs, rename, prune) runs in a thread on that same
separate gloo group, and is joined at the next save or at `wait()` (end of training, requeue/stop:
the trainer's loop always ends in `wait()`), which raises its failure on every rank. Until it completes the folder is
`step-N.partial/` without metadata: a crash before then leaves the previous checkpoint the latest
valid one, exactly as a crash inside a blocking save did.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import hpctrain
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.runtime.checkpoint import rng_state, settings
from hpctrain.runtime.checkpoint.files import describe_failure, fsync_dir, fsync_file, remove_all
from hpctrain.runtime.checkpoint.hashing import HashingWriter
from hpctrain.runtime.checkpoint import tied
from hpctrain.runtime.checkpoint.safe_dcp import SafePlanner, SafeReader, UnsafeIndex, read_index
from hpctrain.runtime.checkpoint.save_planner import SavePlanner
from hpctrain.runtime.distributed import barrier
from hpctrain.rundir.checkpoints import (  # noqa: F401 - re-exported: the runtime's names for them
    CHECKPOINTS_DIR, FORMAT, METADATA_FILE, PARTIAL_DIR, STEP_DIR, InvalidCheckpoint, Scan, checksum, claim,
    data_files, foreign_owner, hash_files, ownership_error, read_metadata, run_identity, run_record, scan, share,
    verify_checkpoint, verify_files, write_metadata)
from hpctrain.rundir.events import (
    CHECKPOINT_ADOPTED, CHECKPOINT_FAILED, CHECKPOINT_SAVED, CHECKPOINT_SKIPPED, CHECKPOINT_SUPERSEDED,
)

if TYPE_CHECKING:
    from hpctrain.config import Job

# ignore_frozen_params: a LoRA run saves its adapters only; the frozen base is rebuilt on resume (from the
# seed or model.init_from). Loading then sets only those keys (strict=False; DCP itself fails on a key
# the checkpoint lacks). Without LoRA no parameter is frozen and both options change nothing.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
FROZEN_BASE_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
# A single process saves without a process group on purpose; DCP warns about that on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointSaveError(HpctrainError):
    """A save that failed on some rank (e.g. a full disk); exit 1, one line, no traceback."""


def plain_tensor(value: Any) -> Any:
    """`value` with a wrapper subclass around its storage taken off: torchao's fp8 all-gather
    (train.precision fp8, runtime/parallel/float8.py) keeps each weight, and the optimizer states made
    like it, as a `WeightWithDynamicFloat8CastTensor` holding the fp32 values in `_tensor`. DCP would pickle
    the subclass (and the allow-listed reader, rightly, refuses to unpickle it); the plain tensor shares its
    storage, so a save writes the ordinary fp32 weights and a load fills them in place."""
    from torch.distributed.tensor import DTensor

    local = value._local_tensor if isinstance(value, DTensor) else value
    inner = getattr(local, "_tensor", None)
    if not isinstance(local, torch.Tensor) or type(local) in (torch.Tensor, torch.nn.Parameter) \
            or type(inner) is not torch.Tensor:
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return inner


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's value, on every rank (a collective; one process: [value])."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value, group=group)
        return out
    return [value]


def _broadcast(value: Any, world_size: int) -> Any:
    box = [value]
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class _Pending:
    """An async save whose metadata and rename are still to do."""

    step: int
    partial: str
    final: str
    body: dict[str, Any]
    future: Any
    started: float  # time.perf_counter() when the save began
    blocking_s: float = 0.0  # how long training stood still for it
    writer: HashingWriter | None = None  # hashed the DCP files as it wrote them
    rng_failure: str | None = None  # why this rank's RNG file could not be written


class Checkpointer:
    """Save and load this rank's model parts and optimizers; the protocol is in the module docstring."""

    def __init__(self, job: Job, run_dir: str, model_parts: list[Any], optimizers: Any,
                 event: Callable[..., None] | None = None) -> None:
        cfg = job.checkpoint
        self.run_dir = os.path.abspath(run_dir)
        self.folder = os.path.abspath(cfg.dir or os.path.join(run_dir, CHECKPOINTS_DIR))
        self.every_steps, self.keep_last, self.async_mode = cfg.every_steps, cfg.keep_last, bool(cfg.async_)
        self.adopt = bool(getattr(cfg, "adopt", False))
        self.parts, self.optimizers = model_parts, list(optimizers)
        self.rank, self.world_size = _rank()
        self.event = event or (lambda name, **fields: None)
        self.pending: _Pending | None = None
        self.last_saved_step: int | None = None
        self.last_save_s: float | None = None  # how long the last save took to complete
        self.run_id: str | None = None  # rank 0's, read from the run directory (rundir.checkpoints)
        # This rank's GPU (init_distributed set it), whose RNG stream is saved with the checkpoint.
        self.device_index = (torch.cuda.current_device()
                             if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._async_group = None
        self._pruner: threading.Thread | None = None  # deleting pruned checkpoints (rank 0)
        # A sync save's finalize, running in a thread (module docstring); its outcome for `wait`.
        self._finalizer: threading.Thread | None = None
        self._finalize_error: BaseException | None = None
        self._finalize_events: list[tuple[str, dict[str, Any]]] = []  # emitted by `wait` (main thread)
        if self.async_mode and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")  # keep DCP off the training group

    def _side_group(self) -> Any:
        """The gloo group for checkpoint collectives off the training thread (created at the first
        save, which every rank reaches at the same point; None without a process group)."""
        if self._async_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    # -- state dicts ------------------------------------------------------------------------------
    def _per_part(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        per_part = [get_state_dict(part, opt, options=OPTIONS) for part, opt in zip(self.parts, self.optimizers)]
        return [({k: plain_tensor(v) for k, v in m.items()}, {k: plain_tensor(v) for k, v in o.items()})
                for m, o in per_part]

    @staticmethod
    def _merge(per_part: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for m, o in per_part:
            model.update(m)
            optim.update(o)
        return {"model": model, "optim": optim}

    # -- save ----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return step % self.every_steps == 0

    def save(self, step: int, body: dict[str, Any], force: bool = False) -> bool:
        """Save at multiples of every_steps (or when `force`); `body` is the JSON train state."""
        if not (force or self.should_save(step)) or step == self.last_saved_step:
            return False
        self.wait()
        started = time.perf_counter()
        final = os.path.join(self.folder, f"step-{step}")
        partial = final + ".partial"
        barrier()  # every rank has looked before rank 0 clears anything
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                os.makedirs(self.folder, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
                shutil.rmtree(final, ignore_errors=True)  # a folder without valid metadata
                os.makedirs(os.path.join(partial, "rng"))
            except OSError as exc:
                failure = exc
        self._agree(step, partial, failure)
        rng_failure: str | None = None  # agreed with the manifests in _finalize: one collective less
        try:
            with open(os.path.join(partial, "rng", f"rank-{self.rank}.pt"), "wb") as handle:
                rng_state.save(handle, self.device_index)  # fsynced by _finalize, before the metadata
        except (OSError, RuntimeError) as exc:  # torch's zip writer raises its own RuntimeError on a short write
            rng_failure = describe_failure(exc, partial)
        full_body = {**body, "format": FORMAT, "step": step, "world_size": self.world_size,
                     "rng_files": [f"rng/rank-{r}.pt" for r in range(self.world_size)],
                     "versions": {"hpctrain": hpctrain.__version__, "torch": torch.__version__,
                                  "python": sys.version.split()[0]}}
        state = self._merge(self._per_part())
        state["optim"] = settings.group(state["optim"])  # each parameter's settings as one entry (settings.py)
        if self.async_mode:
            writer = HashingWriter(partial)
            future = dcp.async_save(state, storage_writer=writer, planner=SavePlanner(),
                                    process_group=self._async_group)
            self.pending = _Pending(step, partial, final, full_body, future, started,
                                    time.perf_counter() - started, writer, rng_failure)
        else:
            group = self._side_group()
            try:
                # A plain writer: hashing while writing costs the DCP write ~1.4x on a busy CPU;
                # the finalize thread hashes the files back from the page cache instead. It fsyncs
                # them there too (each rank its share, before the metadata that trusts them), not here
                # inside the pause.
                dcp.save(state, storage_writer=FileSystemWriter(partial, sync_files=False), planner=SavePlanner())
            except CheckpointException as exc:  # raised on every rank: DCP gathers the failures
                self._fail(step, partial, [describe_failure(exc, partial)])
            pending = _Pending(step, partial, final, full_body, None, started,
                               time.perf_counter() - started, rng_failure=rng_failure)
            self._finalizer = threading.Thread(target=self._finalize_in_thread, args=(pending, group),
                                               name=f"hpctrain-ckpt-finalize-{step}", daemon=True)
            self._finalizer.start()
        self.last_saved_step = step
        return True

    def _finalize_in_thread(self, pending: _Pending, group: Any) -> None:
        try:
            self._finalize(pending, group, self._finalize_events)
        except BaseException as exc:  # noqa: BLE001 - raised again by `wait`, on the training thread
            self._finalize_error = exc

    def _agree(self, step: int, partial: str, failure: BaseException | None, group: Any = None,
               events: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        """A collective: if the save failed on any rank, it fails on every rank (no rank left waiting
        in the next collective)."""
        reasons = [r for r in gather(None if failure is None else describe_failure(failure, partial), group) if r]
        if reasons:
            self._fail(step, partial, reasons, events)

    def _fail(self, step: int, partial: str, reasons: list[str],
              events: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        reason = reasons[0]
        message = f"{reason} while saving checkpoint step {step} to {self.folder}"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # give the space back; older checkpoints stay intact
            self._emit(events, CHECKPOINT_FAILED, step=step, path=partial, reason=reason)
        raise CheckpointSaveError(message)

    def _emit(self, events: list[tuple[str, dict[str, Any]]] | None, name: str, **fields: Any) -> None:
        """An event now, or (from the finalize thread) kept for `wait` to emit on the training thread."""
        if events is None:
            self.event(name, **fields)
        else:
            events.append((name, fields))

    def wait(self) -> None:
        """Finish an async save, a sync save's finalize and the deletion of pruned ones (every rank
        calls this at the same point); a failed finalize raises here, on every rank."""
        if self._finalizer is not None:
            self._finalizer.join()
            self._finalizer = None
            events, self._finalize_events = self._finalize_events, []
            for name, fields in events:
                self.event(name, **fields)
            error, self._finalize_error = self._finalize_error, None
            if error is not None:
                raise error
        self._join_pruner()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            waited = time.perf_counter()
            try:
                pending.future.result()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - said in words below
                failure: BaseException | None = exc
            else:
                failure = None
            self._agree(pending.step, pending.partial, failure)
            pending.blocking_s += time.perf_counter() - waited
            self._finalize(pending)

    def _finalize(self, pending: _Pending, group: Any = None,
                  events: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        """Manifest entries (each rank its share), then rank 0 writes the metadata and renames."""
        names = data_files(pending.partial)  # every rank's shards and RNG file are on disk (DCP's barrier)
        failure: BaseException | None = None
        manifest: dict[str, Any] = {}
        try:
            # This rank's RNG file on disk before the metadata that lists it is written (and trusted).
            fsync_file(os.path.join(pending.partial, "rng", f"rank-{self.rank}.pt"))
            mine = share(names, self.rank, self.world_size)
            if pending.writer is None:  # sync: DCP wrote without fsync (save)
                for name in mine:
                    fsync_file(os.path.join(pending.partial, name))
            # Async: the DCP files this rank wrote were hashed while written (hashing.py);
            # sync: read back here, from the page cache, while training goes on.
            manifest = (pending.writer.manifest(pending.partial, mine) if pending.writer is not None
                        else hash_files(pending.partial, mine))
        except OSError as exc:
            failure = exc
        shares = gather((manifest, pending.rng_failure or (None if failure is None else describe_failure(failure, pending.partial))),
                        group)
        reasons = [reason for _, reason in shares if reason]
        if reasons:
            self._fail(pending.step, pending.partial, reasons, events)
        if self.rank == 0:
            try:
                self._complete(pending, {name: entry for part, _ in shares for name, entry in part.items()})
                self._prune(pending.step)
            except OSError as exc:
                failure = exc
        # Also the end of the save for every rank: the checkpoint is complete and pruned (no barrier).
        self._agree(pending.step, pending.partial, failure, group, events)
        if self.rank == 0:
            total_s = round(time.perf_counter() - pending.started, 4)
            # Training stood still for the DCP write (sync) or for staging and the final wait (async),
            # not for the finalize. duration_s is that blocking time (what `hpctrain doctor` weighs
            # against interruptions).
            blocking_s = round(pending.blocking_s, 4)
            self._emit(events, CHECKPOINT_SAVED, step=pending.step, path=pending.final, duration_s=blocking_s,
                       blocking_s=blocking_s, finalized_after_s=total_s)
        # Start to complete (async: overlapped steps included, an upper bound): the time-limit safety
        # keeps twice this in hand (runtime/requeue.py).
        self.last_save_s = time.perf_counter() - pending.started

    def _complete(self, pending: _Pending, files: dict[str, Any]) -> None:
        self.run_id = self.run_id or run_identity(self.run_dir)
        fsync_dir(os.path.join(pending.partial, "rng"))
        write_metadata(pending.partial, {**pending.body, "files": files,
                                         "run": run_record(self.run_id, self.run_dir)})
        fsync_dir(pending.partial)
        os.replace(pending.partial, pending.final)
        fsync_dir(self.folder)

    def _prune(self, newest_step: int) -> None:
        """Complete checkpoints beyond keep_last and older partials: renamed out of `scan`'s sight at
        once, deleted by a thread while training goes on (`wait` joins it)."""
        found = scan(self.folder)
        doomed = [path for _, path in found.complete[: -self.keep_last]]
        for path, _ in found.rejected:
            match = PARTIAL_DIR.match(os.path.basename(path))
            if match and int(match.group(1)) < newest_step:
                doomed.append(path)
        hidden = [os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.startswith(_PRUNING)]
        for path in doomed:
            target = os.path.join(self.folder, _PRUNING + os.path.basename(path))
            try:
                os.rename(path, target)
                hidden.append(target)
            except OSError:  # e.g. a leftover of the same name: delete it here and now
                shutil.rmtree(path, ignore_errors=True)
        if hidden:
            self._join_pruner()
            self._pruner = threading.Thread(target=remove_all, args=(sorted(set(hidden)),), daemon=True)
            self._pruner.start()

    def _join_pruner(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    # -- load ----------------------------------------------------------------------------------
    def find(self, resume_from: str | None) -> str | None:
        """The verified checkpoint to start from, the same on every rank; None: start afresh."""
        plan: Any = None
        if self.rank == 0:
            plan = self._claim_folder() or self._candidates(resume_from)
        plan = _broadcast(plan, self.world_size)
        if isinstance(plan, ConfigError):
            raise plan
        candidates, explicit_one = plan
        chosen, damaged, first_problem = None, [], ""
        for path in candidates:
            problems = self._verify_share(path)
            if not problems:
                chosen = path
                break
            damaged.append(path)
            first_problem = first_problem or problems[0]
            if self.rank == 0:
                self._skip(path, problems[0])
            if explicit_one:
                raise ConfigError(f"--resume-from {path}: not a complete checkpoint: {problems[0]}")
        if chosen is None and damaged:
            # Starting afresh would overwrite the run's history with step 1 (and a torch whose DCP index
            # the allow-list does not know would look exactly like this): stop, keep every folder as it is.
            raise ConfigError(f"checkpoint.dir {self.folder}: none of its {len(damaged)} checkpoint(s) passed "
                              f"verification ({os.path.basename(damaged[0])}: {first_problem}); nothing was loaded "
                              "or moved: restore the files, or move the damaged step-N folders away to start afresh")
        if self.rank == 0:
            step = int(read_metadata(chosen)["step"]) if chosen else 0
            if resume_from is not None or damaged:
                self._set_aside_newer(step, damaged)
        _broadcast(None, self.world_size)  # nobody loads before the folders are where they will stay
        return chosen

    def _claim_folder(self) -> ConfigError | None:
        """This run's id, the directory's owner, and a claim written there (which proves it writable)."""
        try:
            self.run_id = run_identity(self.run_dir)
        except (OSError, InvalidCheckpoint) as exc:
            return ConfigError(f"--run-dir {self.run_dir}: cannot read or write its run id ({exc})")
        other = foreign_owner(self.folder, self.run_id, self.run_dir)
        if other is not None and not self.adopt:
            return ConfigError(ownership_error(self.folder, other))
        if other is not None:
            print(f"hpctrain.runtime: checkpoint.adopt: continuing from the checkpoints of run {other.get('dir')} "
                  f"in {self.folder}", file=sys.stderr, flush=True)
            self.event(CHECKPOINT_ADOPTED, path=self.folder, previous_run=other)
        try:
            claim(self.folder, self.run_id, self.run_dir)
        except OSError as exc:
            return ConfigError(f"checkpoint.dir {self.folder}: cannot write there ({exc.strerror or exc}); the run "
                               "could not save a checkpoint: choose a writable checkpoint.dir")
        return None

    def _candidates(self, resume_from: str | None) -> tuple[list[str], bool] | ConfigError:
        """(complete checkpoints by the cheap checks, newest first; whether it is one explicit folder)."""
        if resume_from is not None and STEP_DIR.match(os.path.basename(os.path.normpath(resume_from))):
            try:
                read_metadata(resume_from)
            except InvalidCheckpoint as exc:
                return ConfigError(f"--resume-from {resume_from}: not a complete checkpoint: {exc}")
            return [os.path.abspath(resume_from)], True
        folder = resume_from if resume_from is not None else self.folder
        found = scan(folder)
        for path, reason in found.rejected:
            self._skip(path, reason)
        if resume_from is not None and found.newest is None:
            return ConfigError(f"--resume-from {resume_from}: no complete checkpoint (step-N/ folder with verified "
                               "metadata.json) there")
        return [os.path.abspath(path) for _, path in reversed(found.complete)], False

    def _verify_share(self, path: str) -> list[str]:
        """Every rank hashes its share of path's files; the problems of all ranks (a collective)."""
        try:
            problems = verify_checkpoint(path, self.rank, self.world_size)
            if self.rank == 0 and not problems:
                read_index(path)  # refuses an index that would run code when DCP unpickles it
        except (InvalidCheckpoint, UnsafeIndex) as exc:
            problems = [str(exc)]
        except OSError as exc:
            problems = [f"unreadable ({exc.strerror or exc})"]
        return [p for rank_problems in gather(problems) for p in rank_problems]

    def _skip(self, path: str, reason: str) -> None:
        print(f"hpctrain.runtime: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
        self.event(CHECKPOINT_SKIPPED, path=path, reason=reason)

    def _set_aside_newer(self, step: int, damaged: list[str]) -> None:
        """Resuming from an older step starts a new timeline: move this run's later checkpoints aside
        (step-N.superseded, or step-N.corrupt when damaged), so that pruning keeps the new saves and a
        requeue resumes from them."""
        for newer_step, path in scan(self.folder).complete:
            if newer_step > step:
                bad = os.path.abspath(path) in damaged
                target = f"{path}.corrupt" if bad else f"{path}.superseded"
                shutil.rmtree(target, ignore_errors=True)
                os.replace(path, target)
                why = "it is damaged" if bad else "a later checkpoint"
                print(f"hpctrain.runtime: resuming from step {step}: moved {path} ({why}) to {target}",
                      file=sys.stderr, flush=True)
                self.event(CHECKPOINT_SUPERSEDED, path=target, step=newer_step, resumed_step=step,
                           reason="damaged" if bad else "older step resumed")

    def load(self, path: str) -> dict[str, Any]:
        """Load model, optimizer and this rank's RNG states from `path`; return the metadata body."""
        body = read_metadata(path)
        per_part = self._per_part()
        state = self._merge(per_part)
        saved = set(read_index(path).state_dict_metadata)
        grouped = settings.group(state["optim"])
        if settings.saved_grouped(grouped, saved):  # else a checkpoint with one entry per setting (settings.py)
            state["optim"] = grouped
        tied_copy = any(getattr(part, "has_tied_copy", False) for part in self.parts)
        alias = tied.aliases(state, saved, tied_copy)
        load = tied.rename_for_load(state, alias)
        dcp.load(load, storage_reader=SafeReader(path), planner=SafePlanner())  # nothing unpickled freely
        tied.restore(state, load, alias)
        state["optim"] = settings.ungroup(state["optim"])
        for (m, o), part, opt in zip(per_part, self.parts, self.optimizers):
            frozen = any(not p.requires_grad for p in part.parameters())
            set_state_dict(part, opt, model_state_dict={k: state["model"][k] for k in m},
                           optim_state_dict={k: state["optim"][k] for k in o},
                           options=FROZEN_BASE_LOAD_OPTIONS if frozen else OPTIONS)
        rng_file = os.path.join(path, "rng", f"rank-{self.rank}.pt")
        if os.path.exists(rng_file):
            try:
                rng_state.restore(rng_state.load(rng_file), self.device_index)
            except rng_state.BadRngState as exc:  # never unpickled: it may come from anyone who can write there
                print(f"hpctrain.runtime [rank {self.rank}]: {rng_file}: {exc}; not loaded, continuing with "
                      "fresh RNG", file=sys.stderr)
        else:  # a resume onto more ranks than saved: say so on the rank concerned
            print(f"hpctrain.runtime [rank {self.rank}]: {path} has no RNG state for rank {self.rank} "
                  f"(saved with {body.get('world_size')} ranks); continuing with fresh RNG", file=sys.stderr)
        self.last_saved_step = int(body["step"])
        return body


_PRUNING = ".pruning-"  # a pruned folder while a thread deletes it (scan ignores the name)
