"""Critical collectives: those whose time the schedule cannot cover.

Two tests, the paper's first:

1. **Predecessor / successor / independent rule** (Concerto §5.1). For a
   collective task D of a ``TaskGraph``, the other tasks split into its
   predecessors P (transitive), successors S and the independent ones I. No
   order can overlap D with P or S, so at most the compute of I hides it, and
   I's own collectives compete for communication. The paper calls D critical
   when ``sum(compute in I) - sum(comm in I) < time(D)``, with exposed time
   ``time(D) - max(0, slack)`` (``bound_exposed_us``).
2. **Simulated schedule** (the decision, ``criticality="schedule"``). Rule 1
   lets every collective count the whole of I, though one kernel hides one
   collective at a time: on a full train step the other layers' weight-gradient
   GEMMs and the optimizer count as independent of every all-reduce, so rule 1
   declares none critical while the schedules leave a third of the step
   exposed. Conversely it subtracts every independent collective, also those
   on other communication streams, so on ZeRO-3 over 2 hosts it flags 52
   collectives that the simulated schedule hides completely. So rule 1 is
   computed first and reported (``rule``: ``"psi+schedule"`` where both agree),
   and the schedule decides: the graph is scheduled by the schedule pass's
   scheduler (``concerto_jax.scheduler.schedule``) and simulated, and the
   collective's *exposed* time is the time the compute stream stalls at its
   DONE (``exposed_by_schedule``). The stalls of all collectives sum to the
   step's idle compute time, so no exposure is counted twice.

D is critical when its exposed time exceeds
``max(min_exposed_us, min_exposed_frac * time(D))`` (the pass's defaults:
1 µs and 5 %, ``DecomposeOptions``).

References: Concerto (ASPLOS'25) §5.1, critical communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from concerto_jax.taskgraph import Event, Phase, TaskGraph

MIN_EXPOSED_US = 1.0
"""Default absolute threshold of the critical test (µs of simulated stall)."""
MIN_EXPOSED_FRAC = 0.05
"""Default relative threshold: the stall must also exceed this share of the collective's time."""


@dataclasses.dataclass(frozen=True)
class Criticality:
    """One collective's slack under the predecessor / successor / independent rule.

    Attributes:
      task: task index in the graph.
      name: the task's (instruction's) name.
      time_us: the collective's duration.
      independent_compute_us: compute time of the tasks independent of it.
      independent_comm_us: collective time of the tasks independent of it.
      scheduled_exposed_us: the compute stream's stall at the collective's DONE in the
        simulated schedule (None: judged by the P/S/I rule alone).
      exposed_us: the stall (or, without a schedule, ``bound_exposed_us``); the ranking key.
      min_exposed_us: absolute threshold of the critical test.
      min_exposed_frac: threshold relative to ``time_us``.
    """

    task: int
    name: str
    time_us: float
    independent_compute_us: float
    independent_comm_us: float
    scheduled_exposed_us: float | None = None
    min_exposed_us: float = 0.0
    min_exposed_frac: float = 0.0

    @property
    def slack_us(self) -> float:
        return self.independent_compute_us - self.independent_comm_us

    @property
    def bound_exposed_us(self) -> float:
        """Exposed time every schedule leaves (P/S/I rule): ``max(0, time - max(0, slack))``."""
        return max(0.0, self.time_us - max(0.0, self.slack_us))

    @property
    def exposed_us(self) -> float:
        """The simulated schedule's stall; without a schedule, the P/S/I estimate."""
        if self.scheduled_exposed_us is None:
            return self.bound_exposed_us
        return self.scheduled_exposed_us

    @property
    def psi_critical(self) -> bool:
        """The paper's rule: independent compute minus independent comm below ``time``."""
        return self.slack_us < self.time_us

    @property
    def critical(self) -> bool:
        threshold = max(self.min_exposed_us, self.min_exposed_frac * self.time_us)
        if self.scheduled_exposed_us is None:  # the paper's rule alone
            return self.psi_critical and self.bound_exposed_us > threshold
        return self.scheduled_exposed_us > threshold

    @property
    def rule(self) -> str:
        """``"psi+schedule"`` (both tests), ``"schedule"`` (the schedule alone), ``"psi"``
        (the rule alone: no schedule was judged) or ``"hidden"``."""
        if not self.critical:
            return "hidden"
        if self.scheduled_exposed_us is None:
            return "psi"
        return "psi+schedule" if self.psi_critical else "schedule"


def exposed_by_schedule(graph: TaskGraph, events: Sequence[Event], timings) -> dict[int, float]:
    """``{collective task: compute-stream stall at its DONE}`` of one simulated schedule.

    Args:
      graph: the task graph.
      events: the schedule that was simulated.
      timings: the simulation's per-task timings (``SimResult.timings``, graph order).

    In a valid schedule a compute task waits only for a DONE (its compute
    predecessors ran before it on the one stream), so these stalls partition
    the compute stream's idle time.
    """
    now = 0.0
    out: dict[int, float] = {}
    for ev in events:
        t = timings[ev.task]
        if ev.phase is Phase.RUN:
            now = max(now, t.end_us)
        elif ev.phase is Phase.DONE:
            out[ev.task] = max(0.0, t.end_us - now)
            now = max(now, t.end_us)
    return out


def _closure(graph: TaskGraph, forward: bool) -> list[int]:
    """Bitsets (Python ints) of transitive predecessors (or successors) of every task."""
    order = graph.topological_order()
    if forward:
        order = order[::-1]
    nbrs = graph.succs if forward else graph.preds
    out = [0] * len(graph)
    for i in order:
        acc = 0
        for j in nbrs[i]:
            acc |= out[j] | (1 << j)
        out[i] = acc
    return out


def _mask(bits: int, n: int) -> np.ndarray:
    raw = bits.to_bytes((n + 7) // 8, "little")
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[:n].astype(bool)


def find_critical(graph: TaskGraph, *, only_critical: bool = True,
                  launch_us: float = 0.0, scheduled_exposed: dict[int, float] | None = None,
                  min_exposed_us: float = 0.0,
                  min_exposed_frac: float = 0.0) -> list[Criticality]:
    """The collectives of ``graph`` with their slack (critical ones only by default).

    Args:
      graph: a costed task graph.
      only_critical: drop the collectives whose independent work covers them.
      launch_us: per-kernel launch overhead to leave out of the independent compute. On
        the unfused post-SPMD graph every small op (a constant's broadcast, a one-hot
        compare, an optimizer-state scale) costs at least one launch; hundreds of them
        are independent of a forward all-reduce and, counted whole, "cover" it, though
        XLA fuses them into a few kernels. Measured on GPT tiny TP: 571 µs of
        independent compute against a 10.8 µs all-reduce, almost all of it launches.
      scheduled_exposed: ``exposed_by_schedule`` of a simulated schedule of ``graph``: it
        decides (the P/S/I figures are still computed and reported); None: the P/S/I
        rule alone decides.
      min_exposed_us: absolute threshold of the critical test (µs).
      min_exposed_frac: threshold relative to the collective's time.

    Returns:
      ``Criticality`` records, most exposed first.
    """
    n = len(graph)
    colls = [i for i, t in enumerate(graph.tasks) if t.is_collective]
    if not colls:
        return []
    anc, desc = _closure(graph, False), _closure(graph, True)
    dur = np.array([t.duration_us for t in graph.tasks])
    is_comm = np.array([t.is_collective for t in graph.tasks])
    work = np.where(is_comm, dur, np.maximum(dur - launch_us, 0.0))
    out = []
    for d in colls:
        dependent = _mask(anc[d] | desc[d] | (1 << d), n)
        indep = ~dependent
        sched = None if scheduled_exposed is None else float(scheduled_exposed.get(d, 0.0))
        rec = Criticality(d, graph.tasks[d].name, float(dur[d]),
                          float(work[indep & ~is_comm].sum()), float(dur[indep & is_comm].sum()),
                          sched, min_exposed_us, min_exposed_frac)
        if rec.critical or not only_critical:
            out.append(rec)
    out.sort(key=lambda r: -r.exposed_us)
    return out
