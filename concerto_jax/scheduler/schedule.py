"""Top-level program scheduler: candidates (input, list heuristic, CP-SAT), then odd-even.

Pipeline for one ``TaskGraph``::

    input order (optional) ──┐
    list heuristic ──────────┼─> best evaluated ──> odd-even windows ──> result
    full CP-SAT (small graphs, warm-started from the heuristic) ──┘

Every candidate is an event order judged by ``evaluate`` (the execution semantics of
``concerto_jax.taskgraph``); the result is never slower than the input order.

References: Concerto (ASPLOS'25) §4.2-4.4.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from concerto_jax.scheduler.checker import peak_memory
from concerto_jax.scheduler.decode import decode
from concerto_jax.scheduler.evaluate import lower_bound, simulate
from concerto_jax.scheduler.heuristics import list_schedule
from concerto_jax.scheduler.oddeven import OddEvenOptions, odd_even
from concerto_jax.scheduler.program_model import solve_program
from concerto_jax.scheduler.rcpsp import SchedulerError, SolverParams
from concerto_jax.taskgraph import Event, TaskGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """How to schedule a task graph."""

    full_model_max_tasks: int = 400  # solve the whole graph with CP-SAT up to this size
    full_model_time_limit_s: float = 5.0  # wall limit of the whole-graph solve
    full_model_deterministic_time: float | None = 20.0  # its deterministic-time limit
    num_workers: int = 1  # CP-SAT workers for the whole-graph solve (1: reproducible)
    seed: int = 0  # CP-SAT seed
    memory_limit_bytes: int | None = None  # peak live bytes; None: memory not modelled
    odd_even: OddEvenOptions | None = OddEvenOptions()  # None: no window search


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """A schedule and how it was found.

    Attributes:
      events: the chosen event order (valid for the graph).
      makespan_us: its evaluated makespan.
      lower_bound_us: ``max(sum compute, sum comm per stream, critical path)``.
      input_makespan_us: the input order's makespan (``None`` without an input).
      source: which candidate won before odd-even (``input``, ``heuristic``, ``cp``).
      peak_memory_bytes: peak live bytes of the chosen schedule's timeline.
      wall_time_s: total time.
      stats: per-stage figures (makespans, times, block counts).
    """

    events: tuple[Event, ...]
    makespan_us: float
    lower_bound_us: float
    input_makespan_us: float | None
    source: str
    peak_memory_bytes: int
    wall_time_s: float
    stats: dict


def schedule(
    graph: TaskGraph,
    options: ScheduleOptions = ScheduleOptions(),
    initial: Sequence[Event] | None = None,
) -> ScheduleResult:
    """Order the events of ``graph`` to minimise the evaluated makespan.

    Args:
      graph: the task graph (validated here).
      options: scheduler options.
      initial: the current order (e.g. XLA's); the result is never slower than it.

    Returns:
      The best schedule found.

    References: Concerto (ASPLOS'25) §4.2-4.4.
    """
    t0 = time.perf_counter()
    graph.validate()
    stats: dict = {"tasks": len(graph)}
    cands: list[tuple[float, str, list[Event]]] = []
    input_makespan = None
    if initial is not None:
        initial = list(initial)
        graph.check_schedule(initial)
        input_makespan = simulate(graph, initial).makespan
        cands.append((input_makespan, "input", initial))
    th = time.perf_counter()
    heur = list_schedule(graph)
    htl = simulate(graph, heur)
    stats["heuristic_s"] = time.perf_counter() - th
    stats["heuristic_makespan_us"] = htl.makespan
    cands.append((htl.makespan, "heuristic", heur))
    lb = lower_bound(graph)
    if len(graph) <= options.full_model_max_tasks and htl.makespan > lb + 1e-9:
        params = SolverParams(time_limit_s=options.full_model_time_limit_s,
                              num_workers=options.num_workers, seed=options.seed,
                              deterministic_time=options.full_model_deterministic_time)
        try:
            sol = solve_program(graph, params, hint_start_us=htl.start, horizon_us=htl.makespan,
                                memory_limit_bytes=options.memory_limit_bytes)
            cp_events = decode(graph, sol.start_us)
            cp_makespan = simulate(graph, cp_events).makespan
            stats.update(cp_status=sol.status, cp_makespan_us=cp_makespan, cp_s=sol.wall_time_s)
            cands.append((cp_makespan, "cp", cp_events))
        except SchedulerError as err:
            logger.warning("whole-graph CP-SAT solve failed, keeping the heuristic: %s", err)
    order = {"input": 0, "cp": 1, "heuristic": 2}
    makespan, source, events = min(cands, key=lambda c: (c[0], order[c[1]]))
    if options.odd_even is not None and makespan > lb + 1e-9 and len(graph) > 2:
        oe_opts = options.odd_even
        if options.memory_limit_bytes is not None and oe_opts.memory_limit_bytes is None:
            oe_opts = dataclasses.replace(oe_opts, memory_limit_bytes=options.memory_limit_bytes)
        oe = odd_even(graph, events, oe_opts)
        stats.update(odd_even_rounds=oe.rounds, odd_even_solved=oe.blocks_solved,
                     odd_even_accepted=oe.blocks_accepted, odd_even_s=oe.wall_time_s)
        if oe.makespan_us < makespan:
            events, makespan = list(oe.events), oe.makespan_us
    tl = simulate(graph, events)
    wall = time.perf_counter() - t0
    logger.info("scheduled %d tasks: %.1f µs (lower bound %.1f, input %s, from %s) in %.2fs",
                len(graph), makespan, lb, input_makespan, source, wall)
    return ScheduleResult(tuple(events), makespan, lb, input_makespan, source,
                          peak_memory(graph, tl.start, tl.end), wall, stats)
