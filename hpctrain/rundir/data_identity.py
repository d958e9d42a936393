"""Which token files a run trained on, checked at every start: the first, a requeue and a resume.

A run reads one corpus. `hpctrain data prepare` into the same path (or any rewrite of the file) between
two starts would continue the run on other data under the same name, with nothing to show for it.
So the first start records each token file's fingerprint in the run directory (`data.json`, rank 0 of
the runtime) and every later start compares (the runtime on every executor; `resume` on the login node
before it submits anything). The rule:

- a file with a sidecar (`<file>.json`, written by `data prepare`): its size and the sha256 of the
  sidecar (tokens, documents, sources and tokenizer; re-preparing the same corpus gives the same one);
- a file without one: its size and modification time (nothing cheaper says it was rewritten).

Naming another file (`resume --set train.data=OTHER`) is a choice, not a change: the new file is recorded.
No token file is read, only sizes, times and sidecars: this runs on a login node in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.config.data_files import SYNTHETIC, eval_file, sidecar_path
from hpctrain.errors import ConfigError
from hpctrain.rundir.layout import DATA_IDENTITY_FILE
from hpctrain.rundir.read import read_json_object
from hpctrain.rundir.safe_files import write_atomic

if TYPE_CHECKING:
    from hpctrain.config import Job


def fingerprint(path: str) -> Optional[dict[str, Any]]:
    """{path, bytes, sidecar_sha256, mtime_ns} of a token file; None when it is not there (check_data says so)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    side: Optional[str] = None
    try:
        with open(sidecar_path(path), "rb") as handle:
            side = hashlib.sha256(handle.read(1 << 20)).hexdigest()
    except OSError:
        pass
    return {"path": os.path.abspath(path), "bytes": stat.st_size, "sidecar_sha256": side, "mtime_ns": stat.st_mtime_ns}


def job_files(job: Job) -> dict[str, dict[str, Any]]:
    """field -> fingerprint for train.data and the validation file, when they are files."""
    train = job.train
    out: dict[str, dict[str, Any]] = {}
    if train.data != SYNTHETIC:
        found = fingerprint(train.data)
        if found:
            out["train.data"] = found
    evaluation = eval_file(train) if (train.eval_every or train.eval_data) else None
    if evaluation:
        found = fingerprint(evaluation)
        if found:
            out["train.eval_data"] = found
    return out


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> Optional[str]:
    if old.get("bytes") != new["bytes"]:
        return f"{old.get('bytes')} bytes then, {new['bytes']} now"
    if old.get("sidecar_sha256") or new["sidecar_sha256"]:
        if old.get("sidecar_sha256") != new["sidecar_sha256"]:
            return f"its sidecar {os.path.basename(sidecar_path(new['path']))} differs (another corpus was prepared there)"
        return None
    if old.get("mtime_ns") != new["mtime_ns"]:
        return "it was rewritten (modification time differs; it has no sidecar to compare)"
    return None


def changes(recorded: dict[str, Any], now: dict[str, dict[str, Any]]) -> list[str]:
    """One line per token file that the run recorded (`recorded`: path -> fingerprint, data.json) and that is
    now different at the same path."""
    problems = []
    for name, new in now.items():
        old = recorded.get(new["path"])
        if not isinstance(old, dict):
            continue  # the first start on this file (the user may name another one: a choice, not a change)
        what = _what_changed(old, new)
        if what:
            problems.append(f"{name}: {new['path']} changed since this run trained on it ({what}); put the original "
                            "back, start a new run on the new data (`hpctrain submit`), or prepare it under another "
                            f"name and resume with --set {name}=NEW")
    return problems


def check_unchanged(job: Job, run_dir: str | Path) -> None:
    """ConfigError (exit 2) when a token file the run recorded has changed at its path."""
    recorded = read_json_object(Path(run_dir) / DATA_IDENTITY_FILE) or {}
    problems = changes(recorded, job_files(job))
    if problems:
        raise ConfigError(problems)


def check_and_record(job: Job, run_dir: str | Path, write: bool) -> None:
    """check_unchanged, then (when `write`: rank 0) record the files this start trains on."""
    path = Path(run_dir) / DATA_IDENTITY_FILE
    recorded = read_json_object(path) or {}
    now = job_files(job)
    problems = changes(recorded, now)
    if problems:
        raise ConfigError(problems)
    merged = {**recorded, **{found["path"]: {**found, "field": name} for name, found in now.items()}}
    if write and merged != recorded:  # no symbolic link followed at either name (rundir/safe_files.py)
        write_atomic(path, json.dumps(merged, indent=1) + "\n")
