"""Experiment trackers (monitor.tracker): TensorBoard, Weights & Biases, MLflow, fed by rank 0 with the
very records it appends to metrics.jsonl.

Restarts. A run resumes from its checkpoint at step R, so the steps after R that the previous attempt
had logged come again. metrics.jsonl is cut back to R (telemetry.py); the trackers follow the same
rule where their format allows it and otherwise never log a step twice:
- TensorBoard: the new writer gets `purge_step = R + 1`, and TensorBoard's readers drop the old
  attempt's events from that step on (the new values replace them, as in metrics.jsonl).
- W&B and MLflow keep one run across every requeue (its id is kept in <run dir>/trackers.json) and
  cannot rewrite their history: a step already logged is skipped (the first values of that step stay).
  trackers.json keeps the last step each one was given, written *before* the tracker sees the line, so
  a kill between the tracker's write and trackers.json's can never make the next attempt log that step
  again (issue 30: MLflow held a step twice). The cost of that order is on the other side: a kill after
  trackers.json and before the tracker's own write loses that one step from W&B. MLflow's store says
  what it holds, so a resumed MLflow tracker starts from the last step in its store and loses nothing.
W&B runs offline by default (`wandb sync <run dir>/wandb/offline-run-*` later). MLflow defaults to a
file store in <run dir>/mlruns. A tracker that fails while logging is switched off with one warning
on stderr: training never dies for its dashboard.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.rundir.safe_files import write_atomic

if TYPE_CHECKING:
    from hpctrain.config import Job

STATE_FILE = "trackers.json"
SKIPPED_FIELDS = ("step", "time")  # step is the x axis; wall time is not a metric


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in SKIPPED_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardTracker:
    name = "tensorboard"
    rewrites = True  # purge_step: a resumed run replaces the steps after its checkpoint

    def __init__(self, job: Job, run_dir: str, resumed_step: int, state: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"),
                                    purge_step=resumed_step + 1 if resumed_step > 0 else None)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a requeue may kill the process at any time: keep the file current

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"
    rewrites = False

    def __init__(self, job: Job, run_dir: str, resumed_step: int, state: dict[str, Any]) -> None:
        import wandb

        monitor = job.monitor
        if "wandb_id" not in state:
            state["wandb_id"] = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
        self.run = wandb.init(project=monitor.wandb_project or job.name, name=job.name, id=state["wandb_id"],
                              resume="allow", mode=monitor.wandb_mode,
                              dir=os.environ.get("WANDB_DIR") or run_dir,
                              config={"job": job.model_dump(mode="json", by_alias=True)})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MlflowTracker:
    name = "mlflow"
    rewrites = False

    def __init__(self, job: Job, run_dir: str, resumed_step: int, state: dict[str, Any]) -> None:
        uri = job.monitor.mlflow_tracking_uri or "file://" + os.path.join(os.path.abspath(run_dir), "mlruns")
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps the file store only on request; it is the store that needs no database or server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        if "mlflow_run_id" in state:
            self.run_id = state["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = job.monitor.mlflow_experiment or job.name
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=job.name).info.run_id
            state["mlflow_run_id"] = self.run_id

    def logged_through(self) -> int:
        """The last step the store holds for this run (0: none): what an earlier attempt really logged."""
        keys = self.client.get_run(self.run_id).data.metrics
        return max((m.step for key in keys for m in self.client.get_metric_history(self.run_id, key)), default=0)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in values.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The job's trackers on rank 0; nothing on the other ranks."""

    def __init__(self, job: Job, run_dir: str, rank: int, resumed_step: int) -> None:
        self.path = os.path.join(run_dir, STATE_FILE)
        self.active: list[Any] = []
        self.state: dict[str, Any] = {}
        if rank != 0 or not job.monitor.trackers:
            return
        self.state = self._read_state()
        self.state.setdefault("last_step", {})
        for name in job.monitor.trackers:
            try:
                self.active.append(KINDS[name](job, run_dir, resumed_step, self.state))
            except Exception as exc:  # noqa: BLE001 - a dashboard must not stop the training
                self._warn(name, "could not start", exc)
        for tracker in self.active:
            if hasattr(tracker, "logged_through"):  # the store knows better than trackers.json
                try:
                    self.state["last_step"][tracker.name] = int(tracker.logged_through())
                except Exception as exc:  # noqa: BLE001
                    self._warn(tracker.name, "could not read what it holds", exc)
                    self.active.remove(tracker)
        self._write_state()

    def _read_state(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                body = json.load(handle)
            return body if isinstance(body, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        write_atomic(self.path, json.dumps(self.state))  # never through a link planted at either name

    @staticmethod
    def _warn(name: str, what: str, exc: BaseException) -> None:
        print(f"hpctrain: monitor.tracker {name} {what} ({type(exc).__name__}: {str(exc)[:200]}); "
              "it is switched off for this attempt, training goes on", file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        step = int(record["step"])
        values = _numbers(record)
        last = self.state["last_step"]
        # logged by an earlier attempt: never twice
        due = [t for t in self.active if t.rewrites or step > int(last.get(t.name, 0))]
        before = {t.name: last.get(t.name, 0) for t in due}
        for tracker in due:
            last[tracker.name] = step
        self._write_state()  # before any tracker has the step: see the module's docstring
        failed = False
        for tracker in due:
            try:
                tracker.log(step, values)
            except Exception as exc:  # noqa: BLE001
                self._warn(tracker.name, "failed to log", exc)
                self.active.remove(tracker)
                last[tracker.name] = before[tracker.name]
                failed = True
        if failed:
            self._write_state()

    def close(self, finished: bool) -> None:
        for tracker in self.active:
            try:
                tracker.close(finished)
            except Exception as exc:  # noqa: BLE001
                self._warn(tracker.name, "failed to close", exc)
        self.active = []


def read_state(run_dir: str) -> Optional[dict[str, Any]]:
    """trackers.json of a run (run ids, last steps), for tests and tools."""
    try:
        with open(os.path.join(run_dir, STATE_FILE), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None
