"""A real, throw-away Ray head on this machine (loopback only), for the Ray executor's tests and bench.

`ray start --head --block` runs as the leader of its own process session; stop() sends it SIGTERM
(which makes it stop every process it started) and then kills, by pid, whatever is left in that
session. Never `ray stop`: that stops every Ray of the user on the machine, other people's included.
The Jobs API needs the dashboard, so it is started on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


# Ports come from a block of this pytest-xdist worker's own, below the kernel's ephemeral range: a port the kernel
# hands out (bind to 0) and this code releases before Ray binds it can be handed to another worker's head in
# between, or taken by one of Ray's own ephemeral listeners (CI once saw a head's dashboard agent refuse to start,
# "address already in use", on the port another worker's head had for its dashboard).
# Ray's own worker ports are 10002-19999 (its min/max_worker_port defaults): the blocks start above them.
PORT_BASE = 20000
PORT_BLOCK = 1000
_next_port = itertools.count()


def _worker_index() -> int:
    digits = "".join(ch for ch in os.environ.get("PYTEST_XDIST_WORKER", "") if ch.isdigit())
    return int(digits) if digits else 0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` ports free now, from this worker's block (PORT_BASE + worker x PORT_BLOCK, under 32768 for up to 12
    workers), each handed out once per process until the block wraps."""
    base = PORT_BASE + _worker_index() * PORT_BLOCK
    ports: list[int] = []
    for _ in range(PORT_BLOCK):
        port = base + next(_next_port) % PORT_BLOCK
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {base}-{base + PORT_BLOCK - 1}")


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


class RayCluster:
    """One Ray head with `cpus` CPUs and no GPUs; `address` is its Jobs API (dashboard) URL."""

    def __init__(self, log_path: Path, *, cpus: int = 2, pythonpath: Optional[str] = None,
                 ports: Optional[tuple[int, int]] = None) -> None:
        """`ports`: (GCS, dashboard) to start on, e.g. a dead head's, to stand in for it at its address."""
        self.log_path = log_path
        self.cpus = cpus
        self.pythonpath = pythonpath
        self.proc: Optional[subprocess.Popen[bytes]] = None
        gcs, dashboard = ports or free_ports(2)
        self.gcs_port, self.dashboard_port = gcs, dashboard
        self.address = f"http://127.0.0.1:{dashboard}"
        self.temp_dir = f"/tmp/hpct-ray-{os.getpid()}-{dashboard}"  # Ray's socket paths must stay short

    def start(self, timeout_s: float = 120.0) -> RayCluster:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={self.gcs_port}",
                 "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}", "--num-gpus=0", "--include-dashboard=true",
                 "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}", f"--temp-dir={self.temp_dir}",
                 *self._own_ports(), "--disable-usage-stats"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                JobSubmissionClient(self.address).list_jobs()
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"Ray did not start: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.5)

    @staticmethod
    def _own_ports() -> list[str]:
        """Free ports for the head's other listeners, whose defaults are fixed (the Ray client server's 10001,
        the dashboard agent's 52365, ...): two heads at once (tests on different pytest-xdist workers) would
        otherwise collide, and the second head's dashboard fails to start."""
        names = ("ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port")
        return [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)))]

    def gcs_pid(self) -> Optional[int]:
        """The pid of this head's `gcs_server` (a process of this head's session only), or None."""
        assert self.proc is not None
        for pid in session_pids(self.proc.pid):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if os.path.basename(argv0) == b"gcs_server":
                return pid
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in session_pids(self.proc.pid):  # only the session this object started
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc = None
