"""metrics.jsonl (docs/architecture.md: the metrics record): one JSON object per logged step, written by rank 0.

Append-only, and cut back to the resumed step when a run (re)starts, so that after any number of
restarts every step appears once. The record's fields are described in runtime/observe/telemetry.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Optional

from hpctrain.rundir.events import append_line, read_jsonl
from hpctrain.rundir.layout import METRICS_FILE
from hpctrain.rundir.safe_files import read_bytes, write_atomic

__all__ = ["append_line", "truncate_metrics", "last_metrics", "last_value", "read_metrics", "records_backwards",
           "METRICS_FILE"]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every metrics line with an integer step, in file order."""
    return [m for m in read_jsonl(Path(run_dir) / METRICS_FILE)
            if isinstance(m.get("step"), int) and not isinstance(m.get("step"), bool)]


def truncate_metrics(path: str | os.PathLike[str], step: int) -> int:
    """Keep only the lines of steps <= `step` (dropping torn or damaged lines); return lines kept. Neither
    the file nor its temporary is followed when it is a symbolic link (rundir/safe_files.py)."""
    try:
        data = read_bytes(path)
    except FileNotFoundError:
        return 0
    kept = []
    for raw in data.splitlines():
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is a ValueError too: a damaged line is not worth keeping
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(json.dumps(record, separators=(",", ":")) + "\n")
    write_atomic(path, "".join(kept))
    return len(kept)


def last_metrics(run_dir: Path, tail_bytes: int = 65536) -> Optional[dict[str, Any]]:
    """The last complete line of metrics.jsonl, reading only the file's tail (a damaged byte is skipped:
    the tail may start inside a character)."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return None


def records_backwards(run_dir: Path, needle: str, max_bytes: int = 8 << 20) -> Iterator[dict[str, Any]]:
    """The metrics lines holding `needle`, newest first, with an integer step, reading the file backwards in
    blocks, at most `max_bytes` of it (a torn or damaged line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    block = 65536
    try:
        handle = open(path, "rb")
    except OSError:
        return
    with handle:
        end = handle.seek(0, 2)
        carry = b""
        pos = end
        while pos > 0 and end - pos < max_bytes:
            start = max(0, pos - block)
            handle.seek(start)
            chunk = handle.read(pos - start) + carry
            pos = start
            lines = chunk.split(b"\n")
            carry = lines[0] if pos > 0 else b""  # maybe cut: completed by the next block
            for raw in reversed(lines[1:] if pos > 0 else lines):
                if needle.encode() not in raw:
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int) \
                        and not isinstance(record.get("step"), bool):
                    yield record


def last_value(run_dir: Path, key: str, max_bytes: int = 8 << 20) -> Optional[tuple[int, float]]:
    """(step, value) of the newest metrics line holding a number under `key` (e.g. val_loss, logged only
    on evaluation steps), reading the file backwards in blocks, at most `max_bytes` of it."""
    for record in records_backwards(run_dir, key, max_bytes):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return record["step"], float(value)
    return None
