"""Schedule checker: precedence, stream exclusivity and memory limit of a timed schedule.

References: Concerto (ASPLOS'25) §4.2 (resources of the scheduling model).
"""

from __future__ import annotations

from collections.abc import Sequence

from concerto_jax.simulator.timeline import Timeline, timeline
from concerto_jax.taskgraph import Event, TaskGraph, TaskGraphError


class ScheduleError(TaskGraphError):
    """A timed schedule breaks precedence, stream exclusivity or the memory limit."""


def live_intervals(graph: TaskGraph, start: Sequence[float], end: Sequence[float]):
    """``(begin, finish, bytes)`` per task: its output lives from its start to its last user's end."""
    out = []
    succs = graph.succs
    for i, t in enumerate(graph.tasks):
        if t.out_bytes <= 0:
            continue
        finish = end[i]
        for s in succs[i]:
            if end[s] > finish:
                finish = end[s]
        out.append((start[i], finish, t.out_bytes))
    return out


def peak_memory(graph: TaskGraph, start: Sequence[float], end: Sequence[float]) -> int:
    """Peak of live bytes over time (an output freed at time x is not live at x)."""
    points = []
    for b, f, q in live_intervals(graph, start, end):
        points.append((b, 1, q))
        points.append((f, 0, -q))
    points.sort()
    live = peak = 0
    for _, _, q in points:
        live += q
        peak = max(peak, live)
    return peak


def check_timeline(
    graph: TaskGraph,
    start: Sequence[float],
    end: Sequence[float],
    memory_limit_bytes: int | None = None,
    tol: float = 1e-6,
) -> None:
    """Raise ``ScheduleError`` unless the timed schedule is feasible.

    Invariants: every task runs for its duration (``end - start == duration``); a task
    starts no earlier than each predecessor ends; on every stream the tasks of positive
    duration do not overlap in time; if ``memory_limit_bytes`` is given, the peak of
    live bytes (``peak_memory``) does not exceed it. ``tol`` absorbs rounding.
    """
    tasks = graph.tasks
    n = len(tasks)
    if len(start) != n or len(end) != n:
        raise ScheduleError(f"expected {n} start/end times, got {len(start)}/{len(end)}")
    for i, t in enumerate(tasks):
        if abs(end[i] - start[i] - t.duration_us) > tol * max(1.0, t.duration_us):
            raise ScheduleError(
                f"task {t.name!r} runs {end[i] - start[i]} µs, its duration is {t.duration_us}")
        if start[i] < -tol:
            raise ScheduleError(f"task {t.name!r} starts at negative time {start[i]}")
        for p in graph.preds[i]:
            if start[i] < end[p] - tol:
                raise ScheduleError(
                    f"task {t.name!r} starts at {start[i]} before its predecessor "
                    f"{tasks[p].name!r} ends at {end[p]}")
    by_stream: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.duration_us > 0:
            by_stream.setdefault(t.stream, []).append(i)
    for stream, idx in by_stream.items():
        idx.sort(key=lambda i: start[i])
        for a, b in zip(idx, idx[1:], strict=False):
            if start[b] < end[a] - tol:
                raise ScheduleError(
                    f"stream {stream}: {tasks[b].name!r} starts at {start[b]} while "
                    f"{tasks[a].name!r} runs until {end[a]}")
    if memory_limit_bytes is not None:
        peak = peak_memory(graph, start, end)
        if peak > memory_limit_bytes:
            raise ScheduleError(
                f"peak live memory {peak} bytes exceeds the limit {memory_limit_bytes}; "
                "raise the limit or schedule with the memory resource on")


def check_events(
    graph: TaskGraph, events: Sequence[Event], memory_limit_bytes: int | None = None
) -> Timeline:
    """Check an event order (``TaskGraph.check_schedule``) and its timeline; return the timeline."""
    graph.check_schedule(events)
    tl = timeline(graph, events)
    check_timeline(graph, tl.start, tl.end, memory_limit_bytes)
    return tl


def check_rcpsp(instance, starts: Sequence[int]) -> int:
    """Raise ``ScheduleError`` unless ``starts`` is feasible for the RCPSP ``instance``.

    Invariants: precedence (``start[s] >= start[i] + duration[i]``) and, at every time,
    the demand of the running tasks on each resource is at most its capacity.

    Returns:
      The makespan.
    """
    dur = instance.durations
    n = instance.num_tasks
    if len(starts) != n:
        raise ScheduleError(f"expected {n} start times, got {len(starts)}")
    for i in range(n):
        if starts[i] < 0:
            raise ScheduleError(f"task {i} starts at negative time {starts[i]}")
        for s in instance.successors[i]:
            if starts[s] < starts[i] + dur[i]:
                raise ScheduleError(f"task {s} starts at {starts[s]} before its predecessor "
                                    f"{i} ends at {starts[i] + dur[i]}")
    points = sorted({starts[i] for i in range(n)})
    for t in points:
        running = [i for i in range(n) if starts[i] <= t < starts[i] + dur[i]]
        for r, cap in enumerate(instance.capacities):
            used = sum(instance.demands[i][r] for i in running)
            if used > cap:
                raise ScheduleError(f"resource {r} uses {used} > capacity {cap} at time {t} "
                                    f"(tasks {running})")
    return max((starts[i] + dur[i] for i in range(n)), default=0)
