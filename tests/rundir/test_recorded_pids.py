"""Issue 30 finding 4 at the run-directory contract: a recorded PID counts only while it is the recorded
process. A live `sleep`-like process stands for a process that got the PID after a reboot."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from hpctrain.rundir import lock


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat, read here (not with hpctrain's reader, which is under test)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _sleeper(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_a_lock_owner_whose_pid_another_process_has_is_not_live(tmp_path: Path) -> None:
    """The lock's fallback where flock is unsupported (NFS/Lustre: ENOLCK), which decides by the owner in
    the file; flock works here, so the owner check is called directly."""
    path = tmp_path / "ranks.lock"
    other = _sleeper()
    try:
        mine = _start_ticks(other.pid)
        record = {"host": socket.gethostname(), "pid": other.pid, "ranks": [], "starts": {str(other.pid): mine}}
        path.write_text(json.dumps(record))
        assert lock._owner_is_live(lock.read_owner(path))  # the recorded process itself: live
        record["starts"] = {str(other.pid): mine - 1}  # the recorded one started earlier: the pid was reused
        path.write_text(json.dumps(record))
        assert not lock._owner_is_live(lock.read_owner(path))
    finally:
        other.kill()
        other.wait()


def test_a_process_counts_only_when_its_command_line_names_the_run_and_it_started_when_recorded(tmp_path: Path) -> None:
    from hpctrain.rundir.process import is_recorded_process, start_ticks

    run = tmp_path / "runs" / "a"
    (run / "submit").mkdir(parents=True)
    sweep_task = tmp_path / "runs" / "sweep" / "tasks" / "3"
    sweep_task.mkdir(parents=True)
    ours = _sleeper("-m", "hpctrain.launch.local.supervisor", str(run / "submit" / "local-spec.json"))
    sweeps = _sleeper("-m", "hpctrain.launch.local.supervisor", str(tmp_path / "runs" / "sweep" / "submit" / "x.json"))
    try:
        started = start_ticks(ours.pid)
        assert started == _start_ticks(ours.pid)
        assert is_recorded_process(ours.pid, run, started, needs="hpctrain.launch.local.supervisor")
        assert not is_recorded_process(ours.pid, run, (started or 0) + 1)  # another start time
        assert not is_recorded_process(ours.pid, run, started, needs="hpctrain.runtime")  # another program
        assert not is_recorded_process(ours.pid, tmp_path / "runs" / "b", started)  # another run
        assert is_recorded_process(sweeps.pid, sweep_task, None)  # a sweep's supervisor serves its tasks
    finally:
        for proc in (ours, sweeps):
            proc.kill()
            proc.wait()
    assert not is_recorded_process(ours.pid, run, None, patience_s=0.1)  # gone
