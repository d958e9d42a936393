"""A real, throw-away Slurm cluster on this machine, for the launch and checkpoint tests.

Everything lives in one folder: config, munge key, MariaDB datadir, state, spool, logs, sockets.
`SLURM_CONF=<folder>/etc/slurm.conf` is honoured by the daemons and every client, so nothing is
written to /etc. Daemons run in the foreground as children of whoever called `start()` (so they
can be reaped) and are found again from `<folder>/cluster.json` by `SlurmCluster.attach()`.

Needs root and Debian 12's slurm-wlm 22.05, munge, slurmdbd and mariadb-server
(`scripts/install-test-deps`). Used by tests/slurm_fixture.py and scripts/slurm-cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REQUIRED_BINARIES = ("mungekey", "munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "srun",
                     "squeue", "scontrol", "sinfo", "sacct", "sacctmgr", "mariadbd",
                     "mariadb-install-db")
# Every process we start carries this variable, so stop() can find job processes and slurmstepd
# leftovers that outlived their daemon, without touching anyone else's processes.
MARKER_VAR = "HPCTRAIN_TEST_CLUSTER"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; keep a margin
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SlurmClusterError(RuntimeError):
    """The test cluster could not start, stop, or answer in time. The message names the log."""


def missing_binaries() -> list[str]:
    """The programs the cluster needs that are not on PATH (empty when it can start)."""
    path = os.environ.get("PATH", "") + ":" + _SBIN_PATH
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (held together so none repeat)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def poll(check: Callable[[], T | None], timeout_s: float, what: str,
         interval_s: float = 0.1) -> T:
    """Call `check` until it returns something other than None; raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise SlurmClusterError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def process_state(pid: int) -> str | None:
    """The one-letter state of `pid` from /proc (R, S, Z, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split()[1]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def is_alive(pid: int) -> bool:
    """True unless `pid` is gone or a zombie (PID 1 here does not reap orphans: Z means stopped)."""
    return process_state(pid) not in (None, "Z")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`Key=Value Key2=Value with spaces ...` (one `scontrol show -o` line) into a dict."""
    pairs = re.finditer(r"(?:^|\s)([A-Za-z][\w:/.]*)=(.*?)(?=\s[A-Za-z][\w:/.]*=|$)", line.strip())
    return {m.group(1): m.group(2) for m in pairs}


class SlurmCluster:
    """One slurmctld, `nodes` slurmd (node1..nodeN) with fake GPUs, optional slurmdbd + MariaDB.

    Partitions: `low` (default; preemptible, requeued with GraceTime=10) and `high`
    (PriorityTier=10, preempts `low`). Each node has `cpus_per_node` CPUs and `gpus_per_node`
    GPUs whose device files are symlinks to /dev/null.
    """

    def __init__(self, root: str | os.PathLike[str], *, nodes: int = 2, cpus_per_node: int = 4,
                 gpus_per_node: int = 4, accounting: bool = True,
                 cluster_name: str = "hpctest") -> None:
        self.root = Path(root).resolve()
        self.etc, self.run_dir, self.log_dir = (self.root / d for d in ("etc", "run", "log"))
        self.slurm_conf = self.etc / "slurm.conf"
        self.munge_socket = self.run_dir / "munge.socket"
        self.mysql_socket = self.run_dir / "mysql.socket"
        self.node_names = [f"node{k}" for k in range(1, nodes + 1)]
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self.accounting = accounting
        self.cluster_name = cluster_name
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self._popens: dict[str, subprocess.Popen[bytes]] = {}
        for path in (self.munge_socket, self.mysql_socket):
            if len(str(path)) > _SOCKET_PATH_MAX:
                raise SlurmClusterError(f"cluster folder {self.root} is too deep: the socket "
                                        f"path {path} exceeds {_SOCKET_PATH_MAX} characters; "
                                        "use a shorter folder (e.g. under /tmp)")

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client needs: merge into the environment of sbatch, squeue, submitit..."""
        path = os.environ.get("PATH", "")
        return {"SLURM_CONF": str(self.slurm_conf), MARKER_VAR: str(self.root),
                "PATH": f"{path}:{_SBIN_PATH}" if path else _SBIN_PATH}

    def client_env(self) -> dict[str, str]:
        """os.environ with `env` applied: the full environment for a client subprocess."""
        return {**os.environ, **self.env}

    @classmethod
    def attach(cls, root: str | os.PathLike[str]) -> SlurmCluster:
        """The cluster described by `<root>/cluster.json` (started by another process)."""
        meta_path = Path(root).resolve() / "cluster.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise SlurmClusterError(f"no test cluster in {root}: {meta_path} is missing") from None
        cluster = cls(root, **meta["options"])
        cluster.ports, cluster.pids = meta["ports"], meta["pids"]
        return cluster

    def _save_meta(self) -> None:
        options = {"nodes": self.nodes, "cpus_per_node": self.cpus_per_node,
                   "gpus_per_node": self.gpus_per_node, "accounting": self.accounting,
                   "cluster_name": self.cluster_name}
        meta = {"options": options, "ports": self.ports, "pids": self.pids,
                "slurm_conf": str(self.slurm_conf)}
        (self.root / "cluster.json").write_text(json.dumps(meta, indent=2) + "\n")

    # ---- start --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Wipe the folder, write the config and start every daemon; return once nodes are idle."""
        missing = missing_binaries()
        if missing:
            raise SlurmClusterError(f"missing {', '.join(missing)}: run scripts/install-test-deps")
        deadline = time.monotonic() + timeout_s
        self._wipe()
        names = ["slurmctld", "slurmdbd", "mysql", *self.node_names]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        write_config(self)
        try:
            self._start_munge(deadline)
            if self.accounting:
                self._start_accounting(deadline)
            self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
            self._wait_port("slurmctld", deadline)
            if self.accounting:
                self._ensure_cluster_registered(deadline)
            for node in self.node_names:
                self._spawn(node, ["slurmd", "-D", "-N", node])
            self.wait_nodes_idle(max(deadline - time.monotonic(), 1.0))
        except BaseException:
            try:
                self.stop()
            except SlurmClusterError:
                pass  # the start-up error says more
            raise
        return self

    def _wipe(self) -> None:
        """Empty the folder, refusing one that holds anything but a previous test cluster."""
        if self.root.exists() and any(self.root.iterdir()):
            if not (self.root / "cluster.json").exists():
                raise SlurmClusterError(f"{self.root} is not empty and holds no cluster.json; "
                                        "refusing to wipe it: give an empty or new folder")
            previous = SlurmCluster.attach(self.root)
            if any(previous._owns(pid) for pid in previous.pids.values()):
                raise SlurmClusterError(f"a test cluster is still running in {self.root}; "
                                        "stop it first")
            shutil.rmtree(self.root)
        for sub in ("etc", "run", "log", "state", "dev", "munge", "jobs",
                    *(f"spool/{node}" for node in self.node_names)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._save_meta()

    def _spawn(self, name: str, argv: list[str]) -> None:
        """Start a foreground daemon, logging its stdout/stderr to log/<name>.out."""
        env = {**os.environ, **self.env}
        with open(self.log_dir / f"{name}.out", "ab") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                     start_new_session=True)
        self._popens[name] = popen
        self.pids[name] = popen.pid
        self._save_meta()

    def _check_alive(self, name: str) -> None:
        if not is_alive(self.pids[name]):
            raise SlurmClusterError(f"{name} exited during start-up; see {self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a daemon's logs, for error messages."""
        parts = []
        for path in sorted(self.log_dir.glob(f"{name}*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"{path}:\n  " + "\n  ".join(text))
        return "\n".join(parts) or f"(no log for {name} in {self.log_dir})"

    def _wait_for(self, name: str, ready: Callable[[], bool], deadline: float, what: str) -> None:
        def check() -> bool | None:
            self._check_alive(name)
            return True if ready() else None
        try:
            poll(check, max(deadline - time.monotonic(), 0.5), what, interval_s=0.05)
        except SlurmClusterError as exc:
            raise SlurmClusterError(f"{exc}; see {self.log_tail(name)}") from None

    def _wait_port(self, name: str, deadline: float) -> None:
        def ready() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.ports[name]), timeout=0.5):
                    return True
            except OSError:
                return False
        self._wait_for(name, ready, deadline, f"{name} to listen on port {self.ports[name]}")

    def _start_munge(self, deadline: float) -> None:
        key = self.root / "munge" / "munge.key"
        (self.root / "munge").chmod(0o700)
        self.run(["mungekey", "--create", f"--keyfile={key}"], timeout_s=10)
        key.chmod(0o400)
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}",
                               f"--pid-file={self.run_dir / 'munged.pid'}",
                               f"--log-file={self.log_dir / 'munged.log'}",
                               f"--seed-file={self.root / 'munge' / 'munge.seed'}"])
        self._wait_for("munged", self.munge_socket.exists, deadline, "the munge socket")

    def _start_accounting(self, deadline: float) -> None:
        datadir = self.root / "mysql"
        # A temporary folder of its own: with the default /tmp, clusters bootstrapped at the same moment (one per
        # pytest-xdist worker) were seen to lose each other's temporary tables ("Could not remove temporary
        # table '/tmp/#sql-temptable-...'", mariadb-install-db exit 1).
        tmpdir = self.root / "mysql-tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
                  "--auth-root-authentication-method=normal", "--skip-test-db",
                  "--skip-name-resolve", f"--tmpdir={tmpdir}"], timeout_s=60)
        self._spawn("mysql", [
            "mariadbd", "--no-defaults", f"--datadir={datadir}", "--user=root", f"--tmpdir={tmpdir}",
            f"--socket={self.mysql_socket}", f"--port={self.ports['mysql']}",
            "--bind-address=127.0.0.1", f"--pid-file={self.run_dir / 'mysql.pid'}",
            f"--log-error={self.log_dir / 'mysql.log'}", "--skip-log-bin",
            "--skip-name-resolve", "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=16M", "--innodb-flush-log-at-trx-commit=0",
            "--innodb-lock-wait-timeout=900"])
        self._wait_port("mysql", deadline)
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait_port("slurmdbd", deadline)

    def _ensure_cluster_registered(self, deadline: float) -> None:
        """slurmctld registers itself with slurmdbd on start; wait for it, add it if it did not."""
        def registered() -> bool:
            out = self.run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"],
                           check=False, timeout_s=10).stdout.split()
            return self.cluster_name in out
        try:
            self._wait_for("slurmctld", registered, min(deadline, time.monotonic() + 5),
                           "the cluster to register with slurmdbd")
        except SlurmClusterError:
            self.run(["sacctmgr", "-i", "add", "cluster", self.cluster_name], timeout_s=10)

    # ---- clients ------------------------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, timeout_s: float = 30.0,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a client command (sbatch, squeue, ...) against this cluster; never hangs."""
        try:
            result = subprocess.run(argv, env=self.client_env(), capture_output=True, text=True,
                                    timeout=timeout_s, input=input_text, check=False)
        except subprocess.TimeoutExpired:
            raise SlurmClusterError(f"{' '.join(argv)} did not finish in {timeout_s:g} s") from None
        if check and result.returncode != 0:
            raise SlurmClusterError(f"{' '.join(argv)} exited {result.returncode}: "
                                    f"{result.stderr.strip() or result.stdout.strip()}")
        return result

    def sbatch(self, *args: str, script: str | None = None) -> str:
        """Submit with `sbatch --parsable ARGS` (script text on stdin if given); return the id.

        Without `--output`/`-o` in ARGS the job's output goes to `<root>/jobs/slurm-%j.out`,
        not to slurm-N.out files in the current directory.
        """
        if not any(a.startswith(("--output", "-o")) for a in args):
            args = (f"--output={self.root / 'jobs' / 'slurm-%j.out'}", *args)
        out = self.run(["sbatch", "--parsable", *args], input_text=script).stdout
        return out.strip().split(";")[0]

    def node_states(self) -> dict[str, str]:
        """{node name: state} from sinfo, e.g. {'node1': 'idle', 'node2': 'alloc'}."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout_s=10).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_nodes_idle(self, timeout_s: float = 30.0) -> dict[str, str]:
        """Wait until every node is idle; return the node states."""
        def check() -> dict[str, str] | None:
            states = self.node_states()
            ok = sorted(states) == self.node_names and set(states.values()) == {"idle"}
            return states if ok else None
        try:
            return poll(check, timeout_s, "all nodes idle", interval_s=0.1)
        except SlurmClusterError as exc:
            raise SlurmClusterError(f"{exc}: {self.node_states()}; "
                                    f"see {self.log_tail('slurm')}") from None

    def job_info(self, jobid: str) -> dict[str, str] | None:
        """`scontrol show job -o` as a dict, or None once slurmctld has forgotten the job."""
        result = self.run(["scontrol", "show", "job", "-o", str(jobid)], check=False, timeout_s=10)
        line = result.stdout.strip().splitlines()
        return parse_scontrol_record(line[0]) if result.returncode == 0 and line else None

    def job_state(self, jobid: str) -> str | None:
        """The job's state from slurmctld (PENDING, RUNNING, ...), else from sacct, else None."""
        info = self.job_info(jobid)
        return info.get("JobState") if info else self.sacct_state(jobid)

    def sacct_state(self, jobid: str) -> str | None:
        """The job's state in the accounting database (None until slurmdbd has heard of it)."""
        out = self.run(["sacct", "-n", "-X", "-P", "-j", str(jobid), "-o", "State"],
                       check=False, timeout_s=10).stdout.split("\n")[0].strip()
        return out.split()[0] if out else None  # "CANCELLED by 0" -> CANCELLED

    def wait_job(self, jobid: str, states: str | Iterable[str], timeout_s: float = 60.0,
                 source: str = "scontrol") -> str:
        """Wait until job `jobid` is in one of `states`; return the state.

        `source` is "scontrol" (slurmctld's view, falling back to sacct) or "sacct" (the
        accounting database, which lags by up to a few seconds). Raises SlurmClusterError on
        timeout, or as soon as the job ends in a state not asked for.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        getter = self.sacct_state if source == "sacct" else self.job_state
        last: list[str | None] = [None]

        def check() -> str | None:
            state = last[0] = getter(jobid)
            if state in wanted:
                return state
            if state in TERMINAL_STATES:
                raise SlurmClusterError(f"job {jobid} ended {state}, not {sorted(wanted)}: "
                                        f"{self.job_info(jobid)}")
            return None
        try:
            return poll(check, timeout_s, f"job {jobid} to be {sorted(wanted)}", interval_s=0.2)
        except SlurmClusterError as exc:
            if "timed out" not in str(exc):
                raise
            info = self.job_info(jobid)
            raise SlurmClusterError(f"{exc}; last state {last[0]}: {info}") from None

    # ---- stop ---------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every daemon and every leftover job process; safe to call twice or after a crash.

        Daemons get SIGTERM in reverse start order (SIGKILL after a grace period); then every
        process that still carries this cluster's marker (slurmstepd, job steps) is killed.
        """
        deadline = time.monotonic() + timeout_s
        stages = [[*self.node_names, "slurmctld"], ["slurmdbd"], ["mysql"], ["munged"]]
        for stage in stages:
            pids = [self.pids[n] for n in stage if n in self.pids and self._owns(self.pids[n])]
            grace_s = max(min(10.0, deadline - time.monotonic()), 0.5)
            self._terminate(pids, grace_s)
        self._terminate(self.leftover_pids(), 2.0, sig=signal.SIGKILL)
        for popen in self._popens.values():
            popen.poll()  # reap our own children so they do not linger as zombies
        still = self.live_pids()
        if still:
            raise SlurmClusterError(f"processes of the test cluster still alive: {still}")

    def _owns(self, pid: int) -> bool:
        """True when `pid` is alive and ours (its environment carries our marker)."""
        return is_alive(pid) and self._has_marker(pid)

    def _has_marker(self, pid: int) -> bool:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return f"{MARKER_VAR}={self.root}".encode() in environ

    def leftover_pids(self) -> list[int]:
        """Live processes (not this one or its parents) that carry this cluster's marker."""
        skip = {os.getpid()}
        pid = os.getppid()
        while pid > 1 and pid not in skip:
            skip.add(pid)
            pid = _parent_pid(pid)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        return [p for p in pids if p not in skip and self._owns(p)]

    def live_pids(self) -> dict[str, int]:
        """{name: pid} of daemons and leftovers still alive (zombies count as stopped)."""
        alive = {name: pid for name, pid in self.pids.items() if self._owns(pid)}
        known = set(alive.values())
        alive.update({f"pid{p}": p for p in self.leftover_pids() if p not in known})
        return alive

    def _terminate(self, pids: list[int], grace_s: float, sig: int = signal.SIGTERM) -> None:
        for pid in pids:
            _kill(pid, sig)
        try:
            poll(lambda: True if not any(is_alive(p) for p in pids) else None, grace_s,
                 "daemons to exit", interval_s=0.05)
        except SlurmClusterError:
            for pid in pids:
                _kill(pid, signal.SIGKILL)
            poll(lambda: True if not any(is_alive(p) for p in pids) else None, 5.0,
                 f"SIGKILLed processes {pids} to exit")
        for popen in self._popens.values():
            popen.poll()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _parent_pid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def write_config(cluster: SlurmCluster) -> None:
    """slurm.conf, gres.conf, plugstack.conf, slurmdbd.conf and the fake GPU device files."""
    c, etc, root = cluster, cluster.etc, cluster.root
    gpus = c.gpus_per_node
    for k in range(gpus):
        (root / "dev" / f"nvidia{k}").symlink_to("/dev/null")
    host = socket.gethostname().split(".")[0]
    lines = [
        f"ClusterName={c.cluster_name}", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={c.ports['slurmctld']}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={c.munge_socket},cred_expire=10",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerParameters=sched_interval=2,bf_interval=1", "ReturnToService=2",
        "SlurmdParameters=config_overrides", "KillWait=5", "OverTimeLimit=0",
        "MailProg=/bin/true", f"PlugStackConfig={etc / 'plugstack.conf'}", "GresTypes=gpu",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={c.run_dir / 'slurmctld.pid'}",
        f"SlurmdPidFile={c.run_dir / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={c.log_dir / 'slurmctld.log'}",
        f"SlurmdLogFile={c.log_dir / 'slurmd-%n.log'}", "SlurmctldDebug=info",
        "SlurmdDebug=info", "JobCompType=jobcomp/none",
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        "SlurmctldParameters=preempt_send_user_signal",
    ]
    if c.accounting:
        lines += ["AccountingStorageType=accounting_storage/slurmdbd",
                  "AccountingStorageHost=127.0.0.1",
                  f"AccountingStoragePort={c.ports['slurmdbd']}",
                  # this connection ignores AuthInfo: the munge socket goes here
                  f"AccountingStoragePass={c.munge_socket}",
                  "AccountingStorageTRES=gres/gpu", "JobAcctGatherType=jobacct_gather/none"]
    for node in c.node_names:
        lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={c.ports[node]} "
                     f"CPUs={c.cpus_per_node} RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN")
    nodes = ",".join(c.node_names)
    lines += [f"PartitionName=low Nodes={nodes} Default=YES PreemptMode=REQUEUE GraceTime=10 "
              "MaxTime=INFINITE State=UP",
              f"PartitionName=high Nodes={nodes} PriorityTier=10 MaxTime=INFINITE State=UP"]
    c.slurm_conf.write_text("\n".join(lines) + "\n")
    devices = f"{root / 'dev'}/nvidia[0-{gpus - 1}]" if gpus > 1 else f"{root / 'dev'}/nvidia0"
    (etc / "gres.conf").write_text(f"Name=gpu File={devices}\n" if gpus else "")
    (etc / "plugstack.conf").write_text("")
    dbd = etc / "slurmdbd.conf"
    dbd.write_text("\n".join([
        "AuthType=auth/munge", f"AuthInfo=socket={c.munge_socket}", f"DbdHost={host}",
        "DbdAddr=127.0.0.1", f"DbdPort={c.ports['slurmdbd']}", "SlurmUser=root",
        f"PidFile={c.run_dir / 'slurmdbd.pid'}", f"LogFile={c.log_dir / 'slurmdbd.log'}",
        "DebugLevel=info", "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1",
        f"StoragePort={c.ports['mysql']}", "StorageUser=root", "StorageLoc=slurm_acct_db",
    ]) + "\n")
    dbd.chmod(0o600)
