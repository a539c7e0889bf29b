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
    """``max(total compute, busiest communication stream)`` and the critical path of ``graph``.

    Each stream's total is accumulated in task order with ``+=`` (not ``sum()``, which Python
    >= 3.12 compensates): the scheduler compares makespans against ``bound_us`` and must see
    the same figure on every Python.
    """
    compute = 0.0
    per_stream: dict[int, float] = {}
    for t in graph.tasks:
        if t.stream == COMPUTE_STREAM:
            compute += t.duration_us
        else:
            per_stream[t.stream] = per_stream.get(t.stream, 0.0) + t.duration_us
    cp, _ = critical_path(graph)
    return LowerBounds(compute, max(per_stream.values(), default=0.0), cp)
