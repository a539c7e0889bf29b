"""Collective fusion (paper Algorithm 1) with bucket boundaries chosen by evaluated makespan.

Collectives with the same ``(op, groups_key)`` (and stream, group size, host span) are
*interchangeable*; a set of them can be fused into one collective when no member
reaches another through the graph (fusing them would otherwise create a cycle).
Walking the collectives in the order in which the current schedule starts them, each
one is either appended to the open bucket of its kind or opens a new bucket. The
choice is not a fixed byte threshold: the candidate graph is rescheduled with the list
heuristic and the append is kept only if the evaluated makespan does not get worse,
with the fused collective's duration given by a cost function (e.g. alpha-beta), so
the bucket size is whatever the cost model and the overlap available make best.

References: Concerto (ASPLOS'25) §4.5 and Algorithm 1 (collective fusion), Figure 2
(no universal bucket size).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from concerto_jax.scheduler.heuristics import list_schedule
from concerto_jax.scheduler.progress import Progress
from concerto_jax.simulator.timeline import timeline
from concerto_jax.taskgraph import CollectiveInfo, Event, Task, TaskGraph, build_fused_graph

logger = logging.getLogger(__name__)

CostFn = Callable[[CollectiveInfo], float]
"""Duration (µs) of a collective described by its ``CollectiveInfo``."""


def alpha_beta(alpha_us: float, bytes_per_us: float) -> CostFn:
    """The alpha-beta model ``time(bytes) = alpha + bytes / bandwidth``."""
    if bytes_per_us <= 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_us} bytes/µs")
    return lambda info: alpha_us + info.bytes / bytes_per_us


@dataclasses.dataclass(frozen=True)
class FusionResult:
    """Outcome of ``fuse_collectives``.

    Attributes:
      graph: the graph with fused collectives (unfused tasks keep their names).
      fused_to_originals: fused task name -> the original collective names it replaces.
      makespan_before_us: list-heuristic makespan of the input graph.
      makespan_after_us: list-heuristic makespan of the fused graph.
      evaluations: candidate graphs scheduled and evaluated.
      wall_time_s: total time.
    """

    graph: TaskGraph
    fused_to_originals: dict[str, tuple[str, ...]]
    makespan_before_us: float
    makespan_after_us: float
    evaluations: int
    wall_time_s: float


def fusion_key(task: Task) -> tuple | None:
    """What must be equal for two collectives to be fusible (``None``: not a collective)."""
    c = task.collective
    if c is None:
        return None
    return (c.op, c.groups_key, c.group_size, c.crosses_hosts, task.stream)


def _reaches(graph: TaskGraph, sources: set[int], targets: set[int]) -> bool:
    """Whether some node in ``targets`` is reachable from ``sources`` by a non-empty path."""
    seen = set()
    queue = deque(s for src in sources for s in graph.succs[src])
    while queue:
        v = queue.popleft()
        if v in targets:
            return True
        if v in seen:
            continue
        seen.add(v)
        queue.extend(graph.succs[v])
    return False


def fuse_collectives(
    graph: TaskGraph,
    cost_fn: CostFn,
    events: Sequence[Event] | None = None,
    max_evaluations: int | None = None,
    progress: bool = True,
) -> FusionResult:
    """Fuse interchangeable collectives where it shortens the (list-heuristic) schedule.

    Args:
      graph: the task graph.
      cost_fn: duration (µs) of a fused collective from its ``CollectiveInfo``; plug the
        cost model's function in here (``alpha_beta`` is a simple default).
      events: the schedule whose collective start order defines the walk (default:
        ``list_schedule(graph)``).
      max_evaluations: stop trying merges after this many candidate evaluations.
      progress: throttled INFO lines (collectives walked, evaluations, best makespan, elapsed).

    Returns:
      The fused graph, the mapping to original names, and the makespans.

    References: Concerto (ASPLOS'25) §4.5, Algorithm 1.
    """
    t0 = time.perf_counter()
    base_events = list_schedule(graph) if events is None else list(events)
    tl = timeline(graph, base_events)
    before = timeline(graph, list_schedule(graph)).makespan
    colls = sorted((i for i, t in enumerate(graph.tasks) if t.is_collective),
                   key=lambda i: (tl.start[i], i))
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, int] = {}  # fusion key -> index in buckets
    current, best = graph, before
    new_index = list(range(len(graph)))
    evaluations = 0
    prog = Progress(logger, "fusion", enabled=progress)
    for k, c in enumerate(colls):
        prog.update(collectives=f"{k}/{len(colls)}", evaluations=evaluations, best_makespan_us=best)
        key = fusion_key(graph.tasks[c])
        b = open_bucket.get(key)
        merged = False
        if b is not None and (max_evaluations is None or evaluations < max_evaluations):
            node_b, node_c = new_index[buckets[b][0]], new_index[c]
            if not _reaches(current, {node_b}, {node_c}) and not _reaches(current, {node_c}, {node_b}):
                trial = [list(x) for x in buckets]
                trial[b].append(c)
                cand, _, cand_index = build_fused_graph(graph, trial, cost_fn)
                makespan = timeline(cand, list_schedule(cand)).makespan
                evaluations += 1
                if makespan <= best + 1e-9:
                    buckets, current, best, new_index = trial, cand, makespan, cand_index
                    merged = True
        if not merged:
            buckets.append([c])
            open_bucket[key] = len(buckets) - 1
    fused, mapping, _ = build_fused_graph(graph, buckets, cost_fn)
    wall = time.perf_counter() - t0
    logger.info("fusion: %d collectives -> %d (%d fused groups), makespan %.1f -> %.1f µs, "
                "%d evaluations in %.2fs", len(colls), len(buckets), len(mapping), before, best,
                evaluations, wall)
    return FusionResult(fused, mapping, before, best, evaluations, wall)
