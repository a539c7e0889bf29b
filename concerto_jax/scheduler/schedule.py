"""Top-level program scheduler: candidates (input, list heuristic, CP-SAT), then odd-even.

Pipeline for one ``TaskGraph``::

    input order (optional) ──┐
    list heuristic ──────────┤
    list heuristic, feeding  ┼─> best evaluated ──> odd-even windows ──> result
    idle streams             │
    full CP-SAT (small graphs, warm-started from the better heuristic) ──┘

Every candidate is an event order judged by ``makespan`` (the execution semantics of
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
from concerto_jax.scheduler.heuristics import justification_priority, list_schedule
from concerto_jax.scheduler.oddeven import OddEvenOptions, odd_even
from concerto_jax.scheduler.program_model import solve_program
from concerto_jax.scheduler.rcpsp import SchedulerError, SolverParams, SolverTimeout
from concerto_jax.simulator.bounds import lower_bound
from concerto_jax.simulator.timeline import timeline
from concerto_jax.taskgraph import Event, TaskGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """How to schedule a task graph."""

    full_model_max_tasks: int = 400  # solve the whole graph with CP-SAT up to this size
    full_model_time_limit_s: float = 5.0  # wall limit of the whole-graph solve
    # Its deterministic-time limit: what stops it, so that a plan does not depend on the
    # machine's load (2.0: the plans of five held-out modules (TP, DP x TP, FSDP steps) equal to or
    # within 0.06 % of those at 20.0, in a third to half the time; docs/DECISIONS.md D47).
    full_model_deterministic_time: float | None = 2.0
    num_workers: int = 1  # CP-SAT workers for the whole-graph solve (1: reproducible)
    seed: int = 0  # CP-SAT seed
    # Peak live bytes allowed (the memory model of ``checker.peak_memory``). None: the
    # limit is ``memory_limit_ratio`` x the peak of the input order (XLA's order where
    # the caller has it, program order otherwise).
    memory_limit_bytes: int | None = None
    # With no byte limit: limit = ratio x the input order's peak (1.0: never above the
    # order we started from; 1.2: allow 20 % more). None: memory not modelled at all.
    memory_limit_ratio: float | None = 1.0
    # A budget the caller knows the program may use whatever the input order's peak: the
    # limit is then max(memory_limit_ratio x input peak, memory_budget_bytes) (never below
    # the input order's peak). compile_for_target passes the limit XLA's own GPU scheduler
    # holds itself to on the target (``deviceless.planning.xla_scheduler_memory_limit``).
    # Ignored when memory_limit_bytes is set or memory_limit_ratio is None.
    memory_budget_bytes: int | None = None
    odd_even: OddEvenOptions | None = OddEvenOptions()  # None: no window search
    # Cap on candidate merges the "fuse_collectives" pass evaluates (None: no cap).
    fusion_max_evaluations: int | None = 400
    # Log progress lines (elapsed time, best makespan) at INFO while solving; they reach
    # the user only if logging is configured (``optimize`` stays quiet otherwise).
    progress: bool = True
    # A computation keeps its input order (XLA's) unless ours is modelled at least this
    # fraction faster, or the input order is over the memory limit. An order change is not
    # free: on an H200, a 1-GPU step with no collectives, reordered at zero modelled gain
    # (ties broken otherwise), ran 15% slower than in XLA's order.
    min_gain: float = 0.005

    def __post_init__(self):
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be positive, got {self.memory_limit_bytes}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.memory_limit_ratio is not None and self.memory_limit_ratio < 1.0:
            raise ValueError(f"memory_limit_ratio must be >= 1.0 (a limit below the input order's "
                             f"peak may have no solution), got {self.memory_limit_ratio}; set "
                             "memory_limit_bytes for an absolute limit")

    def memory_limit_for(self, input_peak_bytes: int | None) -> int | None:
        """The limit in bytes for an input order whose peak is ``input_peak_bytes``."""
        if self.memory_limit_bytes is not None:
            return self.memory_limit_bytes
        if self.memory_limit_ratio is None or input_peak_bytes is None:
            return None
        limit = int(self.memory_limit_ratio * input_peak_bytes)
        if self.memory_budget_bytes is not None:
            limit = max(limit, int(self.memory_budget_bytes))
        return limit


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """A schedule and how it was found.

    Attributes:
      events: the chosen event order (valid for the graph).
      makespan_us: its evaluated makespan.
      lower_bound_us: ``max(sum compute, sum comm per stream, critical path)``.
      input_makespan_us: the input order's makespan (``None`` without an input).
      source: which candidate won before odd-even (``input``, ``heuristic``,
        ``heuristic_feed``: the list heuristic with ``feed_streams``,
        ``heuristic_justified``: either improved by ``justified_schedule``, ``cp``).
      peak_memory_bytes: peak live bytes of the chosen schedule's timeline.
      input_peak_memory_bytes: the same for the input order (program order without one).
      memory_limit_bytes: the limit the schedule was held to (None: not modelled).
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
    input_peak_memory_bytes: int = 0
    memory_limit_bytes: int | None = None


MEMORY_GUIDE_RETRIES = 4
"""How many times ``list_schedule_within`` lowers a list schedule's memory guide."""


def list_schedule_within(graph: TaskGraph, make, limit: int | None,
                         retries: int = MEMORY_GUIDE_RETRIES) -> tuple[list[Event], object, int]:
    """A list schedule whose timeline's peak is within ``limit``: ``(events, timeline, retries)``.

    ``make(guide)`` runs a list schedule with ``memory_limit_bytes=guide``. The list
    scheduler's memory rule is a guide (``heuristics.list_schedule``): it counts live bytes
    in issue order, while ``checker.peak_memory`` counts them on the timeline, so a schedule
    made with the guide at the limit can peak a little over it (a training-step graph of
    1,002 tasks: 208 MiB against 206, rejected, and the step fell back to its input order,
    38,381 us instead of 31,891). Each retry lowers the guide by the last overshoot, up to
    ``retries`` times; where none fits, the try with the lowest peak is returned (the caller
    rejects it). ``limit`` None: one run, no memory rule.
    """
    events = make(limit)
    tl = timeline(graph, events)
    if limit is None:
        return events, tl, 0
    peak = peak_memory(graph, tl.start, tl.end)
    best = (peak, events, tl)
    guide, tries = limit, 0
    while peak > limit and tries < retries:
        guide -= peak - limit
        if guide <= 0:
            break
        tries += 1
        events = make(guide)
        tl = timeline(graph, events)
        peak = peak_memory(graph, tl.start, tl.end)
        if peak < best[0]:
            best = (peak, events, tl)
    if peak <= limit:
        return events, tl, tries
    return best[1], best[2], tries


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

    Memory: the limit is ``options.memory_limit_for(peak of the input order)``: by
    default the input order's own peak (program order when ``initial`` is None), so the
    result never needs more memory than what it started from. Every candidate (input, list
    heuristics run with the limit as their guide, lowered where their timeline peaks over
    it: ``list_schedule_within``; program order as a fallback, CP-SAT, each odd-even
    splice) is timed and its ``checker.peak_memory`` compared with the limit; those over
    it are rejected. So if the input order is within the limit, so is the result. If no
    candidate is within it, the one with the lowest peak is returned (with a warning).

    Determinism: two calls with the same graph, options and input in one process (or
    in different processes) return the same schedule as long as no wall-clock limit
    decides anything. The defaults are reproducible in that sense: the whole-graph
    CP-SAT solve stops on ``full_model_deterministic_time`` with ``num_workers=1``, and
    odd-even blocks on ``block_deterministic_time`` with one worker. A wall-clock limit
    can break determinism when it is what stops the work: ``full_model_time_limit_s``
    or ``OddEvenOptions.block_time_limit_s`` reached before the deterministic limit
    (a loaded machine), ``OddEvenOptions.time_budget_s`` cutting the odd-even search
    after a machine-dependent number of blocks, or ``num_workers > 1`` (CP-SAT's
    parallel portfolio is not reproducible under a time limit). For bit-identical
    plans across processes (multi-process runs), decide on one process and broadcast
    its plan, as ``concerto_jax.multiprocess`` does.

    References: Concerto (ASPLOS'25) §4.2-4.4.
    """
    t0 = time.perf_counter()
    graph.validate()
    if initial is not None:
        initial = list(initial)
        graph.check_schedule(initial)
    start_order = initial if initial is not None else graph.synchronous_schedule()
    stl = timeline(graph, start_order)
    input_peak = peak_memory(graph, stl.start, stl.end)
    limit = options.memory_limit_for(input_peak)
    # A limit above every output's bytes together cannot bind, whatever the order: the
    # searches then run without the memory model (it only slows them: CP-SAT's cumulative
    # in every odd-even block), and every candidate is still checked against the limit.
    vacuous = limit is not None and sum(t.out_bytes for t in graph.tasks) <= limit
    model_limit = None if vacuous else limit
    stats: dict = {"tasks": len(graph), "input_peak_bytes": input_peak, "memory_limit_bytes": limit,
                   "memory_limit_cannot_bind": vacuous}
    cands: list[tuple[float, str, list[Event], int]] = []  # (makespan, source, events, peak)
    rejected: list[tuple[int, float, str, list[Event]]] = []  # over the memory limit

    def consider(source: str, events: list[Event], tl=None) -> float:
        tl = tl or timeline(graph, events)
        peak = peak_memory(graph, tl.start, tl.end) if limit is not None else 0
        if limit is not None and peak > limit:
            stats[f"{source}_peak_bytes"] = peak
            rejected.append((peak, tl.makespan, source, events))
            logger.info("candidate %s rejected: peak %d bytes > limit %d", source, peak, limit)
        else:
            cands.append((tl.makespan, source, events, peak))
        return tl.makespan

    input_makespan = None
    if initial is not None:
        input_makespan = consider("input", initial, stl)
    th = time.perf_counter()
    retries = {"heuristic": 0, "heuristic_feed": 0, "heuristic_justified": 0}

    def within(source: str, make) -> tuple[list[Event], object]:
        events, tl, tries = list_schedule_within(graph, make, model_limit)
        retries[source] += tries
        return events, tl

    heur, htl = within("heuristic", lambda guide: list_schedule(graph, memory_limit_bytes=guide))
    # The same list scheduler feeding idle communication streams first (its docstring):
    # critical-path priority alone leaves the stream idle where a short computation
    # would have fed it (gpt_dp2_tp8_2hosts: 6,114 -> 5,653 us planned); each is
    # better on some graphs, so both are candidates.
    feed, ftl = within("heuristic_feed",
                       lambda guide: list_schedule(graph, memory_limit_bytes=guide, feed_streams=True))
    stats["heuristic_s"] = time.perf_counter() - th
    stats["heuristic_makespan_us"] = htl.makespan
    stats["heuristic_feed_makespan_us"] = ftl.makespan
    consider("heuristic", heur, htl)
    consider("heuristic_feed", feed, ftl)
    # Forward-backward improvement of both (``heuristics.justified_schedule``): the
    # critical-path priority runs a DP step's last weight-gradient GEMMs after the rest of
    # the backward pass, and their all-reduces queue behind the last kernel (held-out
    # DP x TP step: 6,486.7 / 6,722.6 -> 6,200.0 us planned).
    tj = time.perf_counter()
    just, jtl = None, None
    for base in (htl, ftl):
        prio = justification_priority(graph, base.start, base.end)
        for f in (False, True):  # justified_schedule's two forward schedules
            ev, tl_ = within("heuristic_justified", lambda guide, prio=prio, f=f: list_schedule(
                graph, priority=prio, memory_limit_bytes=guide, feed_streams=f))
            if jtl is None or tl_.makespan < jtl.makespan:
                just, jtl = ev, tl_
    stats["heuristic_justified_s"] = time.perf_counter() - tj
    stats["memory_guide_retries"] = retries
    stats["heuristic_justified_makespan_us"] = jtl.makespan
    consider("heuristic_justified", just, jtl)
    hint_source, hint_tl = min((("heuristic", htl), ("heuristic_feed", ftl), ("heuristic_justified", jtl)),
                               key=lambda c: (c[0] not in {x[1] for x in cands}, c[1].makespan))
    # the CP-SAT hint and horizon below: the best list schedule within the limit
    if limit is not None and not cands:
        # Memory fallback: program order, collectives synchronous (no early launches).
        consider("program", graph.synchronous_schedule())
    lb = lower_bound(graph)
    # CP-SAT's hint and horizon: that list schedule if it is within the limit, else the best
    # candidate that is (a horizon from a list schedule over the limit can be shorter than
    # every order within it, and CP-SAT then proves "infeasible": a 35-task conditional
    # branch whose input order alone fits)
    if cands and hint_source not in {c[1] for c in cands}:
        hint_tl = timeline(graph, min(cands, key=lambda c: c[0])[2])
    if len(graph) <= options.full_model_max_tasks and hint_tl.makespan > lb + 1e-9:
        params = SolverParams(time_limit_s=options.full_model_time_limit_s,
                              num_workers=options.num_workers, seed=options.seed,
                              deterministic_time=options.full_model_deterministic_time,
                              progress=options.progress)
        try:
            sol = solve_program(graph, params, hint_start_us=hint_tl.start, horizon_us=hint_tl.makespan,
                                memory_limit_bytes=model_limit)
            cp_events = decode(graph, sol.start_us)
            cp_makespan = consider("cp", cp_events)
            stats.update(cp_status=sol.status, cp_makespan_us=cp_makespan, cp_s=sol.wall_time_s)
        except SolverTimeout as err:  # the heuristic's order stands: expected on big graphs
            logger.info("whole-graph CP-SAT found no solution in time, keeping the heuristic: %s", err)
        except SchedulerError as err:
            logger.warning("whole-graph CP-SAT solve failed, keeping the heuristic: %s", err)
    if not cands:
        # Nothing within the limit (the input, if any, is over it too): least memory wins.
        peak, mk, source, events = min(rejected, key=lambda r: (r[0], r[1]))
        logger.warning("no schedule within the memory limit %d bytes; returning the one with "
                       "the lowest peak (%d bytes, from %s)", limit, peak, source)
        cands.append((mk, source, events, peak))
        limit_for_search = None
    else:
        limit_for_search = model_limit
    order = {"input": 0, "cp": 1, "heuristic": 2, "heuristic_feed": 3, "heuristic_justified": 4,
             "program": 5}
    makespan, source, events, _ = min(cands, key=lambda c: (c[0], order[c[1]]))
    if options.odd_even is not None and makespan > lb + 1e-9 and len(graph) > 2:
        oe_opts = options.odd_even
        if not options.progress:
            oe_opts = dataclasses.replace(oe_opts, progress=False)
        if limit_for_search is not None and oe_opts.memory_limit_bytes is None:
            oe_opts = dataclasses.replace(oe_opts, memory_limit_bytes=limit_for_search)
        oe = odd_even(graph, events, oe_opts)
        stats.update(odd_even_rounds=oe.rounds, odd_even_solved=oe.blocks_solved,
                     odd_even_accepted=oe.blocks_accepted, odd_even_s=oe.wall_time_s)
        if oe.makespan_us < makespan:
            events, makespan = list(oe.events), oe.makespan_us
    tl = timeline(graph, events)
    wall = time.perf_counter() - t0
    logger.info("scheduled %d tasks: %.1f µs (lower bound %.1f, input %s, from %s) in %.2fs",
                len(graph), makespan, lb, input_makespan, source, wall)
    return ScheduleResult(tuple(events), makespan, lb, input_makespan, source,
                          peak_memory(graph, tl.start, tl.end), wall, stats, input_peak, limit)
