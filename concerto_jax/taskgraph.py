"""Task graph: the scheduling view of one per-device program.

The HLO IR (``hlo_passes``) says *what* a program computes; a ``TaskGraph``
says what the schedulers and the simulator need to know about it: one task per
instruction (or per fused kernel), the stream it occupies, its duration on a
target, the bytes it produces, and its dependencies. Both the RCPSP scheduler
(``concerto_jax.scheduler``) and the simulator (``concerto_jax.simulator``)
consume this one structure, so that XLA's order and ours are always judged on
the same graph with the same costs.

A *schedule* is an order of events over the tasks:

* a compute task has one event, ``RUN``;
* a collective task has two, ``START`` (launch on a communication stream) and
  ``DONE`` (the compute stream waits for it), which is how XLA writes async
  collectives (``all-reduce-start``/``all-reduce-done``).

A synchronous collective is a ``START`` immediately followed by its ``DONE``.
Execution semantics of a schedule (implemented by the simulator): events are
issued in order; ``RUN`` occupies the compute stream; ``START`` enqueues the
collective on its communication stream once its operands are ready and the
stream is free; ``DONE`` blocks the compute stream until the collective ends.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Iterable, Sequence

COMPUTE_STREAM = 0
"""Index of the (single) compute stream; communication streams are 1, 2, ..."""


class TaskKind(enum.Enum):
    """What a task does on the device."""

    COMPUTE = "compute"  # a kernel (or a free op such as bitcast/tuple: duration 0)
    COLLECTIVE = "collective"  # all-reduce, all-gather, reduce-scatter, all-to-all, permute


class Phase(enum.Enum):
    """Which point of a task an event stands for."""

    RUN = "run"  # compute task
    START = "start"  # collective launched on its communication stream
    DONE = "done"  # compute stream waits for the collective


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """What makes two collectives interchangeable (and fusible).

    Attributes:
      op: HLO opcode without ``-start``/``-done`` (``all-reduce``, ``all-gather``, ...).
      bytes: payload bytes moved per device (the operand size for all-reduce and
        reduce-scatter, the result size for all-gather).
      group_size: number of devices in one replica group.
      groups_key: a hashable canonical form of the replica groups (and, where it
        matters, the reduction computation and dtype); collectives with the same
        ``(op, groups_key)`` may be fused.
      crosses_hosts: whether a group spans more than one host.
    """

    op: str
    bytes: int
    group_size: int
    groups_key: tuple = ()
    crosses_hosts: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One schedulable unit.

    Attributes:
      name: the instruction name in the HLO module (unique in the graph).
      kind: compute or collective.
      duration_us: time on its stream, in microseconds, at full speed.
      stream: ``COMPUTE_STREAM`` or a communication stream index (>= 1).
      out_bytes: bytes of the result; live from the task's start until its last
        user ends (used for the memory resource and peak-memory estimates).
      opcode: the HLO opcode, for reports.
      collective: set for collective tasks.
    """

    name: str
    kind: TaskKind
    duration_us: float
    stream: int = COMPUTE_STREAM
    out_bytes: int = 0
    opcode: str = ""
    collective: CollectiveInfo | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind is TaskKind.COLLECTIVE


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One point in a schedule: ``task`` (an index into ``TaskGraph.tasks``) at ``phase``."""

    task: int
    phase: Phase


class TaskGraphError(ValueError):
    """A task graph or schedule breaks an invariant (cycle, bad index, missing event)."""


class TaskGraph:
    """Tasks and their dependencies (a DAG).

    Invariants (checked by ``validate``): names are unique; ``preds[i]`` holds
    indices of other tasks; the graph is acyclic; collective tasks run on a
    communication stream (index >= 1) and compute tasks on ``COMPUTE_STREAM``.
    """

    __slots__ = ("tasks", "preds", "_succs", "_index")

    def __init__(self, tasks: Sequence[Task], preds: Sequence[Iterable[int]]):
        if len(tasks) != len(preds):
            raise TaskGraphError(f"{len(tasks)} tasks but {len(preds)} predecessor lists")
        self.tasks: list[Task] = list(tasks)
        self.preds: list[tuple[int, ...]] = [tuple(sorted(set(p))) for p in preds]
        self._succs: list[tuple[int, ...]] | None = None
        self._index: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def __repr__(self) -> str:
        n_coll = sum(t.is_collective for t in self.tasks)
        return f"TaskGraph({len(self.tasks)} tasks, {n_coll} collectives)"

    @property
    def succs(self) -> list[tuple[int, ...]]:
        if self._succs is None:
            out: list[list[int]] = [[] for _ in self.tasks]
            for i, ps in enumerate(self.preds):
                for p in ps:
                    out[p].append(i)
            self._succs = [tuple(s) for s in out]
        return self._succs

    def index(self, name: str) -> int:
        """Index of the task named ``name``."""
        if self._index is None:
            self._index = {t.name: i for i, t in enumerate(self.tasks)}
        return self._index[name]

    def topological_order(self) -> list[int]:
        """A topological order that keeps the given task order where it can (Kahn, min-index first)."""
        indeg = [len(p) for p in self.preds]
        heap = [i for i, d in enumerate(indeg) if d == 0]
        heapq.heapify(heap)
        order: list[int] = []
        succs = self.succs
        while heap:
            i = heapq.heappop(heap)
            order.append(i)
            for s in succs[i]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, s)
        if len(order) != len(self.tasks):
            stuck = [self.tasks[i].name for i, d in enumerate(indeg) if d > 0][:5]
            raise TaskGraphError(f"task graph has a cycle through (among others) {stuck}")
        return order

    def validate(self) -> None:
        """Raise ``TaskGraphError`` if an invariant of the class docstring does not hold."""
        n = len(self.tasks)
        names = [t.name for t in self.tasks]
        if len(set(names)) != n:
            dup = sorted({x for x in names if names.count(x) > 1})[:5]
            raise TaskGraphError(f"duplicate task names: {dup}")
        for i, ps in enumerate(self.preds):
            for p in ps:
                if not 0 <= p < n or p == i:
                    raise TaskGraphError(f"task {names[i]!r} has bad predecessor index {p}")
        for t in self.tasks:
            if t.is_collective and t.stream == COMPUTE_STREAM:
                raise TaskGraphError(f"collective {t.name!r} is on the compute stream")
            if not t.is_collective and t.stream != COMPUTE_STREAM:
                raise TaskGraphError(f"compute task {t.name!r} is on stream {t.stream}")
            if t.duration_us < 0:
                raise TaskGraphError(f"task {t.name!r} has negative duration {t.duration_us}")
        self.topological_order()

    def events_of(self, i: int) -> tuple[Event, ...]:
        """The events task ``i`` contributes to a schedule."""
        if self.tasks[i].is_collective:
            return (Event(i, Phase.START), Event(i, Phase.DONE))
        return (Event(i, Phase.RUN),)

    def synchronous_schedule(self, order: Sequence[int] | None = None) -> list[Event]:
        """Program order with every collective synchronous (START directly followed by DONE)."""
        order = self.topological_order() if order is None else order
        return [e for i in order for e in self.events_of(i)]

    def check_schedule(self, events: Sequence[Event]) -> None:
        """Raise ``TaskGraphError`` unless ``events`` is a valid schedule of this graph.

        Valid means: every task contributes exactly its events; a collective's
        START precedes its DONE; every task's first event comes after the last
        event (DONE for collectives, RUN for compute) of each of its predecessors.
        """
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        seen: set[tuple[int, Phase]] = set()
        for pos, e in enumerate(events):
            if not 0 <= e.task < len(self.tasks):
                raise TaskGraphError(f"event {pos} names task {e.task}, graph has {len(self.tasks)}")
            key = (e.task, e.phase)
            if key in seen:
                raise TaskGraphError(f"event {e} appears twice (at {pos})")
            if e.phase not in {x.phase for x in self.events_of(e.task)}:
                raise TaskGraphError(f"event {e} does not belong to task {self.tasks[e.task].name!r}")
            seen.add(key)
            first.setdefault(e.task, pos)
            last[e.task] = pos
        expected = sum(len(self.events_of(i)) for i in range(len(self.tasks)))
        if len(seen) != expected:
            missing = [self.tasks[i].name for i in range(len(self.tasks)) if i not in first][:5]
            raise TaskGraphError(f"schedule has {len(seen)} of {expected} events; missing e.g. {missing}")
        for i, t in enumerate(self.tasks):
            for p in self.preds[i]:
                if last[p] > first[i]:
                    raise TaskGraphError(
                        f"task {t.name!r} (event {first[i]}) is scheduled before its predecessor "
                        f"{self.tasks[p].name!r} finishes (event {last[p]})"
                    )
        # START before DONE: the first event of a collective must be its START.
        for pos, e in enumerate(events):
            if e.phase is Phase.DONE and first[e.task] == pos:
                raise TaskGraphError(f"collective {self.tasks[e.task].name!r} is DONE before START")


def build_fused_graph(
    graph: TaskGraph, buckets: Sequence[Sequence[int]], cost_fn
) -> tuple[TaskGraph, dict[str, tuple[str, ...]], list[int]]:
    """Replace each bucket of two or more collectives by one fused collective (its bytes the
    members' sum, its duration ``cost_fn(CollectiveInfo)``); the fuse_collectives pass and the
    combine-threshold estimate (``deviceless.thresholds``) both build their candidates with it.

    Returns:
      (fused graph, fused name -> original names, original index -> new index).
    """
    n = len(graph)
    leader = list(range(n))
    for b in buckets:
        if len(b) > 1:
            first = min(b)
            for i in b:
                leader[i] = first
    new_index = [-1] * n
    tasks: list[Task] = []
    mapping: dict[str, tuple[str, ...]] = {}
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(leader[i], []).append(i)
    for i in range(n):
        if leader[i] != i:
            continue
        new_index[i] = len(tasks)
        group = members[i]
        if len(group) == 1:
            tasks.append(graph.tasks[i])
            continue
        ts = [graph.tasks[j] for j in group]
        c0 = ts[0].collective
        info = dataclasses.replace(c0, bytes=sum(t.collective.bytes for t in ts))
        name = f"fused.{ts[0].name}.x{len(ts)}"
        mapping[name] = tuple(t.name for t in ts)
        tasks.append(dataclasses.replace(ts[0], name=name, duration_us=float(cost_fn(info)),
                                         out_bytes=sum(t.out_bytes for t in ts), collective=info))
    for i in range(n):
        new_index[i] = new_index[leader[i]]
    preds: list[set[int]] = [set() for _ in tasks]
    for i in range(n):
        me = new_index[i]
        for p in graph.preds[i]:
            if new_index[p] != me:
                preds[me].add(new_index[p])
    return TaskGraph(tasks, [sorted(p) for p in preds]), mapping, new_index
