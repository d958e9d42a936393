"""Search rank logs for the messages that name a failure: OOM, watchdog timeouts, desync, kills.

The patterns are the literal messages of PyTorch, NCCL, gloo, the Linux OOM killer and slurmstepd,
each with an example in tests/diagnose/test_logscan.py. A log is read line by line and only its
last `MAX_LOG_BYTES` are searched, so a multi-gigabyte log does not stall the login node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from hpctrain.diagnose.rundata import LogFile

MAX_LOG_BYTES = 8 * 2**20

PATTERNS: dict[str, re.Pattern[str]] = {
    # torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total
    # capacity of 79.15 GiB of which 1.06 GiB is free. ... / CUDA error: out of memory / cuBLAS.
    "cuda_oom": re.compile(r"CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
                           r"OutOfMemoryError", re.IGNORECASE),
    # slurmstepd: error: Detected 1 oom_kill event in StepId=12.0. Some of the step tasks have been
    # OOM Killed. / DefaultCPUAllocator: can't allocate memory / MemoryError / the runtime's own marker.
    "cpu_oom": re.compile(r"oom[-_ ]kill|OOM Killed|Out of memory: Killed process|task \d+: Out Of Memory|"
                          r"DefaultCPUAllocator: "
                          r"can't allocate memory|^MemoryError|\bMemoryError:|hpctrain: host memory (cap|limit)",
                          re.IGNORECASE),
    # [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, ...)
    # ran for 600010 milliseconds before timing out. / gloo: Timed out waiting 1800000ms for recv.
    "timeout": re.compile(r"Watchdog caught collective operation timeout|collective operation timeout|"
                          r"Timed out waiting \d+ ?ms|ProcessGroupNCCL's watchdog got stuck|"
                          r"NCCL (communicator|operation).*(timed out|timeout)|DistStoreError: .*[Tt]imed? ?out|"
                          r"Socket Timeout|wait timeout after", re.IGNORECASE),
    # TORCH_DISTRIBUTED_DEBUG=DETAIL / desync debug: "Detected mismatch between collectives on
    # ranks", "Desync debugging report", "is waiting for ... collective".
    "desync": re.compile(r"Detected mismatch between collectives|Desync debug|desync|"
                         r"collective .* mismatch|Rank \d+ is waiting for|have not joined|"
                         r"number of (tensors|elements) mismatch", re.IGNORECASE),
    # Flight-recorder dumps: TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>.
    "flight_recorder": re.compile(r"(\S*nccl_trace_rank_\d+\S*)|[Ff]light ?[Rr]ecorder.*?(/\S+)"),
    "nccl_error": re.compile(r"NCCL error|ncclSystemError|ncclInternalError|ncclRemoteError|"
                             r"Connection (reset|closed) by peer|Broken pipe", re.IGNORECASE),
}


@dataclass(frozen=True)
class LogMatch:
    kind: str
    rank: int
    attempt: int
    line_number: int
    text: str
    path: Path

    def where(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}:{self.line_number}"


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            offset = max(0, size - MAX_LOG_BYTES)
            first_line = 1
            if offset:
                handle.seek(offset)
                handle.readline()  # skip the partial line
                first_line = 0  # line numbers are unknown past a skipped head: report 0-based offsets
            for number, raw in enumerate(handle, start=first_line):
                yield number, raw.decode("utf-8", errors="replace").rstrip("\n")
    except OSError:
        return


def scan_logs(logs: list[LogFile], kinds: Iterable[str]) -> list[LogMatch]:
    """Every line matching one of `kinds` (keys of PATTERNS), in log order."""
    wanted = [(k, PATTERNS[k]) for k in kinds]
    out = []
    for log in logs:
        for number, line in _lines(log.path):
            for kind, pattern in wanted:
                if pattern.search(line):
                    out.append(LogMatch(kind, log.rank, log.attempt, number, line.strip()[:300], log.path))
    return out


def flight_recorder_dumps(run_dir: Path, matches: list[LogMatch]) -> list[str]:
    """Paths of flight-recorder dumps: files in the run dir, and paths the logs name."""
    found: list[str] = []
    for pattern in ("**/nccl_trace_rank_*", "**/flight_recorder*", "**/*fr_trace*"):
        found += [str(p) for p in sorted(run_dir.glob(pattern)) if p.is_file()]
    for match in matches:
        if match.kind != "flight_recorder":
            continue
        m = PATTERNS["flight_recorder"].search(match.text)
        path = m and (m.group(1) or m.group(2))
        if path and path not in found:
            found.append(path.rstrip(".,;:"))
    return found


def first_per_rank(matches: list[LogMatch], kind: str) -> list[LogMatch]:
    """The first match of `kind` of each (attempt, rank)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for match in matches:
        if match.kind == kind and (match.attempt, match.rank) not in seen:
            seen.add((match.attempt, match.rank))
            out.append(match)
    return out
