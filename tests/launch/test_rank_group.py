"""The rank group (hpctrain/launch/rank_group.py), table-driven: each rank's environment, then real child
processes that exit 0/1/2 or ignore SIGTERM: first-failure stop, TERM -> KILL after the grace, parent death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from hpctrain.launch.rank_group import RankGroup, RankPlace, block_place, rank_env
from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV

# (slot, world size, per node) -> (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)
PLACES = [
    ((0, 1, 8), (0, 0, 1, 0)),      # one process: LOCAL_WORLD_SIZE is the world, not the node's GPUs
    ((3, 4, 4), (3, 3, 4, 0)),
    ((5, 8, 4), (5, 1, 4, 1)),      # block distribution: slot 5 is node 1's second GPU
    ((7, 8, 2), (7, 1, 2, 3)),
]


@pytest.mark.parametrize(("args", "want"), PLACES, ids=[f"slot{a[0]}-of-{a[1]}-per{a[2]}" for a, _ in PLACES])
def test_block_place(args: tuple[int, int, int], want: tuple[int, int, int, int]) -> None:
    place = block_place(*args, master_addr="10.0.0.1", master_port=29500)
    assert (place.rank, place.local_rank, place.local_world_size, place.group_rank) == want
    assert place.world_size == args[1]


PLACE = RankPlace(rank=5, world_size=8, local_rank=1, local_world_size=4, group_rank=1, master_addr="node1",
                  master_port=29500)
BASE = {"PATH": "/usr/bin", "SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_CONF": "/etc/slurm.conf",
        "OMP_NUM_THREADS": "16", "HPCTRAIN_RESOLVED_JOB": "name: x", "RANK": "99"}

# (id, keyword arguments, variables that must have these values, variables that must be absent)
ENVS: list[tuple[str, dict[str, object], dict[str, Optional[str]], list[str]]] = [
    ("torchrun's variables", {}, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                  "GROUP_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
                                  "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin"}, []),
    ("no Slurm job variables, SLURM_CONF kept", {}, {"SLURM_CONF": "/etc/slurm.conf"},
     ["SLURM_JOB_ID", "SLURM_PROCID"]),
    ("one OpenMP thread by default", {}, {"OMP_NUM_THREADS": "1"}, []),
    ("OpenMP threads asked for", {"omp_threads": 4}, {"OMP_NUM_THREADS": "4"}, []),
    ("OpenMP: the launcher's own setting kept", {"omp_threads": None}, {"OMP_NUM_THREADS": "16"}, []),
    ("where the rank logs", {}, {LOG_DIR_ENV: "/runs/x/logs", ATTEMPT_ENV: "2"}, []),
    ("extra (nccl.env) added, torchrun's variables win", {"extra": {"NCCL_ALGO": "Ring", "RANK": "0"}},
     {"NCCL_ALGO": "Ring", "RANK": "5"}, []),
    ("dropped variables", {"drop": ("HPCTRAIN_RESOLVED_JOB",)}, {}, ["HPCTRAIN_RESOLVED_JOB"]),
]


@pytest.mark.parametrize(("kwargs", "present", "absent"), [e[1:] for e in ENVS], ids=[e[0] for e in ENVS])
def test_rank_env(kwargs: dict[str, object], present: dict[str, str], absent: list[str]) -> None:
    env = rank_env(BASE, PLACE, log_dir="/runs/x/logs", attempt=2, **kwargs)  # type: ignore[arg-type]
    assert {k: env.get(k) for k in present} == present
    assert not [k for k in absent if k in env]


# Children: python -c programs.
EXIT = "import sys; sys.exit({code})"
SLEEP = "import time; time.sleep(60)"
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)")


def _group(tmp_path: Path, programs: list[str], kill_wait_s: float = 1.0) -> RankGroup:
    group = RankGroup([sys.executable, "-c", "import os; exec(os.environ['PROGRAM'])"], cwd=tmp_path,
                      log_dir=tmp_path / "logs", attempt=0, kill_wait_s=kill_wait_s)
    for slot, program in enumerate(programs):
        place = block_place(slot, len(programs), len(programs), "127.0.0.1", 29500)
        group.start(slot, rank_env(os.environ, place, log_dir=str(tmp_path / "logs"), attempt=0,
                                   extra={"PROGRAM": program}))
    return group


def _wait_ready(tmp_path: Path, slot: int) -> None:
    log = tmp_path / "logs" / f"task-{slot}.attempt-0.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)


# (id, the ranks' programs, watch()'s answer, exit codes after it: None = any signal death)
WATCHES: list[tuple[str, list[str], Optional[tuple[int, int]], list[Optional[int]]]] = [
    ("all succeed", [EXIT.format(code=0)] * 3, None, [0, 0, 0]),
    ("a crash stops the others", [SLEEP, EXIT.format(code=1), SLEEP], (1, 1), [-signal.SIGTERM, 1, -signal.SIGTERM]),
    ("bad input (exit 2) stops the others", [EXIT.format(code=2), SLEEP], (0, 2), [2, -signal.SIGTERM]),
    # the failing rank waits a second: the stubborn one has installed its handler by then
    ("a rank ignoring SIGTERM is killed after the grace", [STUBBORN, "import sys, time; time.sleep(1); sys.exit(3)"],
     (1, 3), [-signal.SIGKILL, 3]),
]


@pytest.mark.parametrize(("programs", "first", "codes"), [w[1:] for w in WATCHES], ids=[w[0] for w in WATCHES])
def test_watch_stops_on_the_first_failure(tmp_path: Path, programs: list[str], first: Optional[tuple[int, int]],
                                          codes: list[Optional[int]]) -> None:
    group = _group(tmp_path, programs)
    started = time.monotonic()
    assert group.watch(poll_s=0.02) == first
    assert group.poll() == codes
    assert time.monotonic() - started < 20
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"task-{s}.attempt-0.log"
                                                                      for s in range(len(programs))]


def test_stop_escalates_to_kill_after_the_grace(tmp_path: Path) -> None:
    group = _group(tmp_path, [STUBBORN, SLEEP], kill_wait_s=30.0)
    _wait_ready(tmp_path, 0)
    started = time.monotonic()
    assert group.stop(grace_s=0.5) == [-signal.SIGKILL, -signal.SIGTERM]
    assert time.monotonic() - started < 10


def test_interrupted_watch_leaves_the_ranks_to_the_caller(tmp_path: Path) -> None:
    group = _group(tmp_path, [SLEEP])
    assert group.watch(poll_s=0.02, interrupted=lambda: True) is None and group.running()
    group.stop()
    assert group.poll() == [-signal.SIGTERM]


PARENT = """
import os, sys, time
from pathlib import Path
from hpctrain.launch.rank_group import RankGroup, block_place, rank_env
run = Path(sys.argv[1])
group = RankGroup([sys.executable, "-c", "import time; time.sleep(60)"], cwd=run, log_dir=run / "logs", attempt=0)
group.start(0, rank_env(os.environ, block_place(0, 1, 1, "127.0.0.1", 1), log_dir=str(run / "logs"), attempt=0))
print(group.pids[0], flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_their_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init, or a zombie until then
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    pytest.fail(f"rank {child} outlived its parent")
