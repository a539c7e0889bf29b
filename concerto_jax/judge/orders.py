"""XLA's order on our task graph: map the order of one HLO module onto the tasks of another.

The fair comparison with XLA's latency hiding scheduler (docs/ARCHITECTURE.md F4) judges
XLA's final order and ours on ONE task graph, built from the module LHS
received. XLA's final module is the same program after LHS and a few later
passes; ``map_order`` lays its order onto the graph's tasks by instruction name
(XLA's ``scheduling_name`` metadata where present), keeps the graph's other
tasks where a base order (the after-LHS dump) had them, counts instructions
only the other module has, and repairs positions that would break a
dependency (``order_by_priority``).
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Sequence

from concerto_jax.taskgraph import Event, Phase
from hlo_passes.ir import ALIAS_OPCODES


@dataclasses.dataclass(frozen=True)
class MappedOrder:
    """An order of another module mapped onto a graph's tasks (``map_order``).

    Attributes:
      events: a valid schedule of the graph.
      mapped_events: graph events whose position came from the other module.
      total_events: events of the graph.
      extra: instructions of the other module (not aliases) the graph lacks.
      opcode_mismatch: instructions with the same name but a different opcode.
      repairs: events whose position had to move to respect the graph's dependencies.
    """

    events: tuple
    mapped_events: int
    total_events: int
    extra: tuple[str, ...]
    opcode_mismatch: tuple[str, ...]
    repairs: int

    @property
    def coverage_pct(self) -> float:
        return 100.0 * self.mapped_events / self.total_events if self.total_events else 100.0


def _finish_event(graph, i: int):

    return Event(i, Phase.DONE if graph.tasks[i].is_collective else Phase.RUN)


def _first_event(graph, i: int):

    return Event(i, Phase.START if graph.tasks[i].is_collective else Phase.RUN)


def _async_form(opcode: str) -> str:
    """``opcode`` with XLA's two spellings of an async fusion made one: the generic
    ``async-start``/``-done`` before its post-scheduling pipelines, ``fusion-start``/``-done``
    in its final module (jaxlib >= 0.11)."""
    return {"fusion-start": "async-start", "fusion-done": "async-done"}.get(opcode, opcode)


def order_by_priority(graph, key: dict) -> tuple[list, int]:
    """The valid schedule closest to ``key`` (event -> priority, lower first).

    A task's first event waits for its predecessors' last events and a DONE for its
    START; among ready events the lowest key goes first. Returns the events and how
    many of them sit elsewhere than in plain key order.
    """

    n = len(graph)
    remaining = [len(p) for p in graph.preds]
    heap: list = []
    for i in range(n):
        if remaining[i] == 0:
            e = _first_event(graph, i)
            heapq.heappush(heap, (key[e], i, e.phase.value, e))
    out = []
    while heap:
        _, i, _, e = heapq.heappop(heap)
        out.append(e)
        if e.phase is Phase.START:
            d = Event(i, Phase.DONE)
            heapq.heappush(heap, (key[d], i, d.phase.value, d))
            continue
        for s in graph.succs[i]:
            remaining[s] -= 1
            if remaining[s] == 0:
                f = _first_event(graph, s)
                heapq.heappush(heap, (key[f], s, f.phase.value, f))
    plain = sorted(key, key=lambda e: (key[e], e.task, e.phase.value))
    repairs = sum(a != b for a, b in zip(out, plain, strict=True))
    return out, repairs


_SCHEDULING_NAME = re.compile(r'scheduling_name="([^"]+)"')


def scheduling_name(inst) -> str:
    """The name LHS knew an instruction by: ``metadata={scheduling_name=...}`` where XLA wrote one, else its name."""
    m = _SCHEDULING_NAME.search(inst.metadata or "")
    return m.group(1) if m else inst.name


def map_order(module, built, base_events: Sequence | None = None) -> MappedOrder:
    """Map ``module``'s entry order onto the tasks of ``built`` (an ``HloTaskGraph``) by instruction name.

    Args:
      module: the other module (``hlo_passes`` IR), e.g. XLA's final scheduled module; an
        instruction is known by its ``scheduling_name`` metadata where XLA wrote one.
      built: the graph (``build_taskgraph`` of the before-LHS module).
      base_events: where tasks the other module lacks are placed (default ``built.events``:
        right after the preceding mapped event of that order).

    Returns:
      A ``MappedOrder`` whose ``events`` are a valid schedule of ``built.graph``.
    """

    graph = built.graph
    key: dict = {}
    extra: list[str] = []
    mismatch: list[str] = []
    own_opcode = {t.name: t.opcode for t in graph.tasks}
    pos = 0
    for inst in module.entry.instructions:
        name = scheduling_name(inst)
        if name in built.aliases or (name not in built.task_of and inst.opcode in ALIAS_OPCODES):
            continue
        i = built.task_of.get(name)
        if i is None:
            extra.append(name)
            continue
        task = graph.tasks[i]
        if task.is_collective:
            if inst.collective_kind != task.collective.op:
                mismatch.append(name)
        elif _async_form(own_opcode[name]) != _async_form(inst.opcode):
            mismatch.append(name)
        role = inst.async_role
        if not task.is_collective:
            phases = (Phase.RUN,)
        elif role == "start":
            phases = (Phase.START,)
        elif role == "done":
            phases = (Phase.DONE,)
        elif role == "update":
            continue
        else:  # synchronous form of the collective
            phases = (Phase.START, Phase.DONE)
        for ph in phases:
            ev = Event(i, ph)
            if ev not in key:
                key[ev] = float(pos)
                pos += 1
    mapped = len(key)
    last, k = -1.0, 0
    base = list(built.events if base_events is None else base_events)
    for ev in base:  # unmapped events: right after the preceding mapped event of the base order
        if ev in key:
            last, k = key[ev], 0
        else:
            k += 1
            key[ev] = last + k * 1e-4
    events, repairs = order_by_priority(graph, key)
    graph.check_schedule(events)
    total = sum(len(graph.events_of(i)) for i in range(len(graph)))
    return MappedOrder(tuple(events), mapped, total, tuple(extra), tuple(mismatch), repairs)


# ---------------------------------------------------------------------------------------- comparison


def planned_events(graph, events) -> list:
    """``events`` with every collective's START as early and DONE as late as dependencies allow."""
    key = {e: float(k) for k, e in enumerate(events)}
    last = {}  # task -> key of its last event
    for e in events:
        last[e.task] = key[e]
    first = {}
    for e in events:
        first.setdefault(e.task, key[e])
    for i, t in enumerate(graph.tasks):
        if not t.is_collective:
            continue
        ready = max((last[p] for p in graph.preds[i]), default=-1.0)
        key[Event(i, Phase.START)] = ready + 1e-3
        need = min((first[s] for s in graph.succs[i]), default=float(len(events)))
        key[Event(i, Phase.DONE)] = need - 1e-3
    out, _ = order_by_priority(graph, key)
    graph.check_schedule(out)
    return out
