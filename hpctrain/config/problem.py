"""One thing wrong with a job, as the cross-field checks (job.py, kubernetes_checks.py) report it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job: where, what, the value received and how to fix it."""

    path: str
    message: str
    got: Any
    fix: str
