"""A large layout search split over processes, with the result of one process.

The search's (tp, pp, cp) triples (search.family_triples) go into a queue, the heaviest first (`work`); this
process and its forked children (`os.fork`: they inherit the model, the hardware and the memo, and pay no
interpreter start or import) each take the next triple when done with one, search it with rejections of its own,
and the children send back their layouts as plain values. Merged in the search's order, they are what one process
searching the triples in order finds: the layouts in the same order, the rejection counts, the examples (the
first few of each reason, in search order) and each family's reason or closest miss (`Rejections.extend`). The
triples of a child that fails are searched here instead.

Only where it pays and is safe: on Linux (fork), with more than one CPU for this process, in a process with no
other thread, for searches whose estimated candidates (`work`) exceed MIN_SPLIT_CANDIDATES (a child costs ~5 ms
to fork, and each layout it sends ~10 us to send and rebuild). The Qwen3-235B 32K case of bench/plan_speed.py
(~41,000 candidates) on 2 CPUs: 0.83 s for the whole `hpctrain plan` against 1.08 s with --workers 1.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any

from hpctrain.plan.cost_setup import StepCost
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.memory import MemoryProbe
from hpctrain.plan.rank_setup import RankSetup
from hpctrain.config.plugins_off import collector_paused
from hpctrain.plan.search import (
    FamilyOpen,
    Layout,
    SearchSettings,
    SetAside,
    StageCache,
    Triple,
    family_check,
    family_triples,
    frozen_with,
    prefer_selective,
    ranked,
    search,
    search_part,
)
from hpctrain.plan.space import Choices, Rejections

# Estimated candidates (`work`) below which one process searches alone: the Qwen3-235B 4K case of
# bench/plan_speed.py (~0.12 s of search) stays whole, its 32K case (~0.9 s) splits.
MIN_SPLIT_CANDIDATES = 20_000


def search_workers() -> int:
    """The processes a search may use: the CPUs this process may run on (its affinity), where fork exists; else 1."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return 1
    return max(1, len(os.sched_getaffinity(0)))


def work(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, triple: Triple) -> int:
    """The candidates a triple's families would evaluate, from the structural checks alone (0 when they reject it):
    the split's measure of work."""
    checked = family_check(model, hw, choices, settings, triple)
    if not isinstance(checked, FamilyOpen):
        return 0
    pp = triple[1]
    per_schedule = (len(choices.micro_batches(settings.global_batch // checked.dp)) * len(choices.ac)
                    * len(choices.zeros(checked.dp, pp)) * len(choices.offload))
    return len(checked.eps) * len(choices.schedules(pp, model.layers)) * per_schedule


def search_with_workers(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings,
                        workers: int) -> tuple[list[Layout], Rejections, int]:
    """search.search's result, the search split over up to `workers` processes where that pays and is safe (the
    module docstring), else in this one."""
    triples = family_triples(choices)
    if workers <= 1 or threading.active_count() > 1 or len(triples) * _TOKEN > _QUEUE_BYTES:
        # (a process with other threads is not forked: a child could inherit a lock one of them holds)
        return search(model, hw, choices, settings)
    weights = [work(model, hw, choices, settings, triple) for triple in triples]
    if sum(weights) <= MIN_SPLIT_CANDIDATES:
        return search(model, hw, choices, settings)
    with collector_paused():  # as search.search (config/plugins_off.py)
        found, rejected, evaluated = split_search(model, hw, choices, settings, triples, weights, workers)
        return ranked(prefer_selective(found, rejected)), rejected, evaluated


def split_search(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, triples: list[Triple],
                 weights: list[int], workers: int) -> tuple[list[Layout | SetAside], Rejections, int]:
    """search.search_part over `triples` (each of estimated `weights`), split over `workers` processes: the layouts
    found and set aside in the search's order, the rejections and the candidates evaluated."""
    stages = StageCache(model, settings.stage_split)
    # The triples as a queue of indices, the heaviest first (each process takes the next when done with one, so the
    # work evens out); every process searches each of its triples with rejections of their own.
    read, write = os.pipe()
    order = sorted(range(len(triples)), key=lambda i: -weights[i])
    os.write(write, b"".join(index.to_bytes(_TOKEN, "little") for index in order))
    os.close(write)
    children = [_fork_child(model, hw, choices, settings, triples, stages, read) for _ in range(workers - 1)]
    mine = _search_queue(model, hw, choices, settings, triples, stages, read)
    os.close(read)
    results: dict[int, tuple[list[Layout | SetAside], Rejections, int]] = dict(mine)
    for child in children:
        sent = _collect(child)
        for index, (rows, its_rejections, its_evaluated) in (sent or {}).items():
            results[index] = ([_restored(model, stages, row) for row in rows], its_rejections, its_evaluated)
    found, rejected, evaluated = [], Rejections(), 0
    for index, triple in enumerate(triples):  # in the search's order; a failed child's triples searched here
        part = results.get(index)
        if part is None:
            part_found: list[Layout | SetAside] = []
            part_rejected = Rejections()
            part = (part_found, part_rejected,
                    search_part(model, hw, choices, settings, [triple], stages, part_found, part_rejected))
        found.extend(part[0])
        rejected.extend(part[1])
        evaluated += part[2]
    return found, rejected, evaluated


_TOKEN = 4  # bytes of one triple index in the queue (a pipe's reads of whole tokens are atomic)
_QUEUE_BYTES = 65536  # Linux's default pipe capacity (pipe(7)): the whole queue is written before any process reads


def _search_queue(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, triples: list[Triple],
                  stages: StageCache, queue: int) -> dict[int, tuple[list[Layout | SetAside], Rejections, int]]:
    """Search triples taken from the queue until it is empty: per triple index, its layouts, rejections and count."""
    out: dict[int, tuple[list[Layout | SetAside], Rejections, int]] = {}
    while True:
        token = os.read(queue, _TOKEN)
        if len(token) < _TOKEN:
            return out
        index = int.from_bytes(token, "little")
        found: list[Layout | SetAside] = []
        rejected = Rejections()
        out[index] = (found, rejected, search_part(model, hw, choices, settings, [triples[index]], stages, found,
                                                   rejected))


def _fork_child(model: Any, hw: Hardware, choices: Choices, settings: SearchSettings, triples: list[Triple],
                stages: StageCache, queue: int) -> tuple[int, int] | None:
    """(pid, read end of its pipe) of a child searching triples from the queue; None where fork fails."""
    try:
        read, write = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid:
        os.close(write)
        return pid, read
    status = 1
    try:  # the child: search, send, and leave without running the parent's exit handlers or flushing its buffers
        os.close(read)
        done = _search_queue(model, hw, choices, settings, triples, stages, queue)
        sent = {index: ([_row(lay) for lay in found], rejected, evaluated)
                for index, (found, rejected, evaluated) in done.items()}
        with os.fdopen(write, "wb") as out:
            pickle.dump(sent, out, protocol=pickle.HIGHEST_PROTOCOL)
        status = 0
    finally:
        os._exit(status)


def _collect(child: tuple[int, int] | None) -> dict[int, tuple[list[Any], Rejections, int]] | None:
    """What a child sent, once it exited cleanly; None when it did not (or never started)."""
    if child is None:
        return None
    pid, read = child
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        return None
    sent: dict[int, tuple[list[Any], Rejections, int]] = pickle.loads(data)
    return sent


def _row(lay: Layout | SetAside) -> tuple[Any, ...]:
    """A layout as plain values: its fields, its setup's, its cost's and its rank totals (its breakdown is built
    again where read, from the same setup)."""
    if isinstance(lay, SetAside):
        return ("set aside", lay.label, lay.family)
    probe = lay.probe
    return ("layout", lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.schedule, lay.virtual_stages, lay.ac, lay.zero,
            lay.offload_optimizer, lay.sequence_parallel, lay.stage_imbalance, lay.cp, lay.ep, vars(probe.setup),
            tuple(lay.cost), probe.rank_totals())


def _restored(model: Any, stages: StageCache, row: tuple[Any, ...]) -> Layout | SetAside:
    if row[0] == "set aside":
        return SetAside(row[1], row[2])
    (_, tp, pp, dp, mb, schedule, v, ac, zero, offload, sp, imbalance, cp, ep, setup_fields, cost_values,
     totals) = row
    stage_layers = stages.split(pp, v)[0]
    probe = MemoryProbe.with_totals(model, stage_layers, frozen_with(RankSetup, setup_fields), stages.memory, totals)
    return Layout(tp, pp, dp, mb, schedule, v, ac, zero, offload, sp, tuple(stage_layers), imbalance, probe,
                  StepCost(*cost_values), cp, ep)
