"""Odd-even windows: improve a large schedule block by block with CP-SAT.

The tasks of the current schedule, sorted by start time, are cut into blocks of
``block_size``; each block is solved alone (dependencies leaving it dropped; its
tasks get release times from the ends of outside predecessors and each stream is
free from the end of the last outside task before the block on it), warm-started
from the current times. A block's new times are spliced in *locally*: only the span of
events from the block's first RUN/START to its last one is re-decoded
(``decode_window``), and the timeline is re-simulated from that span on, starting from
the recorded state there and stopping as soon as the state (compute clock, stream free
times, moved task ends still to be read) matches the old run again
(``IncrementalTimeline``). The splice is kept only if the whole graph's exact
makespan does not get worse (and, with a memory limit, its ``peak_memory`` stays
within it), so the result is never slower than the start. This makes a block cost
O(block + the events it actually moves) instead of a full O(n) decode + simulate,
so on 20k+ task graphs the CP-SAT solves, not the bookkeeping, bound the throughput.
Each round shifts the blocks by ``block_size // 2``; the search stops after ``rounds``
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

from concerto_jax.scheduler.checker import peak_memory
from concerto_jax.scheduler.decode import decode_window
from concerto_jax.scheduler.program_model import solve_program
from concerto_jax.scheduler.progress import Progress
from concerto_jax.scheduler.rcpsp import SchedulerError, SolverParams
from concerto_jax.simulator.timeline import IncrementalTimeline
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
    progress: bool = True  # throttled INFO lines (block, best makespan, elapsed) while it runs


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
    inc = IncrementalTimeline(graph, events)
    initial = best = inc.makespan
    solved = skipped = accepted = 0
    idle_rounds = 0
    rounds_run = 0
    block_cost = 0.0  # wall time of the costliest block so far (budget estimate)
    stream_of = np.fromiter((t.stream for t in graph.tasks), dtype=np.int64, count=len(graph))
    mem = options.memory_limit_bytes
    window_sizes: list[int] = []
    progress = Progress(logger, "odd-even", enabled=options.progress)
    for rnd in range(options.rounds):
        if _over_budget(options, t0):
            break
        rounds_run += 1
        round_start = best
        offset = 0 if rnd % 2 == 0 else b // 2
        order = _order(inc)
        order_np = np.asarray(order, dtype=np.int64)
        streams_by_pos = stream_of[order_np] if len(order) else order_np
        tb = None
        bounds = ([0] if offset else []) + list(range(offset, len(order), b)) + [len(order)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            now = time.perf_counter()
            if tb is not None:
                block_cost = max(block_cost, now - tb)  # the previous block's wall time
            tb = now
            if _over_budget(options, t0, block_cost):
                break
            progress.update(round=rnd, block=f"{lo // b + 1}/{len(bounds) - 1}",
                            best_makespan_us=best, accepted=accepted)
            block = order[lo:hi]
            if len(block) < 2:
                continue
            bset = set(block)
            end = inc.end
            release = {i: max((end[p] for p in graph.preds[i] if p not in bset), default=0.0)
                       for i in block}
            free = _prefix_free(end, order_np[:lo], streams_by_pos[:lo],
                                {graph.tasks[i].stream for i in block})
            local = max(end[i] for i in block)
            if local <= _local_bound(graph, block, bset, release, free) + 1e-9:
                skipped += 1
                continue
            try:
                sol = solve_program(graph, params, tasks=block, release_us=release,
                                    stream_free_us=free, hint_start_us=inc.start,
                                    horizon_us=local, memory_limit_bytes=mem)
            except SchedulerError as err:
                logger.debug("block at %d: %s", lo, err)
                continue
            solved += 1
            if sol.makespan_us >= local - 1e-9:
                continue
            # Splice: re-decode only the span of events from the block's first RUN/START to
            # its last one (a DONE after that span stays where it is: its consumers come
            # after it, so the order stays valid).
            p = min(inc.first_pos[i] for i in block)
            q = max(inc.first_pos[i] for i in block) + 1
            window_sizes.append(q - p)
            window = inc.events[p:q]
            new_start = list(inc.start)
            new_end = list(inc.end)
            for i, st in zip(sol.tasks, sol.start_us, strict=False):
                new_start[i] = st
                new_end[i] = st + graph.tasks[i].duration_us
            new = decode_window(graph, window, new_start, new_end)
            if new == window:
                continue
            snapshot = None
            if mem is not None:
                snapshot = (list(inc.events), inc.start, inc.end, inc.clock, inc.makespan,
                            list(inc.first_pos), list(inc.last_pos), list(inc.last_use))
            if inc.try_window(p, q, new, best + 1e-9):
                if mem is not None and peak_memory(graph, inc.start, inc.end) > mem:
                    _restore(inc, snapshot)  # the splice broke the memory limit: undo it
                    continue
                accepted += 1
                best = inc.makespan
        logger.info("odd-even round %d (offset %d): makespan %.1f -> %.1f µs, %d solved, "
                    "%d skipped, %d accepted, %.1fs", rnd, offset, round_start, best, solved,
                    skipped, accepted, time.perf_counter() - t0)
        if window_sizes:
            logger.debug("odd-even window sizes (events): median %d, max %d",
                         sorted(window_sizes)[len(window_sizes) // 2], max(window_sizes))
        idle_rounds = idle_rounds + 1 if best >= round_start - 1e-9 else 0
        if idle_rounds >= 2:
            break
    return OddEvenResult(tuple(inc.events), best, initial, rounds_run, solved, skipped, accepted,
                         time.perf_counter() - t0)


def _restore(inc: IncrementalTimeline, snapshot) -> None:
    (inc.events, inc.start, inc.end, inc.clock, inc.makespan, inc.first_pos, inc.last_pos,
     inc.last_use) = snapshot


def _over_budget(options: OddEvenOptions, t0: float, last_cost: float = 0.0) -> bool:
    """Whether another block (estimated to cost ``last_cost`` s) would overrun the budget."""
    return (options.time_budget_s is not None
            and time.perf_counter() - t0 + last_cost > options.time_budget_s)


def _order(inc: IncrementalTimeline) -> list[int]:
    """Tasks sorted by start time, ties by position of their first event."""
    start, first = inc.start, inc.first_pos
    return sorted(range(len(start)), key=lambda i: (start[i], first[i]))


def _prefix_free(end: Sequence[float], before: np.ndarray, streams_before: np.ndarray,
                 streams: set[int]) -> dict[int, float]:
    """Per stream in ``streams``, the latest end of a task on it among ``before``."""
    if not len(before):
        return {k: 0.0 for k in streams}
    ends = np.asarray(end, dtype=np.float64)[before]
    out = {}
    for k in streams:
        m = streams_before == k
        out[k] = float(ends[m].max()) if m.any() else 0.0
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
