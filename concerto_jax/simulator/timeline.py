"""The full-speed timeline of an event order: the scheduler's model and objective.

Every task runs at its full duration (no slowdown while collectives are in flight: that is
``simulate``'s interference replay, ``engine.py``). The scheduler judges every candidate
order by ``makespan`` here, in its inner loops.

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

from concerto_jax.taskgraph import Event, Phase, TaskGraph


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Start and end time (µs) of every task under the execution semantics."""

    start: tuple[float, ...]
    end: tuple[float, ...]
    makespan: float


def timeline(graph: TaskGraph, events: Sequence[Event], check: bool = False) -> Timeline:
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


def makespan(graph: TaskGraph, events: Sequence[Event]) -> float:
    """Makespan (µs) of ``events`` under the semantics of the module docstring.

    References: Concerto (ASPLOS'25) §4.3.
    """
    return timeline(graph, events).makespan


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


class IncrementalTimeline:
    """A schedule with its timeline, where a window of events can be re-ordered cheaply.

    ``try_window(p, q, new)`` replaces ``events[p:q]`` by ``new`` (a permutation of it),
    re-simulates from position ``p`` only, starting from the recorded state there (the
    compute clock after each event and the communication streams' free times), and
    stops as soon as the state matches the old run again: same compute clock, same
    stream free times, and no task whose end changed is read at or after that point.
    Events before ``p`` are untouched, so the result is exact: the same timeline as
    ``timeline`` on the new order (``check`` in tests). The change is kept only if the
    whole-graph makespan does not exceed ``max_makespan``; otherwise nothing changes.

    Cost per call: O(w + m) for a window of w events and m later events whose times
    actually move (plus O(n) list copies done in C), instead of O(n) Python work for a
    full decode and simulate.

    References: Concerto (ASPLOS'25) §4.4 (odd-even windows on large graphs).
    """

    def __init__(self, graph: TaskGraph, events: Sequence[Event]):
        self.graph = graph
        self.events = list(events)
        n = len(graph)
        tasks = graph.tasks
        self._streams = sorted({t.stream for t in tasks if t.is_collective})
        self.first_pos = [0] * n  # position of the RUN / START event
        self.last_pos = [0] * n  # position of the RUN / DONE event
        self.last_use = [-1] * n  # upper bound on the last position that reads end[i]
        for q, e in enumerate(self.events):
            if e.phase is Phase.DONE:
                self.last_pos[e.task] = q
                if q > self.last_use[e.task]:
                    self.last_use[e.task] = q
            else:
                self.first_pos[e.task] = q
                if e.phase is Phase.RUN:
                    self.last_pos[e.task] = q
                for p in graph.preds[e.task]:
                    if q > self.last_use[p]:
                        self.last_use[p] = q
        start = [0.0] * n
        end = [0.0] * n
        clock = [0.0] * len(self.events)
        self._run(self.events, 0, 0.0, {}, start, end, clock)
        self.start, self.end, self.clock = start, end, clock
        self.makespan = max(max(end, default=0.0), clock[-1] if clock else 0.0)

    def timeline(self) -> Timeline:
        return Timeline(tuple(self.start), tuple(self.end), self.makespan)

    def _free_before(self, events: Sequence[Event], end: Sequence[float], p: int) -> dict[int, float]:
        """Free time of each communication stream after ``events[:p]`` (the last START on it)."""
        tasks = self.graph.tasks
        want = set(self._streams)
        free: dict[int, float] = {}
        q = p - 1
        while want and q >= 0:
            e = events[q]
            if e.phase is Phase.START:
                k = tasks[e.task].stream
                if k in want:
                    free[k] = end[e.task]
                    want.discard(k)
            q -= 1
        return free

    def _run(self, seq, q0, t, free, start, end, clock, stop_check=None) -> tuple[float, int]:
        """Simulate ``seq`` as positions ``q0, q0+1, ...``; return (clock, positions done)."""
        tasks = self.graph.tasks
        preds = self.graph.preds
        run, st = Phase.RUN, Phase.START
        q = q0
        for e in seq:
            if stop_check is not None and stop_check(q, t, free):
                return t, q - q0
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
            clock[q] = t
            q += 1
        return t, q - q0

    def try_window(self, p: int, q: int, new: Sequence[Event], max_makespan: float) -> bool:
        """Replace ``events[p:q]`` by ``new`` if the makespan stays ``<= max_makespan``."""
        if len(new) != q - p:
            raise ValueError(f"window of {q - p} events replaced by {len(new)}")
        old_end = self.end
        start = list(self.start)
        end = list(old_end)
        clock = list(self.clock)
        t = self.clock[p - 1] if p > 0 else 0.0
        free = self._free_before(self.events, old_end, p)
        t, _ = self._run(new, p, t, free, start, end, clock)
        # Tasks whose end moved, and the last position that reads one of them.
        horizon = -1
        last_use = self.last_use
        for e in new:
            i = e.task
            if end[i] != old_end[i] and last_use[i] > horizon:
                horizon = last_use[i]
        old_free = self._free_before(self.events, old_end, q)
        old_clock = self.clock
        tasks = self.graph.tasks
        preds = self.graph.preds
        events = self.events
        n_ev = len(events)
        run, st = Phase.RUN, Phase.START
        # The unchanged suffix, until the state matches the old run's again.
        pos = q
        while pos < n_ev:
            if pos > horizon and t == old_clock[pos - 1] and free == old_free:
                break
            e = events[pos]
            i = e.task
            ph = e.phase
            if ph is run:
                s = t
                for pr in preds[i]:
                    if end[pr] > s:
                        s = end[pr]
                start[i] = s
                t = end[i] = s + tasks[i].duration_us
            elif ph is st:
                s = t
                for pr in preds[i]:
                    if end[pr] > s:
                        s = end[pr]
                k = tasks[i].stream
                f = free.get(k, 0.0)
                if f > s:
                    s = f
                start[i] = s
                free[k] = end[i] = s + tasks[i].duration_us
                old_free[k] = old_end[i]
            elif end[i] > t:
                t = end[i]
            clock[pos] = t
            if end[i] != old_end[i] and last_use[i] > horizon:
                horizon = last_use[i]
            pos += 1
        if pos == n_ev:
            final_clock = t
        else:
            final_clock = old_clock[-1]
        makespan = max(max(end, default=0.0), final_clock)
        if makespan > max_makespan:
            return False
        self.events[p:q] = list(new)
        for x, e in enumerate(new, start=p):
            i = e.task
            if e.phase is Phase.DONE:
                self.last_pos[i] = x
                if x > last_use[i]:
                    last_use[i] = x
            else:
                self.first_pos[i] = x
                if e.phase is Phase.RUN:
                    self.last_pos[i] = x
                for pr in self.graph.preds[i]:
                    if x > last_use[pr]:
                        last_use[pr] = x
        self.start, self.end, self.clock = start, end, clock
        self.makespan = makespan
        return True
