"""Lower bounds on the step time of any schedule of a task graph (at full speed, no slowdown)."""

from __future__ import annotations

import dataclasses

from concerto_jax.taskgraph import COMPUTE_STREAM, TaskGraph


@dataclasses.dataclass(frozen=True)
class LowerBounds:
    """Bounds no schedule can beat.

    Attributes:
      total_compute_us: sum of compute durations (one compute stream).
      total_comm_us: the busiest communication stream's sum of durations.
      critical_path_us: longest dependency chain, each task at full speed.
      bound_us: the largest of the three.
    """

    total_compute_us: float
    total_comm_us: float
    critical_path_us: float

    @property
    def resource_us(self) -> float:
        """``max(total compute, total communication)``."""
        return max(self.total_compute_us, self.total_comm_us)

    @property
    def bound_us(self) -> float:
        return max(self.resource_us, self.critical_path_us)


def critical_path(graph: TaskGraph) -> tuple[float, list[int]]:
    """Length and tasks of the longest path through ``graph`` (durations at full speed)."""
    finish = [0.0] * len(graph)
    via = [-1] * len(graph)
    for i in graph.topological_order():
        best, arg = 0.0, -1
        for p in graph.preds[i]:
            if finish[p] > best:
                best, arg = finish[p], p
        finish[i] = best + graph.tasks[i].duration_us
        via[i] = arg
    if not finish:
        return 0.0, []
    i = max(range(len(finish)), key=finish.__getitem__)
    length = finish[i]
    path = []
    while i >= 0:
        path.append(i)
        i = via[i]
    return length, path[::-1]


def lower_bounds(graph: TaskGraph) -> LowerBounds:
    """``max(total compute, busiest communication stream)`` and the critical path of ``graph``."""
    compute = sum(t.duration_us for t in graph.tasks if t.stream == COMPUTE_STREAM)
    per_stream: dict[int, float] = {}
    for t in graph.tasks:
        if t.stream != COMPUTE_STREAM:
            per_stream[t.stream] = per_stream.get(t.stream, 0.0) + t.duration_us
    cp, _ = critical_path(graph)
    return LowerBounds(compute, max(per_stream.values(), default=0.0), cp)


def lower_bound(graph: TaskGraph) -> float:
    """``lower_bounds(graph).bound_us`` with every stream's total, compute included, accumulated
    with ``+=`` in task order: the scheduler's bound (it gates CP-SAT and odd-even on it, and the
    ``schedule`` pass reports it). ``lower_bounds`` sums compute with ``sum()``, which Python
    >= 3.12 compensates, so the two can differ in the last bits; each keeps its figures."""
    per_stream: dict[int, float] = {COMPUTE_STREAM: 0.0}
    for t in graph.tasks:
        per_stream[t.stream] = per_stream.get(t.stream, 0.0) + t.duration_us
    return max(max(per_stream.values()), critical_path(graph)[0])
