"""What a simulated schedule measures: ``SimResult`` and how it is computed from task timings."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from concerto_jax.taskgraph import COMPUTE_STREAM, TaskGraph


@dataclasses.dataclass(frozen=True, slots=True)
class TaskTiming:
    """When one task ran (microseconds from the start of the step)."""

    name: str
    stream: int
    start_us: float
    end_us: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Measurements of one simulated schedule.

    Attributes:
      step_time_us: end of the last task.
      compute_busy_us: time the compute stream runs kernels (slowed where overlapped).
      comm_busy_us: time at least one collective is in flight.
      exposed_comm_us: time a collective is in flight and no kernel runs.
      overlap_pct: share of ``comm_busy_us`` hidden behind compute, in percent.
      exposed_comm_pct: ``exposed_comm_us`` as a percentage of the step time.
      stream_utilisation: busy fraction of each stream (0 = compute, 1.. = communication).
      peak_memory_bytes: peak of live result bytes (a task's result lives from its
        start until its last user ends; results without users live to the end).
      overlap_slowdown: the compute slowdown factor used for this run.
      timings: per-task start/end, in graph order.
    """

    step_time_us: float
    compute_busy_us: float
    comm_busy_us: float
    exposed_comm_us: float
    overlap_pct: float
    exposed_comm_pct: float
    stream_utilisation: dict[int, float]
    peak_memory_bytes: int
    overlap_slowdown: float
    timings: tuple[TaskTiming, ...]

    def __repr__(self) -> str:
        return (f"SimResult(step={self.step_time_us:.1f}us, compute={self.compute_busy_us:.1f}us, "
                f"comm={self.comm_busy_us:.1f}us, exposed={self.exposed_comm_us:.1f}us "
                f"({self.exposed_comm_pct:.1f}%), overlap={self.overlap_pct:.1f}%, "
                f"peak_mem={self.peak_memory_bytes / 2**20:.1f}MiB)")

    def timing(self, name: str) -> TaskTiming:
        """The timing of the task named ``name``."""
        for t in self.timings:
            if t.name == name:
                return t
        raise KeyError(name)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted union of ``(start, end)`` intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def measure(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def difference(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``union(a) - union(b)`` as disjoint sorted intervals, for disjoint sorted inputs."""
    out: list[tuple[float, float]] = []
    j = 0
    for s, e in a:
        t = s
        while j < len(b) and b[j][1] <= t:
            j += 1
        k = j
        while t < e:
            if k >= len(b) or b[k][0] >= e:
                out.append((t, e))
                break
            if b[k][0] > t:
                out.append((t, b[k][0]))
            t = max(t, b[k][1])
            k += 1
    return out


def minus(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of ``union(a) - union(b)`` for disjoint sorted inputs (summed left to right with
    ``+=``: Python >= 3.12's ``sum`` of floats is compensated and rounds differently)."""
    total = 0.0
    for s, e in difference(a, b):
        total += e - s
    return total


def peak_live_bytes(graph: TaskGraph, timings: Sequence[TaskTiming], step_end: float) -> int:
    """Peak of live result bytes under the lifetime rule of ``SimResult.peak_memory_bytes``."""
    deltas: list[tuple[float, int]] = []
    for i, task in enumerate(graph.tasks):
        if task.out_bytes <= 0:
            continue
        users = graph.succs[i]
        release = max((timings[u].end_us for u in users), default=step_end)
        deltas.append((timings[i].start_us, task.out_bytes))
        deltas.append((max(release, timings[i].end_us), -task.out_bytes))
    # At equal times, frees happen before allocations (a buffer freed at t can be reused at t).
    deltas.sort(key=lambda d: (d[0], d[1]))
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return peak


def summarize(graph: TaskGraph, timings: Sequence[TaskTiming], overlap_slowdown: float,
              *, memory: bool = True) -> SimResult:
    """Build a ``SimResult`` from per-task timings."""
    step = max((t.end_us for t in timings), default=0.0)
    compute = union((t.start_us, t.end_us) for t in timings if t.stream == COMPUTE_STREAM)
    comm = union((t.start_us, t.end_us) for t in timings if t.stream != COMPUTE_STREAM)
    comm_busy = measure(comm)
    exposed = minus(comm, compute)
    streams = sorted({t.stream for t in timings} | {COMPUTE_STREAM})
    util = {}
    for s in streams:
        busy = measure(union((t.start_us, t.end_us) for t in timings if t.stream == s))
        util[s] = busy / step if step > 0 else 0.0
    return SimResult(
        step_time_us=step,
        compute_busy_us=measure(compute),
        comm_busy_us=comm_busy,
        exposed_comm_us=exposed,
        overlap_pct=100.0 * (comm_busy - exposed) / comm_busy if comm_busy > 0 else 100.0,
        exposed_comm_pct=100.0 * exposed / step if step > 0 else 0.0,
        stream_utilisation=util,
        peak_memory_bytes=peak_live_bytes(graph, timings, step) if memory else 0,
        overlap_slowdown=overlap_slowdown,
        timings=tuple(timings),
    )
