"""Slot <-> global rank and the log names (hpctrain/rundir/ranks.py), and `logs --rank` for a rank that
died before it knew its rank (issue 11 item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.errors import ConfigError
from hpctrain.launch.logs import pick_logs
from hpctrain.rundir.ranks import check_rank_order, global_rank, next_attempt, slot_of

ORDER = [0, 2, 1, 3]  # plan.placement.rank_order(tp=1, pp=2, dp=2, gpus_per_node=4)


@pytest.mark.parametrize(("order", "slots"), [(ORDER, [0, 2, 1, 3]), (None, [0, 1, 2, 3]),
                                              ([0, 1, 4, 5, 2, 3, 6, 7], [0, 1, 4, 5, 2, 3, 6, 7])])
def test_slot_and_rank_are_inverse(order: list[int] | None, slots: list[int]) -> None:
    n = len(slots)
    assert [global_rank(s, order) for s in range(n)] == (order or list(range(n)))
    assert all(global_rank(slot_of(r, order), order) == r for r in range(n))


def test_rank_order_checks() -> None:
    check_rank_order(ORDER, 4, 2)
    with pytest.raises(ConfigError, match="not a permutation of the 4 ranks"):
        check_rank_order([0, 1, 1, 3], 4, 2)
    with pytest.raises(ConfigError, match="rank 0 must run on the first node"):
        check_rank_order([1, 2, 0, 3], 4, 2)


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "job.resolved.yaml").write_text(f"placement:\n  rank_order: {ORDER}\n")
    (run / "logs" / "rank-0.attempt-0.log").write_text("rank 0 of 4 (slot 0)\n")
    for slot in range(4):
        (run / "logs" / f"task-{slot}.attempt-0.log").write_text(f"caught from slot {slot}\n")
    return run


def test_logs_of_a_rank_without_its_own_file_come_from_its_slot(tmp_path: Path) -> None:
    run = _run(tmp_path)
    [own], note = pick_logs(run, rank=0)
    assert own.path.name == "rank-0.attempt-0.log" and note == ""
    [caught], note = pick_logs(run, rank=1)  # rank 1 runs in slot 2
    assert caught.path.name == "task-2.attempt-0.log" and "slot 2" in note
    with pytest.raises(ConfigError, match="--rank: no log for rank 7"):
        pick_logs(run, rank=7)
    assert next_attempt(run / "logs") == 1
