"""Checkpoint discovery, completeness, checksums and ownership: torch-free, shared by runtime and launch.

A checkpoint is a `step-N/` folder of a checkpoint directory (default `<run dir>/checkpoints`):
DCP's shards (`__R_I.distcp`) and index (`.metadata`), one RNG file per rank (`rng/rank-R.pt`) and,
written last by rank 0, `metadata.json`: the train state, the run that wrote it (`run`), and a
manifest (`files`) with the size and sha256 of every other file of the folder; its own sha256 covers
all of that. `step-N.partial/` is a save in progress (or one that was killed).

Two levels of checking, because reading every byte is not free:
- `read_metadata` / `scan` (cheap: metadata checksum, every listed file present with its size) is what
  the login path uses (`hpctrain resume`), and what pruning and discovery use;
- `verify_checkpoint` (reads and hashes the files) is what the ranks run, each on a share of the files,
  before loading: a checkpoint whose data is damaged is skipped and the next older one is used; and
  what `hpctrain export` runs on the whole folder before it reads a tensor.

Ownership (issue 18 finding 2): a run has an identity, a random id written once into its run
directory (`run_id`, so requeues and `hpctrain resume`, onto any layout, keep it); every checkpoint
records it and the checkpoint directory holds a claim (`owner.json`). A directory that holds another
run's checkpoints is refused unless the job says `checkpoint.adopt: true`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from hpctrain.rundir.layout import CHECKPOINTS_DIR, RUN_ID_FILE  # noqa: F401 - CHECKPOINTS_DIR: for the runtime
from hpctrain.rundir.safe_files import create_exclusive, write_atomic

FORMAT = 2  # 1: no file manifest, no run id, pickled RNG files
METADATA_FILE = "metadata.json"
DCP_METADATA_FILE = ".metadata"  # written last by DCP's FileSystemWriter
OWNER_FILE = "owner.json"  # in the checkpoint directory: the run that writes there
STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_DIR = re.compile(r"^step-(\d+)\.partial$")
_CHUNK_BYTES = 8 << 20


class InvalidCheckpoint(Exception):
    """A folder that is not a complete, intact checkpoint; the message says why."""


# -- metadata.json ----------------------------------------------------------------------------
def checksum(body: dict[str, Any]) -> str:
    """sha256 of the metadata body in canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_metadata(folder: str, body: dict[str, Any]) -> None:
    text = json.dumps({**body, "sha256": checksum(body)}, indent=1, sort_keys=True)
    write_atomic(os.path.join(folder, METADATA_FILE), text, fsync=True)  # the .tmp name: data_files skips it


def read_metadata(folder: str) -> dict[str, Any]:
    """The verified metadata body of a checkpoint folder (cheap checks: no file is read but the
    metadata); InvalidCheckpoint if it is not complete."""
    path = os.path.join(folder, METADATA_FILE)
    if not os.path.exists(path):
        raise InvalidCheckpoint(f"no {METADATA_FILE} (the save did not finish)")
    if not os.path.isfile(path):  # a FIFO or a folder: opening it could block, reading it is meaningless
        raise InvalidCheckpoint(f"{METADATA_FILE} is not a regular file")
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
    files = body.get("files")
    if isinstance(files, dict):
        for name, entry in sorted(files.items()):
            problem = _size_problem(folder, name, entry)
            if problem:
                raise InvalidCheckpoint(problem)
    return body


def _size_problem(folder: str, name: str, entry: Any) -> Optional[str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or ".." in name.split("/"):
        return f"{METADATA_FILE} lists {name!r} with a malformed entry"
    try:
        size = os.path.getsize(os.path.join(folder, name))
    except OSError:
        return f"the file {name} is missing"
    if size != entry["bytes"]:
        return f"the file {name} has {size} bytes, {entry['bytes']} were written"
    return None


# -- file checksums ---------------------------------------------------------------------------
def file_sha256(path: str) -> str:
    if not os.path.isfile(path):  # never open a FIFO planted in a checkpoint folder (it would block)
        raise OSError(errno.EINVAL, "not a regular file", path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def data_files(folder: str) -> list[str]:
    """Every file of a checkpoint folder but metadata.json, as sorted relative '/' paths."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel not in (METADATA_FILE, METADATA_FILE + ".tmp"):
                out.append(rel)
    return sorted(out)


def share(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The files rank hashes: DCP's `__R_I.distcp` files go to their writer R (still in its page
    cache right after a save), everything else round-robin."""
    mine = []
    for i, name in enumerate(sorted(names)):
        match = re.match(r"^__(\d+)_\d+\.distcp$", name)
        owner = int(match.group(1)) if match else i
        if owner % world_size == rank:
            mine.append(name)
    return mine


def hash_files(folder: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "sha256"}} for files of folder (the manifest entries of this rank's share)."""
    return {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                   "sha256": file_sha256(os.path.join(folder, name))} for name in names}


def verify_files(folder: str, files: dict[str, Any], names: Iterable[str]) -> list[str]:
    """Reasons why the listed files among `names` do not match the manifest (empty: intact)."""
    problems = []
    for name in names:
        entry = files.get(name)
        problem = _size_problem(folder, name, entry)
        if problem is None and isinstance(entry, dict):  # _size_problem has checked the entry's shape
            try:
                if file_sha256(os.path.join(folder, name)) != entry["sha256"]:
                    problem = f"the file {name} checksum mismatch (corrupted after it was written)"
            except OSError as exc:
                problem = f"the file {name} is unreadable ({exc.strerror})"
        if problem:
            problems.append(problem)
    return problems


def verify_checkpoint(folder: str, rank: int = 0, world_size: int = 1) -> list[str]:
    """Why folder is not an intact checkpoint (empty: intact): the cheap checks of read_metadata, then the
    sha256 of this rank's share of its files against the manifest (all of them with one rank). What the
    ranks run before loading (runtime/checkpoint/checkpointer.py) and what `hpctrain export` runs."""
    try:
        files = read_metadata(folder).get("files")
    except InvalidCheckpoint as exc:
        return [str(exc)]
    if not isinstance(files, dict):  # format 1: no manifest, the cheap checks are all
        return []
    return verify_files(folder, files, share(files, rank, world_size))


# -- discovery --------------------------------------------------------------------------------
@dataclass
class Scan:
    """What a checkpoint folder holds: complete checkpoints (oldest first) and rejected folders."""

    complete: list[tuple[int, str]] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)

    @property
    def newest(self) -> tuple[int, str] | None:
        return self.complete[-1] if self.complete else None


def scan(folder: str) -> Scan:
    """Complete checkpoints by the cheap checks of read_metadata; the contents are checked by the ranks."""
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


# -- the run's identity and the directory's owner -----------------------------------------------
def run_identity(run_dir: str) -> str:
    """This run's id, created on first use (O_EXCL: two ranks or processes agree on one id)."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isfile(path):  # a link: its target is not shown, nor read
            raise InvalidCheckpoint(f"{path} is not a regular file") from None
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read(200).strip()
        if re.fullmatch(r"[0-9a-f]{32}", text):
            return text
        raise InvalidCheckpoint(f"{path} is not a run id (32 hex digits): {text[:40]!r}") from None
    new_id = uuid.uuid4().hex
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(new_id + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return new_id


def run_record(run_id: str, run_dir: str) -> dict[str, str]:
    """What a checkpoint and an owner claim record of the run that wrote them."""
    return {"id": run_id, "dir": os.path.abspath(run_dir)}


def _owner_claim(folder: str) -> Optional[dict[str, Any]]:
    path = os.path.join(folder, OWNER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None  # none, or unreadable: the checkpoints' own records decide
    return data if isinstance(data, dict) and isinstance(data.get("id"), str) else None


def foreign_owner(folder: str, run_id: str, run_dir: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The record of another run that owns folder (its claim, or a checkpoint it wrote), if any.
    A record of this run's id, or of this very run directory (whose run_id file was lost), is this
    run's; checkpoints of format 1 (before run ids) belong to nobody in particular."""
    here = os.path.abspath(run_dir) if run_dir else None

    def foreign(record: Any) -> bool:
        return (isinstance(record, dict) and record.get("id") not in (None, run_id)
                and (here is None or record.get("dir") != here))

    claim = _owner_claim(folder)
    if foreign(claim):
        return claim
    for _, path in reversed(scan(folder).complete):
        record = read_metadata(path).get("run")
        if foreign(record):
            return record
    return None


def ownership_error(folder: str, other: dict[str, Any]) -> str:
    return (f"checkpoint.dir {folder}: holds the checkpoints of another run ({other.get('dir', '?')}, id "
            f"{other.get('id')}); a run resumes only its own. Use another checkpoint.dir, or set "
            f"checkpoint.adopt: true to continue from that run's checkpoints on purpose")


def claim(folder: str, run_id: str, run_dir: str) -> None:
    """Create folder if needed and record this run as its owner; OSError when it cannot be written
    (a read-only or full file system: the caller turns that into a one-line error at start)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, OWNER_FILE)
    write_atomic(path, json.dumps(run_record(run_id, run_dir)), tmp=f"{path}.{os.getpid()}.tmp", fsync=True)


def writable_problem(folder: str) -> Optional[str]:
    """Why folder (or, if it does not exist, its nearest existing parent) cannot be written, or None.
    os.access is not enough: root passes it on a read-only mount; a real probe file is created."""
    probe_dir = os.path.abspath(folder)
    while not os.path.isdir(probe_dir):
        if os.path.exists(probe_dir):
            return f"{probe_dir} exists and is not a directory"
        parent = os.path.dirname(probe_dir)
        if parent == probe_dir:
            break
        probe_dir = parent
    probe = os.path.join(probe_dir, f".hpctrain-write-probe-{os.getpid()}")
    try:
        os.close(create_exclusive(probe))
        os.remove(probe)
    except OSError as exc:
        return f"{probe_dir} is not writable ({exc.strerror or errno.errorcode.get(exc.errno or 0, exc)})"
    return None
