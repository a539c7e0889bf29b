"""Odd-even windows: improve a large schedule block by block with CP-SAT.

The tasks of the current schedule, sorted by start time, are cut into blocks of
``block_size``; each block is solved alone (dependencies leaving it dropped; its
tasks get release times from the ends of outside predecessors and each stream is
free from the end of the last outside task before the block on it), warm-started
from the current times. A block's new times are spliced into the current ones,
decoded into an event order and accepted only if the whole graph's evaluated
makespan does not get worse, so the result is never slower than the start. Each
round shifts the blocks by ``block_size // 2``; the search stops after ``rounds``
rounds, or when an odd round and the following even round gain nothing, or when
the wall budget is spent. With ``num_workers=1`` and a deterministic-time limit per
block the result is reproducible for a fixed seed (unless the wall budget cuts it).

References: Concerto (ASPLOS'25) §4.4 (odd-even scheduling of large graphs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from concerto_jax.scheduler.decode import decode
from concerto_jax.scheduler.evaluate import simulate
from concerto_jax.scheduler.program_model import solve_program
from concerto_jax.scheduler.rcpsp import SchedulerError, SolverParams
from concerto_jax.taskgraph import Event, TaskGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OddEvenOptions:
    """Parameters of the odd-even window search (defaults chosen in bench/scheduler_scaling.py)."""

    block_size: int = 128  # tasks per window (b); chosen in bench/results/scheduler_bk.md
    rounds: int = 4  # maximum number of rounds (k); blocks shift by b/2 each round
    block_deterministic_time: float = 0.05  # CP-SAT deterministic time per block
    block_time_limit_s: float = 2.0  # wall-clock safety limit per block
    seed: int = 0  # CP-SAT seed
    time_budget_s: float | None = 20.0  # no new block once it would likely end past this (s)
    memory_limit_bytes: int | None = None  # memory resource inside each block (None: off)


@dataclasses.dataclass(frozen=True)
class OddEvenResult:
    """Outcome of ``odd_even``.

    Attributes:
      events: the best schedule found (never slower than the input).
      makespan_us: its evaluated makespan.
      initial_makespan_us: the input's evaluated makespan.
      rounds: rounds run.
      blocks_solved: CP-SAT solves.
      blocks_skipped: blocks already at their local lower bound.
      blocks_accepted: improvements kept.
      wall_time_s: total time.
    """

    events: tuple[Event, ...]
    makespan_us: float
    initial_makespan_us: float
    rounds: int
    blocks_solved: int
    blocks_skipped: int
    blocks_accepted: int
    wall_time_s: float


def odd_even(graph: TaskGraph, events: Sequence[Event], options: OddEvenOptions = OddEvenOptions()) -> OddEvenResult:
    """Improve ``events`` with odd-even CP-SAT windows.

    Args:
      graph: the task graph.
      events: a valid schedule to start from.
      options: block size, rounds, limits, seed.

    Returns:
      The improved schedule and statistics.

    References: Concerto (ASPLOS'25) §4.4.
    """
    t0 = time.perf_counter()
    b = max(2, options.block_size)
    params = SolverParams(time_limit_s=options.block_time_limit_s, num_workers=1,
                          seed=options.seed, deterministic_time=options.block_deterministic_time)
    cur = list(events)
    tl = simulate(graph, cur)
    initial = best = tl.makespan
    solved = skipped = accepted = 0
    idle_rounds = 0
    rounds_run = 0
    block_cost = 0.0  # wall time of the costliest block so far (budget estimate)
    for rnd in range(options.rounds):
        if _over_budget(options, t0):
            break
        rounds_run += 1
        round_start = best
        offset = 0 if rnd % 2 == 0 else b // 2
        order = _order(graph, tl, cur)
        prefix_free = _prefix_free(graph, tl, order)
        tb = None
        bounds = ([0] if offset else []) + list(range(offset, len(order), b)) + [len(order)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            now = time.perf_counter()
            if tb is not None:
                block_cost = max(block_cost, now - tb)  # the previous block's wall time
            tb = now
            if _over_budget(options, t0, block_cost):
                break
            block = order[lo:hi]
            if len(block) < 2:
                continue
            bset = set(block)
            release = {i: max((tl.end[p] for p in graph.preds[i] if p not in bset), default=0.0)
                       for i in block}
            free = {k: float(arr[lo]) for k, arr in prefix_free.items()}
            local = max(tl.end[i] for i in block)
            if local <= _local_bound(graph, block, bset, release, free) + 1e-9:
                skipped += 1
                continue
            try:
                sol = solve_program(graph, params, tasks=block, release_us=release,
                                    stream_free_us=free, hint_start_us=tl.start, horizon_us=local,
                                    memory_limit_bytes=options.memory_limit_bytes)
            except SchedulerError as err:
                logger.debug("block at %d: %s", lo, err)
                continue
            solved += 1
            if sol.makespan_us >= local - 1e-9:
                continue
            start = list(tl.start)
            for i, s in zip(sol.tasks, sol.start_us, strict=False):
                start[i] = s
            cand = decode(graph, start)
            ctl = simulate(graph, cand)
            if ctl.makespan <= best + 1e-9:
                cur, tl = cand, ctl
                accepted += 1
                best = ctl.makespan
                order = _order(graph, tl, cur)
                prefix_free = _prefix_free(graph, tl, order)
        logger.info("odd-even round %d (offset %d): makespan %.1f -> %.1f µs, %d solved, "
                    "%d skipped, %d accepted, %.1fs", rnd, offset, round_start, best, solved,
                    skipped, accepted, time.perf_counter() - t0)
        idle_rounds = idle_rounds + 1 if best >= round_start - 1e-9 else 0
        if idle_rounds >= 2:
            break
    return OddEvenResult(tuple(cur), best, initial, rounds_run, solved, skipped, accepted,
                         time.perf_counter() - t0)


def _over_budget(options: OddEvenOptions, t0: float, last_cost: float = 0.0) -> bool:
    """Whether another block (estimated to cost ``last_cost`` s) would overrun the budget."""
    return (options.time_budget_s is not None
            and time.perf_counter() - t0 + last_cost > options.time_budget_s)


def _order(graph: TaskGraph, tl, events: Sequence[Event]) -> list[int]:
    """Tasks sorted by start time, ties by position of their first event."""
    first: dict[int, int] = {}
    for p, e in enumerate(events):
        first.setdefault(e.task, p)
    return sorted(range(len(graph)), key=lambda i: (tl.start[i], first[i]))


def _prefix_free(graph: TaskGraph, tl, order: list[int]) -> dict[int, np.ndarray]:
    """Per stream, ``arr[p]`` = latest end of a task on that stream among ``order[:p]``."""
    streams = np.fromiter((graph.tasks[i].stream for i in order), dtype=np.int64, count=len(order))
    ends = np.fromiter((tl.end[i] for i in order), dtype=np.float64, count=len(order))
    out = {}
    for k in np.unique(streams):
        e = np.where(streams == k, ends, 0.0)
        out[int(k)] = np.concatenate([[0.0], np.maximum.accumulate(e)])
    return out


def _local_bound(graph, block, bset, release, free) -> float:
    """Lower bound on the block's latest end: stream loads and release + in-block tail."""
    tasks = graph.tasks
    load: dict[int, float] = {}
    for i in block:
        k = tasks[i].stream
        load[k] = load.get(k, free.get(k, 0.0)) + tasks[i].duration_us
    tail: dict[int, float] = {}
    for i in reversed(block):  # block is in start order, which is topological
        tail[i] = tasks[i].duration_us + max((tail[s] for s in graph.succs[i] if s in bset),
                                             default=0.0)
    return max(list(load.values()) + [release[i] + tail[i] for i in block])
