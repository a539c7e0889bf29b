"""Schedule and simulate one order of one task graph: the judge every pass, the guard and the
bench call."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax import scheduler
from concerto_jax.hlo_taskgraph import HloTaskGraph
from concerto_jax.scheduler import ScheduleOptions, ScheduleResult, peak_memory
from concerto_jax.simulator import SimOptions, SimResult, simulate, timeline
from concerto_jax.taskgraph import Event, TaskGraph


@dataclasses.dataclass(frozen=True)
class Judgement:
    """One order of one task graph, judged (``judge_graph``).

    Attributes:
      graph: the task graph judged.
      events: the order judged: the scheduler's (``schedule`` given) or the given one.
      schedule: how the scheduler found ``events``; None when the given order was judged as is.
      sim: the replay with interference (``simulator.simulate``); None when not asked.
      built: the HLO task graph ``graph`` came from (``judge_computation``), else None.
    """

    graph: TaskGraph
    events: tuple[Event, ...]
    schedule: ScheduleResult | None = None
    sim: SimResult | None = None
    built: HloTaskGraph | None = None

    def makespan_us(self) -> float:
        """Full-speed makespan (the scheduler's objective): ``schedule.makespan_us``, else
        ``simulator.makespan`` of ``events``."""
        if self.schedule is not None:
            return self.schedule.makespan_us
        return timeline(self.graph, self.events).makespan

    def peak_bytes(self) -> int:
        """Peak live bytes of ``events``' full-speed timeline (``scheduler.peak_memory``)."""
        tl = timeline(self.graph, self.events)
        return peak_memory(self.graph, tl.start, tl.end)


def judge_graph(graph: TaskGraph, events: Sequence[Event], *, schedule: ScheduleOptions | None = None,
                sim: SimOptions | None = None, built: HloTaskGraph | None = None) -> Judgement:
    """Schedule and simulate one order of a task graph.

    ``events`` is the order judged and, with ``schedule``, the scheduler's initial order
    (``scheduler.schedule(graph, schedule, initial=events)``: never slower than it). With
    ``sim`` the judged order is replayed by ``simulator.simulate(graph, events, sim)``.
    """
    result = None
    if schedule is not None:
        result = scheduler.schedule(graph, schedule, initial=events)
        events = result.events
    return Judgement(graph, tuple(events), result, None if sim is None else simulate(graph, events, sim),
                     built)
