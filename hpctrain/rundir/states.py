"""Which job states are still live: one list for status, resume, follow and the doctor."""

from __future__ import annotations

# Slurm's states of a job that has not ended yet (sacct / scontrol spelling); the local executor's
# submit/local.json uses PENDING and RUNNING from the same vocabulary.
LIVE_SLURM_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "PREEMPTED_HOLD",
})
