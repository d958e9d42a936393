"""Slurm slot <-> global rank, and the per-rank files named by the global rank.

The launcher numbers processes by slot: SLURM_PROCID (block distribution: node * gpus_per_node +
local GPU) or the local executor's process index. The planner's placement.rank_order maps slot ->
global rank (plan/placement.py: TP peers on one NVLink island, then stages, then replicas). Every
per-rank file is named by the GLOBAL rank: events, ranks/rank-R.json, checkpoints, and the logs,
logs/rank-R.attempt-A.log. A launcher cannot name a log by a rank it does not know (srun's
--output only knows %t, the slot), so the launcher captures each process in logs/task-S.attempt-A.log
and the runtime, once it knows its rank, sends its stdout and stderr to the rank's own log
(runtime/__main__.py, `HPCTRAIN_LOG_DIR`). The task file keeps only what came before: an
interpreter that did not start, a job file that does not load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.layout import LOGS_DIR, RANKS_DIR, RESOLVED_FILE
from hpctrain.rundir.read import damaged, field, int_list, read_json_object, read_yaml_mapping

# The launcher tells the runtime where its rank log goes and which attempt it is (the local executor
# counts its own attempts; under Slurm it is SLURM_RESTART_COUNT).
LOG_DIR_ENV = "HPCTRAIN_LOG_DIR"
ATTEMPT_ENV = "HPCTRAIN_ATTEMPT"
RANK_LOG = re.compile(r"^rank-(\d+)\.attempt-(\d+)\.log$")
TASK_LOG = re.compile(r"^task-(\d+)\.attempt-(\d+)\.log$")
SRUN_TASK_LOG = "task-%t.attempt-{attempt}.log"  # srun expands %t to the slot


def global_rank(slot: int, rank_order: Optional[list[int]]) -> int:
    """The global rank of the process in `slot` (identity without a rank order)."""
    return rank_order[slot] if rank_order else slot


def slot_of(rank: int, rank_order: Optional[list[int]]) -> int:
    """The slot that runs global rank `rank`."""
    return rank_order.index(rank) if rank_order else rank


def check_rank_order(rank_order: Optional[list[int]], world_size: int, gpus_per_node: int) -> None:
    """A rank order every launcher can follow: a permutation of the ranks, rank 0 on the first node."""
    if not rank_order or world_size == 1:
        return
    if sorted(rank_order) != list(range(world_size)):
        raise ConfigError(f"placement.rank_order: not a permutation of the {world_size} ranks "
                          f"(got {len(rank_order)} entries); re-render the job")
    if rank_order.index(0) // gpus_per_node != 0:
        raise ConfigError("placement.rank_order: rank 0 must run on the first node (MASTER_ADDR); re-render the job")


def rank_log_name(rank: int, attempt: int) -> str:
    return f"rank-{rank}.attempt-{attempt}.log"


def redirect_to_rank_log(folder: str, rank: int, attempt: int, prog: str) -> bool:
    """Send this process's stdout and stderr (Python's and C's: NCCL, faulthandler, a child program's) to
    folder/rank-R.attempt-A.log, opened for appending without following a planted link. False, with one line
    on the launcher's capture, when it cannot be opened: the output then stays where the launcher put it."""
    import os
    import sys

    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, rank_log_name(rank, attempt)),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        print(f"{prog} [rank {rank}]: cannot open its log in {folder} ({exc.strerror}); output stays in the "
              "launcher's task log", file=sys.stderr, flush=True)
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return True


def task_log_name(slot: int, attempt: int) -> str:
    return f"task-{slot}.attempt-{attempt}.log"


def rank_log_path(run_dir: Path, rank: int, attempt: int) -> Path:
    return Path(run_dir) / LOGS_DIR / rank_log_name(rank, attempt)


def next_attempt(logs_dir: Path) -> int:
    """One more than the newest attempt logged in logs/ (0 for a fresh run)."""
    attempts = [int(m.group(2)) for p in Path(logs_dir).glob("*.log")
                if (m := RANK_LOG.match(p.name) or TASK_LOG.match(p.name))]
    return max(attempts) + 1 if attempts else 0


def rank_order_of(run_dir: Path) -> Optional[list[int]]:
    """placement.rank_order of the run's resolved job (None: identity, or no resolved job yet)."""
    data = read_yaml_mapping(Path(run_dir) / RESOLVED_FILE) or {}
    placement = data.get("placement")
    if not isinstance(placement, dict):
        return None
    return int_list(placement, "rank_order", Path(run_dir) / RESOLVED_FILE) or None


def summary_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank-{rank}.json"


# Fields of ranks/rank-R.json that readers compute with, and their types.
_SUMMARY_FIELDS: dict[str, tuple[type, ...]] = {
    "rank": (int,), "world_size": (int,), "attempt": (int,), "host": (str,), "pid": (int,), "status": (str,),
    "steps_timed": (int,), "step_time_s": (int, float), "time_compute_s": (int, float),
    "time_comm_exposed_s": (int, float), "time_bubble_s": (int, float), "peak_memory_bytes": (int, float),
}


def read_rank_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """Every ranks/rank-R.json, by rank; a wrongly typed field is a RunDirError naming the file."""
    folder = Path(run_dir) / RANKS_DIR
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("rank-*.json")):
        data = read_json_object(path)
        if data is None:
            continue
        for key, kinds in _SUMMARY_FIELDS.items():
            field(data, key, kinds, path)
        for key, value in data.items():  # <kind>_bytes: the memory by kind
            if key.endswith("_bytes") and value is not None:
                field(data, key, (int, float), path)
        if "rank" not in data:
            raise damaged(path, "has no 'rank' field")
        out.append(data)
    return sorted(out, key=lambda r: int(r["rank"]))
