"""What the doctor reports: a finding (severity, title, evidence, fixes) and the text/JSON forms of a list.

A fix is a set of `--set KEY=VALUE` lines the user pastes after `hpctrain resume RUN` or
`hpctrain submit job.yaml`; `predicted` says what the planner expects once it is applied (every
fix the doctor prints has been re-validated and re-planned, see `fixes.py`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}

GIB = 2**30


@dataclass(frozen=True)
class Fix:
    """One remedy: why it helps, the `--set` lines, and the planner's prediction with it applied."""

    why: str
    sets: tuple[str, ...] = ()
    predicted: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"why": self.why, "set": list(self.sets), "predicted": self.predicted}


@dataclass(frozen=True)
class Finding:
    """One problem: `family` is the rule that found it (oom, killed, comm, imbalance, bubble, mfu, throughput,
    hang, requeue, checkpoint)."""

    family: str
    severity: str
    title: str
    evidence: tuple[str, ...] = ()
    fixes: tuple[Fix, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "severity": self.severity, "title": self.title,
                "evidence": list(self.evidence), "fixes": [f.to_json() for f in self.fixes]}


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then notes; stable within a severity (rule order)."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 9))


def format_findings(findings: list[Finding], run_label: str) -> str:
    """The text `hpctrain doctor` prints."""
    if not findings:
        return f"{run_label}: no problems found"
    lines = [f"{run_label}: {len(findings)} finding(s)"]
    for finding in findings:
        lines.append("")
        lines.append(f"[{finding.severity}] {finding.title}")
        lines.extend(f"  - {item}" for item in finding.evidence)
        for fix in finding.fixes:
            sets = " ".join(f"--set {shlex.quote(s)}" for s in fix.sets)
            lines.append(f"  fix: {fix.why}" + (f"\n       {sets}" if sets else ""))
            if fix.predicted:
                lines.append(f"       planner: {fix.predicted}")
    return "\n".join(lines)


def gib(value_bytes: float) -> str:
    """`12.3 GiB` (for evidence lines)."""
    return f"{value_bytes / GIB:.2f} GiB"


def pct(share: float) -> str:
    return f"{100.0 * share:.0f} %"


def ranks_text(ranks: list[int], limit: int = 8) -> str:
    """`0, 1, 5` or `0, 1, ... (12 ranks)` for long lists."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown if len(ranks) <= limit else f"{shown}, ... ({len(ranks)} ranks)"
