"""The doctor flags a diverging training loss (issue 18, finding 8: a loss rising from 5.5 to 1292 went
unflagged), with the evidence and a lower learning rate; a spike that recovers is not flagged."""

from __future__ import annotations

import math

from hpctrain.diagnose.doctor import diagnose_run

from ._runs import gpu_job, healthy_telemetry, make_run, metrics_lines


def _with_losses(losses: list[float], grad_norms: list[float] | None = None) -> list[dict]:
    records = metrics_lines(len(losses), 2.2, mfu=0.45)
    for i, record in enumerate(records):
        record["loss"] = losses[i]
        if grad_norms is not None:
            record["grad_norm"] = grad_norms[i]
    return records


def _divergence(run_dir) -> list:
    return [f for f in diagnose_run(run_dir).findings if f.family == "divergence"]


def test_a_loss_rising_from_5_5_to_1292_is_an_error_with_a_lower_lr(tmp_path):
    # the recorded shape of the probe: down from 5.5 to ~4 by step 30, then up to 1292 by step 60
    losses = [5.5 - 1.5 * i / 29 for i in range(30)] + [4.0 * math.exp(i * math.log(1292 / 4.0) / 29) for i in range(30)]
    grads = [1.0] * 30 + [1.0 * 1.3 ** i for i in range(30)]
    run = make_run(tmp_path, gpu_job(), metrics=_with_losses(losses, grads), ranks=healthy_telemetry()[1])
    [finding] = _divergence(run)
    assert finding.severity == "error" and "diverged after step 30" in finding.title and "1292" in finding.title
    assert "above its first 5.5 at step 1" in finding.evidence[0]
    assert any("gradient norm" in line for line in finding.evidence)
    sets = [s for fix in finding.fixes for s in fix.sets]
    assert "train.optimizer.lr=0.00015" in sets  # half of the job's 3e-4, validated against the job


def test_a_non_finite_training_loss_is_an_error(tmp_path):
    losses = [5.0, 4.8, 4.7, float("nan"), float("nan")]
    run = make_run(tmp_path, gpu_job(), metrics=_with_losses(losses), ranks=healthy_telemetry()[1])
    [finding] = _divergence(run)
    assert finding.title == "training loss is nan at step 4" and "last finite loss 4.7 at step 3" in finding.evidence


def test_a_spike_that_recovers_and_a_healthy_run_are_not_flagged(tmp_path):
    losses = [5.5, 5.0, 4.6, 4.3, 40.0, 4.2, 4.1, 4.0, 3.9]
    spike = make_run(tmp_path, gpu_job(), metrics=_with_losses(losses), ranks=healthy_telemetry()[1], name="spike")
    assert _divergence(spike) == []
    metrics, ranks = healthy_telemetry()
    healthy = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, name="healthy")
    assert _divergence(healthy) == []


def test_a_loss_never_finite_on_loaded_weights_blames_the_weights(tmp_path):
    """Issue 30 Why 9: NaN weights from model.init_from got "halve the peak learning rate"."""
    from ._runs import event

    events = [event("started", 1.0, attempt=0, hosts=["node1"]),
              event("weights loaded", 2.0, attempt=0, path="/models/llama", bytes_read=10, seconds=0.1),
              event("finished", 3600.0, attempt=0, step=5)]
    losses = [float("nan")] * 5
    run = make_run(tmp_path, gpu_job(), metrics=_with_losses(losses), ranks=healthy_telemetry()[1], events=events)
    [finding] = _divergence(run)
    assert finding.title == "training loss is nan from step 1: the loaded weights are not finite"
    assert not any("learning rate" in fix.why for fix in finding.fixes)
    assert [fix.why for fix in finding.fixes] == ["check the weights in model.init_from (re-download or re-save "
                                                  "the folder), then start again"]
