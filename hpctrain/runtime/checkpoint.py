"""Atomic distributed checkpoints in `step-N/` folders (torch.distributed.checkpoint).

Protocol (issue 7 item 1): every rank writes its shards with DCP into `step-N.partial/`, and its
RNG states into `step-N.partial/rng/rank-R.pt`; all ranks barrier; rank 0 writes
`metadata.json` (step, tokens seen, layout, data position, LR-scheduler and loss-scaler state, RNG
file locations, versions, and the sha256 of all that) and renames the folder to `step-N/`. A
checkpoint is complete only if its metadata exists and its checksum verifies; anything else
(`*.partial`, a missing or corrupted metadata file) is reported and skipped. `keep_last` prunes
older complete checkpoints only after the new one is complete.

Model and optimizer go through `get_state_dict` / `set_state_dict` with
`flatten_optimizer_state_dict=True` (with PP the nested form loads but fails at the next step with
KeyError 'betas'), one (part, optimizer) pair per model part, merged under full-model names: the
same checkpoint loads into any layout (DCP reshards).

Async (`checkpoint.async: true`): DCP `async_save` in a thread, on its own gloo group so its
collectives never interleave with training's; the metadata + rename happen at the next save or
at the end of training, on every rank at the same point.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import hpctrain
from hpctrain.errors import ConfigError
from hpctrain.runtime.distributed import barrier

FORMAT = 1
METADATA_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"  # written last by DCP's FileSystemWriter
STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_DIR = re.compile(r"^step-(\d+)\.partial$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A single process saves without a process group on purpose; DCP warns about that on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class InvalidCheckpoint(Exception):
    """A folder that is not a complete checkpoint; the message says why."""


def checksum(body: dict[str, Any]) -> str:
    """sha256 of the metadata body in canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_metadata(folder: str, body: dict[str, Any]) -> None:
    path = os.path.join(folder, METADATA_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump({**body, "sha256": checksum(body)}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def read_metadata(folder: str) -> dict[str, Any]:
    """The verified metadata body of a checkpoint folder; InvalidCheckpoint if it is not complete."""
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.exists(path):
        raise InvalidCheckpoint(f"no {METADATA_FILE} (the save did not finish)")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise InvalidCheckpoint(f"{METADATA_FILE} is unreadable ({exc})") from None
    if not isinstance(data, dict) or "sha256" not in data:
        raise InvalidCheckpoint(f"{METADATA_FILE} has no checksum")
    body = {k: v for k, v in data.items() if k != "sha256"}
    if checksum(body) != data["sha256"]:
        raise InvalidCheckpoint(f"{METADATA_FILE} checksum mismatch (corrupted or edited)")
    if not os.path.exists(os.path.join(folder, DCP_METADATA_FILE)):
        raise InvalidCheckpoint(f"the DCP index {DCP_METADATA_FILE} is missing")
    for name in body.get("rng_files", []):
        rng_path = os.path.join(folder, name)
        if not os.path.isfile(rng_path) or os.path.getsize(rng_path) == 0:
            raise InvalidCheckpoint(f"the RNG state {name} is missing or empty")
    return body


@dataclass
class Scan:
    """What a checkpoint folder holds: complete checkpoints (oldest first) and rejected folders."""

    complete: list[tuple[int, str]] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)

    @property
    def newest(self) -> tuple[int, str] | None:
        return self.complete[-1] if self.complete else None


def scan(folder: str) -> Scan:
    out = Scan()
    if not os.path.isdir(folder):
        return out
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if PARTIAL_DIR.match(name):
            out.rejected.append((path, "partial: the save was interrupted before its rename"))
            continue
        match = STEP_DIR.match(name)
        if not match or not os.path.isdir(path):
            continue
        try:
            body = read_metadata(path)
        except InvalidCheckpoint as exc:
            out.rejected.append((path, str(exc)))
            continue
        if body.get("step") != int(match.group(1)):
            out.rejected.append((path, f"metadata step {body.get('step')} does not match the folder name"))
            continue
        out.complete.append((int(match.group(1)), path))
    out.complete.sort()
    out.rejected.sort()
    return out


def rng_state(device_index: int | None = None) -> dict[str, Any]:
    """This rank's RNG states; on a GPU only its own device's (a resumed rank may see other GPUs)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if device_index is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device_index)
    return state


def set_rng_state(state: dict[str, Any], device_index: int | None = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device_index is not None and torch.cuda.is_available():
        cuda_state = state["cuda"]
        if isinstance(cuda_state, list):  # written by an older hpctrain: one state per visible GPU
            cuda_state = cuda_state[min(device_index, len(cuda_state) - 1)]
        torch.cuda.set_rng_state(cuda_state, device_index)


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


class Checkpointer:
    """Save and load this rank's model parts and optimizers; the protocol is in the module docstring."""

    def __init__(self, job: Any, run_dir: str, model_parts: list[Any], optimizers: Any,
                 event: Callable[..., None] | None = None) -> None:
        cfg = job.checkpoint
        self.folder = os.path.abspath(cfg.dir or os.path.join(run_dir, "checkpoints"))
        self.every_steps, self.keep_last, self.async_mode = cfg.every_steps, cfg.keep_last, bool(cfg.async_)
        self.parts, self.optimizers = model_parts, list(optimizers)
        self.rank, self.world_size = _rank()
        self.event = event or (lambda name, **fields: None)
        self.pending: _Pending | None = None
        self.last_saved_step: int | None = None
        self.last_save_s: float | None = None  # how long the last save took to complete
        # This rank's GPU (init_distributed set it), whose RNG stream is saved with the checkpoint.
        self.device_index = (torch.cuda.current_device()
                             if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._async_group = None
        if self.async_mode and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")  # keep DCP off the training group

    # -- state dicts ------------------------------------------------------------------------------
    def _per_part(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [get_state_dict(part, opt, options=OPTIONS) for part, opt in zip(self.parts, self.optimizers)]

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
        barrier()  # every rank has looked before rank 0 clears anything
        partial = final + ".partial"
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            shutil.rmtree(final, ignore_errors=True)  # a folder without valid metadata
            os.makedirs(os.path.join(partial, "rng"))
        barrier()
        with open(os.path.join(partial, "rng", f"rank-{self.rank}.pt"), "wb") as handle:
            torch.save(rng_state(self.device_index), handle)
            handle.flush()
            os.fsync(handle.fileno())  # the metadata that lists it is written (and trusted) after this
        full_body = {**body, "format": FORMAT, "step": step, "world_size": self.world_size,
                     "rng_files": [f"rng/rank-{r}.pt" for r in range(self.world_size)],
                     "versions": {"hpctrain": hpctrain.__version__, "torch": torch.__version__,
                                  "python": sys.version.split()[0]}}
        state = self._merge(self._per_part())
        if self.async_mode:
            future = dcp.async_save(state, checkpoint_id=partial, process_group=self._async_group)
            self.pending = _Pending(step, partial, final, full_body, future, started,
                                    time.perf_counter() - started)
        else:
            dcp.save(state, checkpoint_id=partial)
            self._finalize(_Pending(step, partial, final, full_body, None, started))
        self.last_saved_step = step
        return True

    def wait(self) -> None:
        """Finish an async save (every rank calls this at the same point)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            waited = time.perf_counter()
            pending.future.result()
            pending.blocking_s += time.perf_counter() - waited
            self._finalize(pending)

    def _finalize(self, pending: _Pending) -> None:
        barrier()  # every rank's shards and RNG file are on disk
        if self.rank == 0:
            _fsync_dir(os.path.join(pending.partial, "rng"))
            write_metadata(pending.partial, pending.body)
            _fsync_dir(pending.partial)
            os.replace(pending.partial, pending.final)
            _fsync_dir(self.folder)
            total_s = round(time.perf_counter() - pending.started, 4)
            # sync: training stood still for the whole save; async: only for staging and the final wait.
            # duration_s is that blocking time (what `hpctrain doctor` weighs against interruptions).
            blocking_s = round(pending.blocking_s, 4) if self.async_mode else total_s
            timing = ({"blocking_s": blocking_s, "finalized_after_s": total_s} if self.async_mode
                      else {"blocking_s": blocking_s})
            self.event("checkpoint saved", step=pending.step, path=pending.final, duration_s=blocking_s, **timing)
            self._prune(pending.step)
        barrier()
        # Start to complete (async: overlapped steps included, an upper bound): the time-limit safety
        # keeps twice this in hand (requeue.py).
        self.last_save_s = time.perf_counter() - pending.started

    def _prune(self, newest_step: int) -> None:
        found = scan(self.folder)
        for step, path in found.complete[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for path, _ in found.rejected:
            match = PARTIAL_DIR.match(os.path.basename(path))
            if match and int(match.group(1)) < newest_step:
                shutil.rmtree(path, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------
    def find(self, resume_from: str | None) -> str | None:
        """The checkpoint to start from (rank 0 decides, every rank gets the same answer)."""
        choice: list[Any] = [None]
        if self.rank == 0:
            choice[0] = self._choose(resume_from)
            if resume_from is not None and isinstance(choice[0], str):
                self._set_aside_newer(int(read_metadata(choice[0])["step"]))
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], ConfigError):
            raise choice[0]
        return choice[0]

    def _choose(self, resume_from: str | None) -> str | ConfigError | None:
        if resume_from is not None:
            if STEP_DIR.match(os.path.basename(os.path.normpath(resume_from))):
                try:
                    read_metadata(resume_from)
                except InvalidCheckpoint as exc:
                    return ConfigError(f"--resume-from {resume_from}: not a complete checkpoint: {exc}")
                return os.path.abspath(resume_from)
            found = self._report(scan(resume_from))
            if found.newest is None:
                return ConfigError(f"--resume-from {resume_from}: no complete checkpoint (step-N/ folder "
                                   "with verified metadata.json) there")
            return found.newest[1]
        found = self._report(scan(self.folder))
        return found.newest[1] if found.newest else None

    def _set_aside_newer(self, step: int) -> None:
        """Resuming from an older step starts a new timeline: move this run's later checkpoints aside
        (step-N.superseded), so that pruning keeps the new saves and a requeue resumes from them."""
        for newer_step, path in scan(self.folder).complete:
            if newer_step > step:
                target = f"{path}.superseded"
                shutil.rmtree(target, ignore_errors=True)
                os.replace(path, target)
                print(f"hpctrain.runtime: resuming from step {step}: moved the later checkpoint {path} to "
                      f"{target}", file=sys.stderr, flush=True)
                self.event("checkpoint superseded", path=target, step=newer_step, resumed_step=step)

    def _report(self, found: Scan) -> Scan:
        for path, reason in found.rejected:
            print(f"hpctrain.runtime: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
            self.event("checkpoint skipped", path=path, reason=reason)
        return found

    def load(self, path: str) -> dict[str, Any]:
        """Load model, optimizer and this rank's RNG states from `path`; return the metadata body."""
        body = read_metadata(path)
        per_part = self._per_part()
        state = self._merge(per_part)
        dcp.load(state, checkpoint_id=path)
        for (m, o), part, opt in zip(per_part, self.parts, self.optimizers):
            set_state_dict(part, opt, model_state_dict={k: state["model"][k] for k in m},
                           optim_state_dict={k: state["optim"][k] for k in o}, options=OPTIONS)
        rng_file = os.path.join(path, "rng", f"rank-{self.rank}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False), self.device_index)
        else:  # a resume onto more ranks than saved: say so on the rank concerned
            print(f"hpctrain.runtime [rank {self.rank}]: {path} has no RNG state for rank {self.rank} "
                  f"(saved with {body.get('world_size')} ranks); continuing with fresh RNG", file=sys.stderr)
        self.last_saved_step = int(body["step"])
        return body


def _is_complete(folder: str) -> bool:
    try:
        read_metadata(folder)
    except InvalidCheckpoint:
        return False
    return True


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
