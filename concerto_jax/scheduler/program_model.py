"""CP-SAT model of a program (or a window of it) as an RCPSP over a ``TaskGraph``.

One interval per task; ``end[p] <= start[s]`` for every dependency inside the
modelled set; ``AddNoOverlap`` on the compute stream and on each communication
stream (all capacity 1); optionally memory as a cumulative resource (task ``i``'s
``out_bytes`` are live from its start to the end of its last modelled successor,
peak ``<= memory_limit_bytes``); minimise the makespan. Times are integer ticks of
``resolution_us``. For odd-even windows, a subset of tasks is modelled with release
times (ends of outside predecessors) and per-stream availability times.

References: Concerto (ASPLOS'25) §4.2 (RCPSP formulation), §4.3 (decoding).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence

from ortools.sat.python import cp_model

from concerto_jax.scheduler.rcpsp import (
    SchedulerError,
    SolverParams,
    SolverTimeout,
    make_solver,
    solution_callback,
)
from concerto_jax.taskgraph import TaskGraph

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProgramSolution:
    """CP-SAT result on a task graph (or window).

    Attributes:
      status: CP-SAT status name.
      tasks: the modelled task indices.
      start_us: start time (µs) per modelled task, same order as ``tasks``.
      makespan_us: objective value (µs): latest end of a modelled task.
      lower_bound_us: proven bound on the objective (µs).
      wall_time_s: model building and solve time.
    """

    status: str
    tasks: tuple[int, ...]
    start_us: tuple[float, ...]
    makespan_us: float
    lower_bound_us: float
    wall_time_s: float


def auto_resolution(graph: TaskGraph, tasks: Sequence[int], ticks: int = 100_000) -> float:
    """Tick length (µs) so that the modelled work is about ``ticks`` ticks."""
    total = sum(graph.tasks[i].duration_us for i in tasks)
    return max(total / ticks, 1e-6) if total > 0 else 1.0


def solve_program(
    graph: TaskGraph,
    params: SolverParams | None = None,
    *,
    tasks: Sequence[int] | None = None,
    release_us: Mapping[int, float] | None = None,
    stream_free_us: Mapping[int, float] | None = None,
    hint_start_us: Mapping[int, float] | Sequence[float] | None = None,
    memory_limit_bytes: int | None = None,
    resolution_us: float | None = None,
    horizon_us: float | None = None,
) -> ProgramSolution:
    """Minimise the makespan of ``graph`` (or of the window ``tasks``) with CP-SAT.

    Args:
      graph: the task graph.
      params: solver parameters (default ``SolverParams()``).
      tasks: the task indices to schedule (default: all); dependencies to tasks
        outside are dropped, their effect is given by ``release_us``.
      release_us: earliest start per task (µs), e.g. the end of outside predecessors.
      stream_free_us: per stream, the time (µs) from which it is free.
      hint_start_us: a start time per task to warm-start from (index -> µs).
      memory_limit_bytes: peak live bytes allowed; ``None`` leaves memory out.
      resolution_us: tick length; default ``auto_resolution``.
      horizon_us: an upper bound on the makespan (e.g. the hint's); default: serial sum.

    Returns:
      The solution, with start times in µs.

    Raises:
      SchedulerError: no solution within the limits.

    References: Concerto (ASPLOS'25) §4.2.
    """
    t0 = time.perf_counter()
    params = params or SolverParams()
    subset = list(range(len(graph))) if tasks is None else list(tasks)
    in_set = {i: k for k, i in enumerate(subset)}
    release_us = release_us or {}
    stream_free_us = stream_free_us or {}
    res = resolution_us or auto_resolution(graph, subset)
    origin = min([release_us.get(i, 0.0) for i in subset] + list(stream_free_us.values()) + [0.0]
                 if not release_us and not stream_free_us else
                 [release_us.get(i, 0.0) for i in subset] + list(stream_free_us.values()))

    def ticks(us: float) -> int:
        return int(math.ceil((us - origin) / res - 1e-9))

    dur = {i: (max(1, round(graph.tasks[i].duration_us / res)) if graph.tasks[i].duration_us > 0
               else 0) for i in subset}
    rel = {i: max(0, ticks(release_us.get(i, origin))) for i in subset}
    free = {k: max(0, ticks(v)) for k, v in stream_free_us.items()}
    for i in subset:
        rel[i] = max(rel[i], free.get(graph.tasks[i].stream, 0))
    # Forward earliest starts and backward tails inside the window.
    order = _local_topological_order(graph, subset, in_set) if tasks is not None \
        else graph.topological_order()
    est = dict(rel)
    for i in order:
        for s in graph.succs[i]:
            if s in in_set and est[i] + dur[i] > est[s]:
                est[s] = est[i] + dur[i]
    tail = {}
    for i in reversed(order):
        tail[i] = dur[i] + max((tail[s] for s in graph.succs[i] if s in in_set), default=0)
    per_stream: dict[int, int] = {}
    for i in subset:
        k = graph.tasks[i].stream
        per_stream[k] = per_stream.get(k, free.get(k, 0)) + dur[i]
    lb = max([est[i] + tail[i] for i in subset] + list(per_stream.values()) + [0])
    hint = None
    if hint_start_us is not None:
        hint = _retime_hint(graph, order, in_set, dur, rel, free, hint_start_us)
    if horizon_us is not None:
        horizon = max(lb, ticks(horizon_us) + len(subset))  # rounding slack
    else:
        horizon = max(rel.values(), default=0) + sum(dur.values())
    if hint is not None:
        horizon = max(horizon, max((hint[i] + dur[i] for i in subset), default=0))
    model = cp_model.CpModel()
    task_to_start, task_to_end, task_to_interval = {}, {}, {}
    for i in subset:
        start = model.new_int_var(est[i], max(est[i], horizon - tail[i]), f"start_{i}")
        task_to_start[i] = start
        task_to_end[i] = start + dur[i]
        task_to_interval[i] = model.new_fixed_size_interval_var(start, dur[i], f"interval_{i}")
    makespan = model.new_int_var(lb, horizon, "makespan")
    stream_to_intervals: dict[int, list] = {}
    for i in subset:
        for s in graph.succs[i]:
            if s in in_set:
                model.add(task_to_start[i] + dur[i] <= task_to_start[s])
        if not any(s in in_set for s in graph.succs[i]):
            model.add(task_to_start[i] + dur[i] <= makespan)
        if dur[i] > 0:
            stream_to_intervals.setdefault(graph.tasks[i].stream, []).append(task_to_interval[i])
    for intervals in stream_to_intervals.values():
        model.add_no_overlap(intervals)
    if memory_limit_bytes is not None:
        _add_memory(model, graph, subset, in_set, task_to_start, task_to_end, horizon,
                    memory_limit_bytes)
    model.minimize(makespan)
    if hint is not None:
        for i in subset:
            model.add_hint(task_to_start[i], hint[i])
        model.add_hint(makespan, max(lb, max((hint[i] + dur[i] for i in subset), default=0)))
    if params.export_path:
        model.export_to_file(params.export_path)
    solver = make_solver(params)
    status = solver.solve(model, solution_callback(params, f"CP-SAT program model ({len(subset)} tasks)",
                                                   res, " µs"))
    if status == cp_model.INFEASIBLE:
        raise SchedulerError(
            f"CP-SAT proved the model of {len(subset)} tasks infeasible (horizon {horizon} ticks, "
            f"memory limit {memory_limit_bytes} bytes): no order fits the memory limit")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise (SolverTimeout if status == cp_model.UNKNOWN else SchedulerError)(
            f"CP-SAT returned {solver.status_name(status)} on {len(subset)} tasks within "
            f"{params.time_limit_s}s; raise the time limit")
    starts = tuple(origin + solver.value(task_to_start[i]) * res for i in subset)
    value = int(solver.objective_value)
    bound = value if status == cp_model.OPTIMAL else max(lb, int(solver.best_objective_bound))
    wall = time.perf_counter() - t0
    logger.debug("program model: %d tasks %s makespan %d bound %d ticks in %.2fs",
                 len(subset), solver.status_name(status), value, bound, wall)
    return ProgramSolution(solver.status_name(status), tuple(subset), starts,
                           origin + value * res, origin + bound * res, wall)


def _local_topological_order(graph: TaskGraph, subset: Sequence[int], in_set) -> list[int]:
    """A topological order of the window ``subset`` (edges inside it only), in O(window)."""
    indeg = {i: sum(1 for p in graph.preds[i] if p in in_set) for i in subset}
    stack = [i for i in reversed(subset) if indeg[i] == 0]
    out = []
    while stack:
        i = stack.pop()
        out.append(i)
        for s in graph.succs[i]:
            if s in indeg:
                indeg[s] -= 1
                if indeg[s] == 0:
                    stack.append(s)
    return out


def _retime_hint(graph, order, in_set, dur, rel, free, hint_start_us) -> dict[int, int]:
    """A feasible start (ticks) per task that keeps the hint's order on every stream.

    Rounding durations to ticks can make the µs hint infeasible, and CP-SAT then has no
    incumbent; re-timing the hint's order (left-shifted, serial per stream) fixes that.
    """
    topo = {i: k for k, i in enumerate(order)}
    seq = sorted(in_set, key=lambda i: (hint_start_us[i], topo[i]))
    stream_free = dict(free)
    out: dict[int, int] = {}
    for i in seq:
        k = graph.tasks[i].stream
        s = max(rel[i], stream_free.get(k, 0) if dur[i] > 0 else 0)
        for p in graph.preds[i]:
            if p in out:
                s = max(s, out[p] + dur[p])
        out[i] = s
        if dur[i] > 0:
            stream_free[k] = s + dur[i]
    return out


def _add_memory(model, graph, subset, in_set, task_to_start, task_to_end, horizon, limit):
    """Memory as a cumulative resource: out_bytes live from start to the last successor's end.

    Demands and the capacity are in units of ``limit // 10**6`` bytes (small numbers for
    CP-SAT), both rounded DOWN: the model is then a relaxation of the exact limit, so every
    order whose exact peak is within ``limit`` is feasible here (rounding demands up made an
    order exactly at the limit infeasible: CP-SAT proved INFEASIBLE a loop body whose input
    order sat at its limit). What CP-SAT returns may exceed the exact limit by less than one
    unit per live buffer; every caller checks the exact peak (``schedule``'s candidates,
    ``odd_even``'s splices)."""
    holders = [i for i in subset if graph.tasks[i].out_bytes > 0]
    if not holders:
        return
    unit = max(1, max(limit, 1) // 1_000_000)
    intervals, demands = [], []
    for i in holders:
        users = [task_to_end[s] for s in graph.succs[i] if s in in_set]
        live_end = model.new_int_var(0, horizon, f"live_end_{i}")
        model.add_max_equality(live_end, [task_to_end[i]] + users)
        size = model.new_int_var(0, horizon, f"live_size_{i}")
        intervals.append(model.new_interval_var(task_to_start[i], size, live_end, f"live_{i}"))
        demands.append(graph.tasks[i].out_bytes // unit)
    model.add_cumulative(intervals, demands, limit // unit)
