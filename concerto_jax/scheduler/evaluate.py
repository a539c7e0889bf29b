"""Exact list-scheduling evaluator of an event order (the makespan a schedule achieves).

Semantics (identical to the ``concerto_jax.taskgraph`` module docstring). Events are
issued in order; the compute stream keeps a clock ``t`` (when it is next free):

* ``RUN i``: the compute task starts at ``max(t, ready_i)`` (``ready_i``: latest end of
  its predecessors, which a valid order already guarantees ``<= t``) and ``t`` becomes its end.
* ``START j``: the collective is launched at this point of the compute stream, so it
  starts on its communication stream ``s`` at ``max(t, ready_j, free[s])`` and
  ``free[s]`` becomes its end. Issuing it does not advance ``t``.
* ``DONE j``: the compute stream waits for the collective: ``t = max(t, end_j)``.

The makespan is the latest end of any task (``t`` after the last event for valid schedules).

References: Concerto (ASPLOS'25) §4.3 (decoding and execution of the schedule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax.taskgraph import COMPUTE_STREAM, Event, Phase, TaskGraph


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Start and end time (µs) of every task under the execution semantics."""

    start: tuple[float, ...]
    end: tuple[float, ...]
    makespan: float


def simulate(graph: TaskGraph, events: Sequence[Event], check: bool = False) -> Timeline:
    """Time every task of ``events`` under the semantics of the module docstring.

    Args:
      graph: the task graph.
      events: a schedule of ``graph`` (see ``TaskGraph.check_schedule``).
      check: validate the schedule first (raises ``TaskGraphError``).

    Returns:
      The timeline.
    """
    if check:
        graph.check_schedule(events)
    tasks = graph.tasks
    preds = graph.preds
    n = len(tasks)
    start = [0.0] * n
    end = [0.0] * n
    free: dict[int, float] = {}
    t = 0.0
    run, st = Phase.RUN, Phase.START
    for e in events:
        i = e.task
        ph = e.phase
        if ph is run:
            s = t
            for p in preds[i]:
                if end[p] > s:
                    s = end[p]
            start[i] = s
            t = end[i] = s + tasks[i].duration_us
        elif ph is st:
            s = t
            for p in preds[i]:
                if end[p] > s:
                    s = end[p]
            k = tasks[i].stream
            f = free.get(k, 0.0)
            if f > s:
                s = f
            start[i] = s
            free[k] = end[i] = s + tasks[i].duration_us
        elif end[i] > t:
            t = end[i]
    makespan = max(max(end, default=0.0), t)
    return Timeline(tuple(start), tuple(end), makespan)


def evaluate(graph: TaskGraph, events: Sequence[Event]) -> float:
    """Makespan (µs) of ``events`` under the semantics of the module docstring.

    References: Concerto (ASPLOS'25) §4.3.
    """
    return simulate(graph, events).makespan


def lower_bound(graph: TaskGraph) -> float:
    """``max(sum of compute, sum of comm per stream, critical path)`` in µs.

    A valid bound for any schedule: each stream runs its tasks one at a time, and the
    tasks of a dependency chain run one after the other.
    """
    per_stream: dict[int, float] = {COMPUTE_STREAM: 0.0}
    for t in graph.tasks:
        per_stream[t.stream] = per_stream.get(t.stream, 0.0) + t.duration_us
    return max(max(per_stream.values()), critical_path(graph))


def critical_path(graph: TaskGraph) -> float:
    """Length (µs) of the longest dependency chain, durations included."""
    finish = [0.0] * len(graph)
    for i in graph.topological_order():
        r = 0.0
        for p in graph.preds[i]:
            if finish[p] > r:
                r = finish[p]
        finish[i] = r + graph.tasks[i].duration_us
    return max(finish, default=0.0)


def tails(graph: TaskGraph) -> list[float]:
    """Longest path (µs) from each task's start to the end of the graph, its duration included."""
    tail = [t.duration_us for t in graph.tasks]
    succs = graph.succs
    for i in reversed(graph.topological_order()):
        best = 0.0
        for s in succs[i]:
            if tail[s] > best:
                best = tail[s]
        tail[i] += best
    return tail
