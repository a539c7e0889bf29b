"""Replay a schedule over a task graph on one compute stream and communication streams.

Semantics (those of ``concerto_jax.taskgraph``): events are issued in order.

* ``RUN`` of a compute task occupies the compute stream from
  ``max(compute stream free, predecessors done)``; while any collective is in
  flight it progresses ``overlap_slowdown`` times slower (the interference of
  communication kernels with compute: they share SMs and memory bandwidth).
* ``START`` of a collective is issued at the compute stream's current time (a
  collective cannot begin before the compute stream reaches its launch point)
  and begins at ``max(issue time, operands ready, its stream free)``; it then
  runs for its duration on its communication stream (FIFO per stream).
* ``DONE`` blocks the compute stream until the collective ends.

The run is exact for these semantics (no time stepping): a compute task's
slowdown only depends on collectives issued before it, whose intervals are
known when it is placed.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from concerto_jax.costmodel.model import DEFAULT_OVERLAP_SLOWDOWN
from concerto_jax.simulator.result import SimResult, TaskTiming, summarize
from concerto_jax.taskgraph import COMPUTE_STREAM, Event, Phase, TaskGraph, TaskGraphError


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Simulator settings.

    Attributes:
      overlap_slowdown: factor (>= 1) by which compute slows while a collective
        is in flight; configured, not measured, until two GPUs measure it.
      check: validate the graph and the schedule first (``TaskGraph.check_schedule``).
      memory: compute the live-bytes peak (``SimResult.peak_memory_bytes``).
    """

    overlap_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    check: bool = True
    memory: bool = True


class _Intervals:
    """Disjoint union of collective busy intervals, queried for compute slowdown."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def add(self, start: float, end: float) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def finish(self, start: float, work: float, slowdown: float) -> float:
        """End time of ``work`` units started at ``start``: rate 1/slowdown inside intervals, 1 outside."""
        t = start
        i = bisect.bisect_right(self.ends, t)
        while work > 1e-12:
            if i >= len(self.starts):
                return t + work
            s, e = self.starts[i], self.ends[i]
            if t < s:
                free = s - t
                if work <= free:
                    return t + work
                work -= free
                t = s
            slow_len = e - t
            if work * slowdown <= slow_len:
                return t + work * slowdown
            work -= slow_len / slowdown
            t = e
            i += 1
        return t


def simulate(graph: TaskGraph, events: Sequence[Event], options: SimOptions = SimOptions()) -> SimResult:
    """Replay ``events`` over ``graph`` and measure it.

    Args:
      graph: tasks with durations (microseconds) and dependencies.
      events: a schedule (see ``concerto_jax.taskgraph``).
      options: overlap slowdown and checks.

    Returns:
      A ``SimResult``: step time, exposed communication, overlap, utilisation,
      peak memory and per-task timings.

    Raises:
      TaskGraphError: if ``options.check`` and the schedule is not valid for the graph.
    """
    if options.overlap_slowdown < 1.0:
        raise ValueError(f"overlap_slowdown must be >= 1, got {options.overlap_slowdown}")
    if options.check:
        graph.validate()
        graph.check_schedule(events)
    n = len(graph)
    start = [0.0] * n
    end = [0.0] * n
    issued = [False] * n
    stream_free: dict[int, float] = {}
    busy = _Intervals()
    now = 0.0  # compute stream time
    for pos, ev in enumerate(events):
        i = ev.task
        task = graph.tasks[i]
        ready = max((end[p] for p in graph.preds[i]), default=0.0)
        if ev.phase is Phase.RUN:
            s = max(now, ready)
            e = busy.finish(s, task.duration_us, options.overlap_slowdown) if task.duration_us else s
            start[i], end[i], now = s, e, e
            issued[i] = True
        elif ev.phase is Phase.START:
            s = max(now, ready, stream_free.get(task.stream, 0.0))
            e = s + task.duration_us
            start[i], end[i] = s, e
            stream_free[task.stream] = e
            busy.add(s, e)
            issued[i] = True
        else:  # DONE
            if not issued[i]:
                raise TaskGraphError(f"event {pos}: DONE of {task.name!r} before its START")
            now = max(now, end[i])
    timings = [TaskTiming(t.name, t.stream, start[i], end[i]) for i, t in enumerate(graph.tasks)]
    return summarize(graph, timings, options.overlap_slowdown, memory=options.memory)


def simulate_synchronous(graph: TaskGraph, order: Sequence[int] | None = None,
                         options: SimOptions = SimOptions()) -> SimResult:
    """Simulate program order with every collective synchronous (no overlap possible)."""
    return simulate(graph, graph.synchronous_schedule(order), options)


def order_of(events: Sequence[Event]) -> list[int]:
    """Task order of a schedule (by each task's first event)."""
    seen: set[int] = set()
    out = []
    for e in events:
        if e.task not in seen:
            seen.add(e.task)
            out.append(e.task)
    return out


__all__ = ["DEFAULT_OVERLAP_SLOWDOWN", "SimOptions", "simulate", "simulate_synchronous", "order_of",
           "COMPUTE_STREAM"]
