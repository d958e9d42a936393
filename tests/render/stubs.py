"""Run a rendered job script for real, with stub Slurm/container/monitor programs that record argv.

Every stub appends one record per call to its own file under <log>/calls/ (NUL-separated: program
name, then each argument), so concurrent monitor steps never interleave. `srun`, `singularity`,
`apptainer` and `nsys` then run the command they wrap, as the real ones would, so the argv of the
whole chain srun -> singularity -> nsys -> python3 is recorded. `python3` plays the runtime: it
records its environment, writes the requeue marker when asked, and exits with the status asked.
`pwned` must never run: hostile test strings try to call it. The exit path's restart policy
(`python3 -m hpctrain.rundir.restart`, inside the image when there is one) is hpctrain's own step, not a
program under test here: the stubs hand it to the real interpreter ($STUB_REAL_PYTHON) without recording it,
and tests/render/test_exit_path.py checks it by what the script then does.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

POLICY = 'case " $* " in *" -m hpctrain.rundir.restart "*) POLICY=1 ;; *) POLICY= ;; esac\n'
# singularity/apptainer exec [options] -- IMAGE COMMAND...: run COMMAND (recorded, unless it is the restart policy).
CONTAINER = (POLICY + '[ -n "$POLICY" ] || record "$@"\n'
             'while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done\nshift 2\nexec "$@"\n')
RECORD = r'''record() {
    local file="$STUB_LOG/calls/${EPOCHREALTIME/./}-$$-$RANDOM-${0##*/}"
    printf '%s\0' "${0##*/}" "$@" > "$file"
}
'''

STUBS = {
    # srun: drop its own options, run the step's command once (one task stands for all).
    "srun": 'record "$@"\nwhile [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
    # singularity/apptainer exec [options] -- IMAGE COMMAND...: run COMMAND.
    "singularity": CONTAINER,
    "apptainer": CONTAINER,
    # nsys profile --opt=... COMMAND...: run COMMAND.
    "nsys": 'record "$@"\nshift\nwhile [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
    # scontrol -o show node NAME: one line, NodeAddr=$STUB_NODE_ADDR (10.0.0.1); an empty one: node not found.
    "scontrol": ('record "$@"\n'
                 'if [ "$1 $2" = "show hostnames" ]; then printf "node1\\nnode2\\n"; exit 0; fi\n'
                 'if [ "$1 $2 $3" = "-o show node" ]; then\n'
                 '    addr="${STUB_NODE_ADDR-10.0.0.1}"\n'
                 '    if [ -z "$addr" ]; then echo "Node $4 not found" >&2; exit 1; fi\n'
                 '    printf "NodeName=%s Arch=x86_64 CPUTot=4 Gres=gpu:4 NodeAddr=%s NodeHostName=%s Version=22.05.8\\n" \\\n'
                 '        "$4" "$addr" "$4"\n'
                 '    exit 0\n'
                 'fi\n'
                 'if [ "$1" = requeue ]; then exit "${STUB_REQUEUE_RC:-0}"; fi\n'),
    "python3": ('if [ "${1:-} ${2:-}" = "-m hpctrain.rundir.restart" ]; then exec "$STUB_REAL_PYTHON" "$@"; fi\n'
                'record "$@"\n'
                # Wait (5 s at most) until the background monitors named in STUB_WAIT_FOR have run, so the
                # script's exit path, which stops them, does not race with their start.
                'for program in ${STUB_WAIT_FOR:-}; do\n'
                '    for _ in $(seq 250); do\n'
                '        if ls "$STUB_LOG/calls" | grep -q -- "-$program\\$"; then break; fi\n'
                '        /usr/bin/sleep 0.02\n'
                '    done\n'
                'done\n'
                'env -0 > "$STUB_LOG/runtime-env"\n'
                'if [ "${STUB_REQUEST_REQUEUE:-0}" = 1 ]; then\n'
                '    printf "signal USR2 at step 7: checkpoint saved\\n" > "$HPCTRAIN_REQUEUE_MARKER"\n'
                'fi\n'
                'if [ -n "${STUB_BAD_INPUT:-}" ]; then printf "rank 3: %s\\n" "$STUB_BAD_INPUT" >> "$HPCTRAIN_BAD_INPUT_MARKER"; fi\n'
                'exit "${STUB_RANK_RC:-0}"\n'),
    "pgrep": 'record "$@"\necho 12345\n',
    "pwned": 'record "$@"\ntouch "$STUB_LOG/PWNED"\n',
}
PLAIN_RECORDERS = ("sbatch", "nvidia-smi", "py-spy", "sleep", "user-setup")


def make_stub_dir(root: Path) -> Path:
    """A folder of executable stubs (created once per test session)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = dict(STUBS, **{name: 'record "$@"\n' for name in PLAIN_RECORDERS})
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + RECORD + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


@dataclass
class Run:
    """What one execution of a script left: exit status, output, the recorded calls, the runtime's env."""

    returncode: int
    stdout: bytes
    stderr: bytes
    calls: list[list[str]] = field(default_factory=list)  # [program, arg1, ...] in no particular order
    runtime_env: dict[str, str] = field(default_factory=dict)
    log: Path = Path()

    def argv_of(self, program: str) -> list[list[str]]:
        return [call[1:] for call in self.calls if call[0] == program]

    @property
    def programs(self) -> list[str]:
        return sorted(call[0] for call in self.calls)


def _read_calls(log: Path) -> list[list[str]]:
    calls = []
    for path in sorted((log / "calls").iterdir()):
        parts = path.read_bytes().split(b"\0")
        calls.append([os.fsdecode(p) for p in parts[:-1]])
    return calls


def run_script(script: str, *, bin_dir: Path, work: Path, env: Optional[dict[str, str]] = None,
               timeout_s: float = 30.0) -> Run:
    """Execute `script` with bash in `work`, stubs first on PATH, Slurm's batch variables set."""
    log = work / "stub-log"
    (log / "calls").mkdir(parents=True, exist_ok=True)
    path = work / "job.sbatch"
    path.write_bytes(script.encode())
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "STUB_LOG": str(log),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_ON_NODE": "16",
            "STUB_REAL_PYTHON": sys.executable}
    result = subprocess.run(["bash", str(path)], cwd=work, env={**base, **(env or {})}, capture_output=True,
                            timeout=timeout_s, check=False)
    runtime_env: dict[str, str] = {}
    env_file = log / "runtime-env"
    if env_file.exists():
        for item in env_file.read_bytes().split(b"\0"):
            if b"=" in item:
                key, _, value = item.partition(b"=")
                runtime_env[os.fsdecode(key)] = os.fsdecode(value)
    return Run(result.returncode, result.stdout, result.stderr, _read_calls(log), runtime_env, log)
