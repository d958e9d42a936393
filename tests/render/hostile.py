"""Hostile strings for every free-text field, and a job that carries one in all of them at once.

Each string that could run something tries to run `pwned` (a stub that must never be called).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

HOSTILE = [
    "$(pwned)",                                  # command substitution
    "`pwned`",                                   # backticks
    "; pwned",                                   # command separator
    "x && pwned",                                # and-list
    "x || pwned",                                # or-list
    "| pwned",                                   # pipe
    "x\npwned\n",                                # newline
    "x\r\npwned",                                # CR LF
    "'; pwned; '",                               # break out of single quotes
    '"; pwned; "',                               # break out of double quotes
    "\"$(pwned)\"'`pwned`'",                     # both quote kinds around substitutions
    "'",                                         # a lone single quote
    '"',                                         # a lone double quote
    "$HOME ${PATH} $1 $@ $$",                    # variables
    "*",                                         # glob
    "?[a-z]*{a,b}~root",                         # glob, brace expansion, tilde
    "-rf",                                       # leading dash
    "--help",                                    # a long option
    "ünïcødé ☃ 中文 \u200b\u202e",                # unicode, zero-width space, right-to-left override
    "back\\slash\\n\\",                          # backslashes
    "$'\\x70wned'",                              # ANSI-C quoting
    "!pwned !!",                                 # history expansion
    "> out.txt < /etc/passwd 2>&1",              # redirections
    "<(pwned) >(pwned)",                         # process substitution
    "$((6*7)) $[1+1]",                           # arithmetic
    "#not-a-comment",                            # comment character
    "  leading and trailing spaces  ",           # whitespace
    "tab\there",                                 # tab
    "%j %A_%a %x %% 100%",                       # Slurm filename patterns
    "x hetjob y packjob",                        # sbatch's heterogeneous-job separator words
    "a=b c=d IFS=x",                             # assignments
    "\x7f\x1b[31mred",                           # DEL and an escape sequence
    ("pwned$(pwned)`pwned`;" * 200)[:4000],      # very long
]

# Fields that reach a #SBATCH line cannot carry control characters; singularity --bind cannot carry ','.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def sbatch_safe(value: str) -> bool:
    return not CONTROL.search(value)


def tame(value: str) -> str:
    """`value` without what the #SBATCH line refuses (control characters; backslash in paths)."""
    return CONTROL.sub("_", value).replace("\\", "_")


def hostile_run_dir(root: Path, value: str) -> str:
    """A run directory under root whose last components spell `value` (tamed, cut into <= 200-byte parts).

    At most 1500 characters of `value`, so that files in it stay under PATH_MAX (4096 bytes).
    """
    text = tame(value).replace("/", "_")[:1500]
    parts, current = [], ""
    for ch in text:
        if len((current + ch).encode()) > 200:
            parts.append(current)
            current = ""
        current += ch
    parts.append(current)
    parts = ["_" + p if p in (".", "..") else p for p in parts]
    return str(root / "runs" / "/".join(parts))


BASE_JOB: dict[str, Any] = {
    "name": "x",
    "model": {"preset": "tiny"},
    "train": {"global_batch": 8, "micro_batch": 2, "steps": 10},
    "parallel": {"tp": 1, "pp": 1, "dp": 4},
    "cluster": {"executor": "slurm", "nodes": 2, "gpus_per_node": 2, "gpu": "a100-80gb", "fabric": "ib-hdr200"},
    "slurm": {"time": "01:00:00", "setup": ["user-setup 'arg one'"]},
    "monitor": {"nvidia_smi": True, "py_spy": True, "py_spy_seconds_before_limit": 60, "nsys": True},
    "runtime": {"python": "python3"},  # the stub python3 on the stubs' PATH plays the runtime (stubs.py)
}


def hostile_job(value: str, *, cover: str) -> dict[str, Any]:
    """BASE_JOB with `value` in every free-text field (setup lines excepted: they are shell by design).

    `cover` is a folder bound into the container that holds the run directory, so the run directory
    itself need not be a --bind value.
    """
    job = copy.deepcopy(BASE_JOB)
    job.update(name=value, runs_dir=value)
    job["train"]["data"] = value
    job["checkpoint"] = {"dir": value}
    job["nccl"] = {"socket_ifname": value, "ib_hca": value, "env": {"NCCL_HPCT_TEST_ENV": value, "NCCL_ALGO": value}}
    if sbatch_safe(value):
        job["slurm"]["extra"] = {"comment": value}
    binds = [value] if "," not in value else []
    job["container"] = {"image": value + ".sif", "binds": binds + [cover],
                        "recipe": {"pip": [value]}}
    return job
