"""The driver of a Ray job: `python -m hpctrain.launch.ray.driver --run-dir DIR` (the Ray entrypoint).

It plays the part of the sbatch script on a Ray cluster. Each attempt starts one `RankWorker` actor
per GPU (per CPU slot on a cluster without GPUs); each actor runs the same runtime entry point as
srun does, as a child process with torchrun's variables: RANK (the slot, mapped through
placement.rank_order by the runtime), WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT from rank 0's
actor (its node's address and a port free there). Logs go to logs/task-S.attempt-A.log, then the
runtime's logs/rank-R.attempt-A.log, as under srun.

One dead rank stops the others (srun --kill-on-bad-exit). A failed attempt is started again when the
restart policy says so (rundir/restart.py `decide`, the batch script's exit path's rules: exit 2 and a
second crash at the same step are final; within restart.max_requeues) and resumes from the newest
checkpoint; a `requeued` / `not_requeued` event says why. On SIGTERM (`hpctrain cancel`, Ray's
stop_job) the ranks are stopped.

The head can die under a running job (only its `gcs_server` killed, a head node lost): every Ray call then
blocks, and a driver left alone waits forever (issue 30: at "starting attempt 1" for minutes, its ranks
orphaned). A watchdog thread (HeadWatch) opens a TCP connection to the GCS every HEAD_CHECK_S; after
HEAD_MISSES refusals in a row (~10 s) the driver records a `failed` event (stage "ray-driver", reason
RAY_HEAD_GONE), stops the ranks on its node (SIGTERM, SIGKILL after STOP_GRACE_S; by pid, only processes
whose command line names this run) and exits: no Ray call is needed for any of it. Ranks on other nodes
die with their actors when those nodes' raylets give up on the GCS (PR_SET_PDEATHSIG).
This module runs on the Ray cluster only: it imports ray at the top, the login path never imports it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import ray

from hpctrain.config import load_job
from hpctrain.launch.rank_group import RankGroup, RankPlace, rank_env
from hpctrain.launch.stages import rank_argv
from hpctrain.rundir.events import FAILED, NOT_REQUEUED, RAY_HEAD_GONE, REQUEUED, append_event
from hpctrain.rundir.layout import BAD_INPUT_MARKER, REQUEUE_MARKER, RESOLVED_FILE
from hpctrain.rundir.metrics import last_metrics
from hpctrain.rundir.ports import free_port
from hpctrain.rundir.ranks import next_attempt
from hpctrain.rundir.restart import FINISHED, RANK_CRASHED, FailedStep, Markers, decide, read_marker, step_key
from hpctrain.rundir.safe_files import append

POLL_S = 0.5
STOP_GRACE_S = 2.0  # Ray's stop_job escalates to SIGKILL after a few seconds: stop the ranks within them
DRIVER_LOG = "ray-driver.log"  # in logs/
WORKER_LOST = -9  # the exit code recorded for a rank whose actor (or node) died
HEAD_CHECK_S = 2.0  # how often the watchdog knocks at the GCS
HEAD_MISSES = 5  # refusals in a row before the head counts as gone (a GCS restarting in place takes less)
HEAD_GONE_EXIT = 1


class HeadWatch:
    """A daemon thread that calls on_gone() once, after `misses` failed TCP connects in a row to the
    head's GCS (host, port), checked every `every_s`. A TCP connect, not a Ray call: with the GCS gone
    Ray's own calls block (they wait for it to come back) instead of answering."""

    def __init__(self, host: str, port: int, on_gone: Callable[[], None], *, every_s: float = HEAD_CHECK_S,
                 misses: int = HEAD_MISSES) -> None:
        self.host, self.port, self.on_gone = host, port, on_gone
        self.every_s, self.misses = every_s, misses
        self.missed = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ray-head-watch", daemon=True)

    def start(self) -> HeadWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def alive(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=max(0.5, self.every_s)):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.missed = 0 if self.alive() else self.missed + 1
            if self.missed >= self.misses:
                self.on_gone()
                return


def gcs_host_port(address: str) -> tuple[str, int]:
    """'10.0.0.1:6379' (Ray's GCS address, maybe with a scheme) -> ('10.0.0.1', 6379)."""
    host, _, port = address.split("://")[-1].rpartition(":")
    return host.strip("[]"), int(port)


def _names_run(pid: int, run_dir: Path) -> bool:
    """Whether `pid` is a live process whose command line names run_dir (a reused pid, a zombie: no)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(run_dir).encode() in argv


def stop_pids(pids: Sequence[int], run_dir: Path, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each process of `pids` that names run_dir, SIGKILL to those left after grace_s.
    By pid: the ranks are children of actors that nobody can reach through Ray once the head is gone."""
    def signal_all(signum: int) -> list[int]:
        hit = []
        for pid in pids:
            if _names_run(pid, run_dir):
                try:
                    os.kill(pid, signum)
                    hit.append(pid)
                except OSError:
                    pass
        return hit

    if not signal_all(signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_names_run(pid, run_dir) for pid in pids):
        time.sleep(0.1)
    signal_all(signal.SIGKILL)


@ray.remote(num_cpus=0)
class RankWorker:
    """Holds one rank's process on whichever node Ray placed this actor: a rank group of one
    (launch/rank_group.py; the rank dies with this actor, PR_SET_PDEATHSIG: no orphans)."""

    def __init__(self) -> None:
        self.group: Optional[RankGroup] = None

    def address(self) -> tuple[str, int]:
        """(this node's address, a TCP port free on it now): rank 0's answer is the rendezvous."""
        return ray.util.get_node_ip_address(), free_port("")  # below the ephemeral range (rundir/ports.py)

    def start(self, argv: list[str], slot: int, place: RankPlace, extra: dict[str, str], log_dir: str,
              attempt: int, cwd: str, omp_threads: int) -> int:
        self.group = RankGroup(argv, cwd=Path(cwd), log_dir=Path(log_dir), attempt=attempt)
        env = rank_env(os.environ, place, log_dir=log_dir, attempt=attempt, extra=extra, omp_threads=omp_threads)
        return self.group.start(slot, env).pid

    def poll(self) -> Optional[int]:
        return self.group.poll()[0] if self.group else None

    def stop(self, grace_s: float) -> Optional[int]:
        return self.group.stop(grace_s)[0] if self.group else None


class Driver:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.job = load_job(str(run_dir / RESOLVED_FILE))
        self.world = self.job.world_size
        self.workers: list[Any] = []
        self.cancelled = False
        self.attempt: Optional[int] = None
        self.node_ip: Optional[str] = None  # this driver's node: the ranks it can stop by pid
        self.rank_pids: list[tuple[str, int]] = []  # (node address, pid) of the current attempt's ranks
        self.head_alive: Callable[[], bool] = lambda: True  # HeadWatch.alive once main() started the watchdog

    def _gpus(self) -> int:
        """1 GPU per worker where the cluster has GPUs and the job asks for them, else 0 (a CPU slot)."""
        return 1 if self.job.cluster.gpu != "cpu" and ray.cluster_resources().get("GPU", 0) > 0 else 0

    def _place(self, slot: int, ips: list[str], master: tuple[str, int]) -> RankPlace:
        nodes = list(dict.fromkeys(ips))  # node order of first appearance: GROUP_RANK
        same = [i for i, ip in enumerate(ips) if ip == ips[slot]]
        return RankPlace(rank=slot, world_size=self.world, local_rank=same.index(slot), local_world_size=len(same),
                         group_rank=nodes.index(ips[slot]), master_addr=master[0], master_port=master[1])

    def _protocol_env(self) -> dict[str, str]:
        return {"HPCTRAIN_REQUEUE_MARKER": str(self.run_dir / REQUEUE_MARKER),
                "HPCTRAIN_BAD_INPUT_MARKER": str(self.run_dir / BAD_INPUT_MARKER),
                "HPCTRAIN_REQUEUE_BY": "batch-script"}  # the driver requeues; the runtime never calls scontrol

    def run_attempt(self, attempt: int) -> int:
        """Start the ranks, wait for them; the first failing exit code (or 0)."""
        for marker in (REQUEUE_MARKER, BAD_INPUT_MARKER):
            (self.run_dir / marker).unlink(missing_ok=True)
        options = {"num_cpus": self.job.cluster.ray.cpus_per_worker, "num_gpus": self._gpus()}
        self.workers = [RankWorker.options(**options).remote() for _ in range(self.world)]  # type: ignore[attr-defined]
        try:
            addresses = ray.get([w.address.remote() for w in self.workers])
            ips = [ip for ip, _ in addresses]
            argv = rank_argv(self.run_dir, self.job, sys.executable)
            logs = self.run_dir / "logs"
            omp = max(1, int(self.job.cluster.ray.cpus_per_worker))
            pids = ray.get([w.start.remote(argv, slot, self._place(slot, ips, addresses[0]), self._protocol_env(),
                                           str(logs), attempt, str(self.run_dir), omp)
                            for slot, w in enumerate(self.workers)])
            self.rank_pids = list(zip(ips, (int(pid) for pid in pids)))
            self.say(f"attempt {attempt}: {self.world} rank(s) on {', '.join(dict.fromkeys(ips))}, "
                  f"rendezvous {addresses[0][0]}:{addresses[0][1]}")
            return self._wait()
        finally:
            self._stop()

    def _codes(self) -> list[Optional[int]]:
        codes: list[Optional[int]] = []
        for worker in self.workers:
            try:
                codes.append(ray.get(worker.poll.remote(), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                codes.append(WORKER_LOST)  # the actor's process or node is gone
        return codes

    def _wait(self) -> int:
        while not self.cancelled:
            codes = self._codes()
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
        return 1

    def _stop(self) -> None:
        for worker in self.workers:
            try:
                ray.get(worker.stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + 5)
            except Exception:  # a dead actor: its rank died with it (PDEATHSIG)
                pass
            ray.kill(worker)
        self.workers = []

    def say(self, text: str) -> None:
        """A line in Ray's job log and in logs/ray-driver.log (what `hpctrain logs` shows beside the ranks')."""
        line = f"hpctrain: {text}"
        print(line, flush=True)
        append(self.run_dir / "logs" / DRIVER_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n".encode())

    def on_sigterm(self, *_: Any) -> None:
        self.cancelled = True

    def on_head_gone(self, where: str) -> None:
        """The watchdog's verdict (HeadWatch): record why, stop the ranks on this node, exit now (the main
        thread may be blocked in a Ray call that never returns)."""
        try:
            step = (last_metrics(self.run_dir) or {}).get("step")
            gone_s = HEAD_CHECK_S * HEAD_MISSES
            append_event(self.run_dir, FAILED, stage="ray-driver", reason=RAY_HEAD_GONE, attempt=self.attempt,
                         step=step, gcs=where, source="ray-driver")
            self.say(f"{RAY_HEAD_GONE}: no GCS at {where} for {gone_s:g} s; stopping the ranks and exiting "
                     "(`hpctrain resume` on a running head continues from the newest checkpoint)")
            stop_pids([pid for ip, pid in self.rank_pids if self.node_ip in (None, ip)], self.run_dir)
        finally:
            os._exit(HEAD_GONE_EXIT)

    def run(self) -> int:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        attempt = first = next_attempt(logs)
        last_failed_step: Optional[FailedStep] = None
        while True:
            self.attempt = attempt
            code = self.run_attempt(attempt)
            if code != 0 and not self.cancelled and not self.head_alive():
                # The ranks' actors died with the head: no requeue on a dead head; the watchdog decides (it
                # exits the driver when the head stays gone; if the head is back, the attempt is judged as usual).
                time.sleep(HEAD_CHECK_S * (HEAD_MISSES + 2))
            raw = (last_metrics(self.run_dir) or {}).get("step")
            step = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
            fields = {"attempt": attempt, "exit_code": code, "step": raw, "source": "ray-driver"}
            if self.cancelled:
                self.say("cancelled: the ranks were stopped")
                return 1
            markers = Markers(read_marker(str(self.run_dir / REQUEUE_MARKER)),
                              read_marker(str(self.run_dir / BAD_INPUT_MARKER)))
            decision = decide(code, markers, step, last_failed_step, attempt - first, self.job.restart)
            if decision.cause == FINISHED:
                self.say(f"training finished (attempt {attempt})")
                return 0
            if not decision.requeue:
                append_event(self.run_dir, NOT_REQUEUED, reason=decision.cause, why_not=decision.reason, **fields)
                self.say(f"not requeued ({decision.reason}): attempt {attempt} exited {code}")
                return code or 1
            if decision.cause == RANK_CRASHED:
                last_failed_step = step_key(step)
            append_event(self.run_dir, REQUEUED, reason=decision.cause, **fields)
            self.say(f"attempt {attempt} exited {code} ({decision.cause}); starting attempt {attempt + 1}")
            attempt += 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.launch.ray.driver")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    driver = Driver(args.run_dir.resolve())
    signal.signal(signal.SIGTERM, driver.on_sigterm)
    ray.init(log_to_driver=False)
    driver.node_ip = ray.util.get_node_ip_address()
    gcs = str(ray.get_runtime_context().gcs_address)
    host, port = gcs_host_port(gcs)
    watch = HeadWatch(host, port, lambda: driver.on_head_gone(gcs)).start()
    driver.head_alive = watch.alive
    try:
        return driver.run()
    finally:
        watch.stop()


if __name__ == "__main__":
    sys.exit(main())
