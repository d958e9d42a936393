"""Run directories (ARCHITECTURE.md section 2): create them, write the job files, log events, find them.

    runs/<name-slug>-<YYYYmmdd-HHMMSS>/
        job.yaml  job.resolved.yaml  plan.json  submit/  logs/  events.jsonl  (metrics.jsonl ...)

A sweep is such a directory with `sweep.json` and one run directory per array task in `tasks/<i>/`.
The launcher records each submission as a `submitted` event (executor, job id); `status`, `cancel`,
`logs` and `resume` find the job from there.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError

EVENTS = "events.jsonl"
SWEEP_FILE = "sweep.json"
TASKS_DIR = "tasks"


def slugify(name: str, max_length: int = 48) -> str:
    """A name safe in a path and a shell word: `My job (v2)!` -> `my-job-v2`."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:max_length].strip("-")
    return slug or "job"


def create_run_dir(runs_dir: str | os.PathLike[str], name: str, now: Optional[float] = None) -> Path:
    """A new, empty `runs_dir/<slug>-<timestamp>[-N]/` with `submit/` and `logs/` inside."""
    root = Path(runs_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"runs_dir: cannot create {str(root)!r} ({exc.strerror}); set runs_dir to a "
                          "writable folder") from None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = f"{slugify(name)}-{stamp}"
    for n in range(1, 1000):
        path = root / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        init_run_dir(path)
        return path.resolve()
    raise ConfigError(f"runs_dir: too many runs named {base} in {root}; clean it up")


def init_run_dir(path: Path) -> None:
    for sub in ("submit", "logs"):
        (path / sub).mkdir(parents=True, exist_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write a file atomically (readers never see half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def now_iso() -> str:
    """The time format of events.jsonl (the runtime's too): UTC ISO 8601 with milliseconds."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def append_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one lifecycle record to events.jsonl (one write: safe with concurrent writers)."""
    record = {"time": now_iso(), "event": event, **fields}
    line = (json.dumps(record, default=str) + "\n").encode("utf-8")
    fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events, skipping lines that are not JSON objects (a torn last line)."""
    try:
        lines = (run_dir / EVENTS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def last_submission(run_dir: Path) -> Optional[dict[str, Any]]:
    """The newest `submitted` event (executor, job_id, ...), or None."""
    subs = [e for e in read_events(run_dir) if e.get("event") == "submitted"]
    return subs[-1] if subs else None


def is_sweep(run_dir: Path) -> bool:
    return (run_dir / SWEEP_FILE).is_file()


def task_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's task run directories in task-id order."""
    root = sweep_dir / TASKS_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def find_run(spec: str, runs_dir: str = "runs") -> Path:
    """A run directory from a path, or the newest run in runs_dir named spec or <spec>-<timestamp>."""
    path = Path(spec)
    if path.is_dir() and ((path / EVENTS).exists() or (path / "job.yaml").exists() or is_sweep(path)):
        return path.resolve()
    root = Path(runs_dir)
    candidates = []
    if root.is_dir() and "/" not in spec:
        # A run is <slug>-YYYYMMDD-HHMMSS (plus -N on a clash): a bare prefix must not pick another job's run.
        named = re.compile(re.escape(slugify(spec)) + r"-\d{8}-\d{6}(-\d+)?") if spec else None
        candidates = [p for p in root.iterdir()
                      if p.is_dir() and (p.name == spec or (named is not None and named.fullmatch(p.name)))]
    if not candidates:
        known = sorted(p.name for p in root.iterdir() if p.is_dir())[-5:] if root.is_dir() else []
        hint = f"recent runs in {runs_dir}/: {', '.join(known)}" if known else f"no runs in {runs_dir}/"
        raise ConfigError(f"RUN: no run directory {spec!r}; give a run directory path or a run name ({hint})")
    return max(candidates, key=lambda p: (p.stat().st_mtime, p.name)).resolve()


def newest_run(runs_dir: str = "runs") -> Path:
    """The most recently created run directory (for `hpctrain status` without RUN)."""
    root = Path(runs_dir)
    runs = [p for p in root.iterdir() if p.is_dir() and (p / EVENTS).exists()] if root.is_dir() else []
    if not runs:
        raise ConfigError(f"RUN: no runs in {runs_dir}/; submit one with `hpctrain submit job.yaml` or give RUN")
    return max(runs, key=lambda p: (p.stat().st_mtime, p.name)).resolve()
