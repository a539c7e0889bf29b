"""Decode task start times into an event order (paper §4.3) and repair orders to validity.

Given start times (from CP-SAT, or any timing), the compute tasks are ordered by
start; each collective's ``START`` is brought ahead of the first compute task that
occupies the GPU at or after the collective's start (a collective must be launched
before the compute it overlaps begins), but not ahead of a compute task that starts
before its collective inputs are done (that would make the compute stream wait);
each ``DONE`` goes right before the first consumer of the collective (the latest point
that respects the order), or at the end when it has none. A topological repair
(Kahn's algorithm with the desired position as priority) then makes the order valid
whatever the input times; for times that respect precedence it changes nothing.

References: Concerto (ASPLOS'25) §4.3 (decoding the RCPSP solution).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from concerto_jax.taskgraph import Event, Phase, TaskGraph

_INF = float("inf")


def decode(graph: TaskGraph, start: Sequence[float], end: Sequence[float] | None = None) -> list[Event]:
    """Turn per-task start times into a valid event order.

    Args:
      graph: the task graph.
      start: start time of each task (any unit).
      end: end time of each task; default ``start + duration_us`` (the unit must then be µs).

    Returns:
      A schedule that ``TaskGraph.check_schedule`` accepts.

    References: Concerto (ASPLOS'25) §4.3.
    """
    tasks = graph.tasks
    n = len(tasks)
    if end is None:
        end = [start[i] + tasks[i].duration_us for i in range(n)]
    topo_pos = [0] * n
    for k, i in enumerate(graph.topological_order()):
        topo_pos[i] = k
    comp = [i for i in range(n) if not tasks[i].is_collective]
    comp.sort(key=lambda i: (start[i], end[i] > start[i], topo_pos[i]))
    comp_start = [start[i] for i in comp]
    pref_end = []
    m = -_INF
    for i in comp:
        m = max(m, end[i])
        pref_end.append(m)
    key: dict[tuple[int, Phase], tuple[float, ...]] = {}
    for j, i in enumerate(comp):
        key[(i, Phase.RUN)] = (j, 2.0, 0.0, 0.0, topo_pos[i])
    preds = graph.preds
    for c in range(n):
        if not tasks[c].is_collective:
            continue
        s = start[c]
        pos = min(bisect.bisect_right(pref_end, s), bisect.bisect_right(comp_start, s))
        inputs_done = max((end[p] for p in preds[c] if tasks[p].is_collective), default=-_INF)
        pos = max(pos, bisect.bisect_left(comp_start, inputs_done))
        key[(c, Phase.START)] = (pos, 0.0, s, end[c], topo_pos[c])
    succs = graph.succs
    for c in range(n):
        if not tasks[c].is_collective:
            continue
        best = None
        for u in succs[c]:
            k = key[(u, Phase.START if tasks[u].is_collective else Phase.RUN)]
            if best is None or k < best:
                best = k
        if best is None:
            key[(c, Phase.DONE)] = (_INF, 3.0, end[c], 0.0, topo_pos[c])
        elif best[1] == 2.0:
            key[(c, Phase.DONE)] = (best[0], 1.0, end[c], 0.0, topo_pos[c])
        else:
            key[(c, Phase.DONE)] = best[:4] + (best[4] - 0.5,)
    return order_by_keys(graph, key)


def decode_window(
    graph: TaskGraph,
    window: Sequence[Event],
    start: Sequence[float],
    end: Sequence[float],
) -> list[Event]:
    """Re-order the events of one contiguous window of a schedule by ``decode``'s rules.

    ``window`` is a slice ``events[p:q]`` of a valid schedule; the result is a
    permutation of it such that ``events[:p] + result + events[q:]`` is valid too: the
    keys are those of ``decode`` computed over the window's events only (compute tasks
    by start, a collective's ``START`` before the first window compute task it overlaps,
    its ``DONE`` before its first consumer in the window, else at the window's end), and
    a Kahn pass over the dependencies *between window events* repairs the order (events
    before the window stay before it, those after stay after). Cost O(w log w) for a
    window of w events, whatever the graph size; this is what makes odd-even blocks
    cheap to splice on large graphs.

    References: Concerto (ASPLOS'25) §4.3 (decoding), §4.4 (odd-even windows).
    """
    tasks = graph.tasks
    preds = graph.preds
    succs = graph.succs
    run_, st_, dn_ = Phase.RUN, Phase.START, Phase.DONE
    pos_in = {(e.task, e.phase): k for k, e in enumerate(window)}
    comp = [e.task for e in window if e.phase is run_]
    comp.sort(key=lambda i: (start[i], end[i] > start[i], pos_in[(i, run_)]))
    comp_start = [start[i] for i in comp]
    pref_end = []
    m = -_INF
    for i in comp:
        m = max(m, end[i])
        pref_end.append(m)
    key: dict[tuple[int, Phase], tuple] = {}
    for j, i in enumerate(comp):
        key[(i, run_)] = (j, 2.0, 0.0, 0.0, pos_in[(i, run_)])
    for e in window:
        if e.phase is not st_:
            continue
        c = e.task
        s = start[c]
        pos = min(bisect.bisect_right(pref_end, s), bisect.bisect_right(comp_start, s))
        inputs_done = max((end[p] for p in preds[c] if tasks[p].is_collective), default=-_INF)
        pos = max(pos, bisect.bisect_left(comp_start, inputs_done))
        key[(c, st_)] = (pos, 0.0, s, end[c], pos_in[(c, st_)])
    for e in window:
        if e.phase is not dn_:
            continue
        c = e.task
        best = None
        for u in succs[c]:
            k = key.get((u, st_ if tasks[u].is_collective else run_))
            if k is not None and (best is None or k < best):
                best = k
        if best is None:
            key[(c, dn_)] = (_INF, 3.0, end[c], 0.0, pos_in[(c, dn_)])
        elif best[1] == 2.0:
            key[(c, dn_)] = (best[0], 1.0, end[c], 0.0, pos_in[(c, dn_)])
        else:
            key[(c, dn_)] = best[:4] + (best[4] - 0.5,)
    # Kahn over the dependencies between window events only.
    missing: dict[tuple[int, Phase], int] = {}
    users: dict[tuple[int, Phase], list[tuple[int, Phase]]] = {}
    for e in window:
        ev = (e.task, e.phase)
        if e.phase is dn_:
            deps = [(e.task, st_)]
        else:
            deps = [(p, dn_ if tasks[p].is_collective else run_) for p in preds[e.task]]
        cnt = 0
        for d in deps:
            if d in pos_in:
                cnt += 1
                users.setdefault(d, []).append(ev)
        missing[ev] = cnt
    heap = [(key[ev], ev[0], ev[1].value, ev) for ev, c in missing.items() if c == 0]
    heapq.heapify(heap)
    out: list[Event] = []
    while heap:
        _, _, _, ev = heapq.heappop(heap)
        out.append(Event(ev[0], ev[1]))
        for u in users.get(ev, ()):
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(heap, (key[u], u[0], u[1].value, u))
    if len(out) != len(window):
        raise AssertionError("decode_window: the window is not a slice of a valid schedule")
    return out


def order_by_keys(graph: TaskGraph, key: dict[tuple[int, Phase], tuple]) -> list[Event]:
    """The valid event order closest to ascending ``key`` (Kahn, smallest key first).

    Dependencies: a task's first event (``RUN``/``START``) after the last event of each
    predecessor (``RUN``/``DONE``); a collective's ``DONE`` after its ``START``.
    """
    tasks = graph.tasks
    succs = graph.succs
    n = len(tasks)
    missing = [len(p) for p in graph.preds]
    heap = []
    for i in range(n):
        if missing[i] == 0:
            ph = Phase.START if tasks[i].is_collective else Phase.RUN
            heap.append((key[(i, ph)], i, ph))
    heapq.heapify(heap)
    out: list[Event] = []
    while heap:
        _, i, ph = heapq.heappop(heap)
        out.append(Event(i, ph))
        if ph is Phase.START:
            heapq.heappush(heap, (key[(i, Phase.DONE)], i, Phase.DONE))
            continue
        for s in succs[i]:
            missing[s] -= 1
            if missing[s] == 0:
                sp = Phase.START if tasks[s].is_collective else Phase.RUN
                heapq.heappush(heap, (key[(s, sp)], s, sp))
    if len(out) != sum(2 if t.is_collective else 1 for t in tasks):
        raise AssertionError("order_by_keys: graph has a cycle")
    return out


def order_keys(events: Sequence[Event]) -> dict[tuple[int, Phase], tuple]:
    """Keys that reproduce ``events`` through ``order_by_keys``."""
    return {(e.task, e.phase): (float(pos), 0.0, 0.0, 0.0, 0.0) for pos, e in enumerate(events)}
