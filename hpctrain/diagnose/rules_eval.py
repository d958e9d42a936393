"""The loss: the training loss diverging or not finite, the validation loss (train.eval_every) not
finite or rising away from its best.

Training divergence: the median of the last `RECENT` logged losses is more than `DIVERGED` times the
best loss so far AND above the first logged loss. A spike that recovers leaves the median low; a run
whose loss ends above where it started (5.5 -> 1292) has lost what it learned. The usual cause is a
learning rate too high for the batch or for the warm-up, so the fixes lower it or warm up longer.

A validation loss that has risen on each of the last `RISING` evaluations and now lies more than
`thresholds.val_divergence` above its best means the run is getting worse on held-out data: with the
training loss still falling the model overfits (more data, or stop at the best step); with the
training loss rising too the optimisation diverges (a lower learning rate or more warm-up).
"""

from __future__ import annotations

import math

from hpctrain.diagnose.context import Context
from hpctrain.diagnose.findings import ERROR, WARNING, Finding, Fix
from hpctrain.diagnose.fixes import validated
from hpctrain.rundir.events import WEIGHTS_LOADED

RISING = 2  # consecutive rises before it counts as a trend, not noise
RECENT = 3  # logged training losses whose median is "where the loss is now" (one spike is not a trend)
DIVERGED = 2.0  # that median above DIVERGED x the best loss (and above the first) is a divergence


def _series(ctx: Context, key: str) -> list[tuple[int, float]]:
    return [(int(m["step"]), float(m[key])) for m in ctx.run.metrics
            if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]


def _lr_fixes(ctx: Context) -> list[Fix]:
    train = ctx.section("train")
    optimizer = train.get("optimizer")
    optimizer = optimizer if isinstance(optimizer, dict) else {}
    lr = optimizer.get("lr", 3e-4)
    steps = int(train.get("steps") or 100)
    schedule = train.get("lr_schedule")
    schedule = schedule if isinstance(schedule, dict) else {}
    warmup = int(schedule.get("warmup_steps") or 0)
    fixes = [validated("halve the peak learning rate", [f"train.optimizer.lr={float(lr) / 2:g}"], ctx.run.job_data)]
    longer = min(steps - 1, max(2 * warmup, steps // 20))
    if longer > warmup:
        fixes.append(validated("warm up for longer", [f"train.lr_schedule.warmup_steps={longer}"], ctx.run.job_data))
    return [f for f in fixes if f is not None]


def validation_rule(ctx: Context) -> list[Finding]:
    """Validation loss not finite, or diverging from its best value."""
    val = _series(ctx, "val_loss")
    if not val:
        return []
    bad = [(s, v) for s, v in val if not math.isfinite(v)]
    if bad:
        return [Finding("validation", ERROR, f"validation loss is {bad[0][1]} at step {bad[0][0]}",
                        (f"{len(bad)} of {len(val)} evaluation(s) not finite",), tuple(_lr_fixes(ctx)))]
    if len(val) < RISING + 1:
        return []
    best_step, best = min(val, key=lambda item: item[1])
    last_step, last = val[-1]
    tail = [v for _, v in val[-(RISING + 1):]]
    rising = all(b > a for a, b in zip(tail, tail[1:]))
    limit = ctx.thresholds.val_divergence
    if not rising or best <= 0 or (last - best) / best <= limit:
        return []
    train = [(s, v) for s, v in _series(ctx, "loss") if math.isfinite(v)]
    at_best = [v for s, v in train if s <= best_step]
    train_rising = bool(train and at_best) and train[-1][1] > at_best[-1] * (1 + limit)
    evidence = (f"validation loss {last:.4f} at step {last_step}, {100 * (last - best) / best:.0f} % above its best "
                f"{best:.4f} at step {best_step} (limit {100 * limit:.0f} %), rising at each of the last {RISING} "
                "evaluations",
                "the training loss rises too: the optimisation diverges" if train_rising else
                "the training loss still falls: the model overfits the training data")
    fixes = _lr_fixes(ctx) if train_rising else [
        Fix(f"keep the checkpoint nearest step {best_step} (the best validation loss), or train on more data")]
    return [Finding("validation", WARNING, f"validation loss diverging since step {best_step}", evidence,
                    tuple(fixes))]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def training_divergence_rule(ctx: Context) -> list[Finding]:
    """The training loss not finite, or risen far above its best and above where it started."""
    series = _series(ctx, "loss")
    bad = [(s, v) for s, v in series if not math.isfinite(v)]
    if bad:
        finite = [(s, v) for s, v in series if math.isfinite(v) and s < bad[0][0]]
        evidence = [f"{len(bad)} of {len(series)} logged step(s) have a loss that is not finite"]
        if finite:
            evidence.append(f"last finite loss {finite[-1][1]:.4g} at step {finite[-1][0]}")
        loaded = ctx.run.events_named(WEIGHTS_LOADED)
        if not finite and loaded:  # not finite from the first logged step, on weights read from a folder
            evidence.append(f"the weights were loaded from {loaded[-1].get('path', 'model.init_from')} and the loss "
                            "was never finite: the weights are not finite (NaN or inf), not the learning rate")
            fix = Fix("check the weights in model.init_from (re-download or re-save the folder), then start again")
            return [Finding("divergence", ERROR, f"training loss is {bad[0][1]} from step {bad[0][0]}: the loaded "
                            "weights are not finite", tuple(evidence), (fix,))]
        return [Finding("divergence", ERROR, f"training loss is {bad[0][1]} at step {bad[0][0]}", tuple(evidence),
                        tuple(_lr_fixes(ctx)))]
    if len(series) < RECENT + 1:
        return []
    first_step, first = series[0]
    best_step, best = min(series, key=lambda item: item[1])
    now = _median([v for _, v in series[-RECENT:]])
    last_step, last = series[-1]
    if best <= 0 or now <= DIVERGED * best or now <= first:
        return []
    evidence = [f"training loss {last:.4g} at step {last_step} (median of the last {RECENT} logged: {now:.4g}), "
                f"{now / best:.0f}x its best {best:.4g} at step {best_step} and above its first {first:.4g} at "
                f"step {first_step}"]
    grad = [(s, v) for s, v in _series(ctx, "grad_norm") if math.isfinite(v)]
    at_best = [v for s, v in grad if s <= best_step]
    if grad and at_best and at_best[-1] > 0 and grad[-1][1] > 10 * at_best[-1]:
        evidence.append(f"gradient norm {grad[-1][1]:.3g} at step {grad[-1][0]}, {grad[-1][1] / at_best[-1]:.0f}x "
                        f"its value at step {best_step}: the updates grew until the optimisation left its basin")
    lrs = [(s, v) for s, v in _series(ctx, "lr") if s >= best_step]
    if lrs:
        evidence.append(f"learning rate {lrs[0][1]:.3g} at step {lrs[0][0]} (where the loss turned)")
    fixes = _lr_fixes(ctx) + [Fix(f"resume from the newest checkpoint before step {best_step} with the lower "
                                  "learning rate (`hpctrain resume RUN --set ...`), or start again")]
    return [Finding("divergence", ERROR, f"training loss diverged after step {best_step} "
                    f"({best:.4g} -> {last:.4g})", tuple(evidence), tuple(fixes))]
