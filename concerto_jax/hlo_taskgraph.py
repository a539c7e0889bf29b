"""HLO module (``hlo_passes`` IR) -> ``TaskGraph`` with costs, plus the module's own order as a schedule.

This is the single bridge between the IR and the scheduling view: XLA's order
(read from its scheduled module) and ours are judged on the graph built here.

* An async pair (``all-reduce-start``/``-done``, ``all-gather-*``,
  ``collective-permute-*``, generic ``async-start``/``async-done`` wrapping a
  collective, ``send``/``recv``) becomes one collective task whose ``START``
  and ``DONE`` events sit at the start's and the done's positions.
* A synchronous collective becomes one collective task with ``START`` and
  ``DONE`` adjacent.
* A collective kernel fusion (XLA:GPU >= 0.11 runs small all-reduces as Triton
  kernels: a ``fusion`` whose root is the all-reduce, synchronous, as
  ``fusion-start``/``-done``, or wrapped in ``async-start``) is a collective like
  the others, costed as that kernel (``CostModel.all_reduce_kernel``), not NCCL.
* The start of an async compute pair (a loop body's dynamic-slice fusion
  wrapped by XLA >= 0.11) is its wrapped kernel; its done an alias of it
  (folded, or a free task of 0 bytes).
* Every other instruction is a compute task costed by ``CostModel.compute_us``
  (fusions walk their fused computation). Pure aliases (``bitcast``,
  ``get-tuple-element``, ``tuple``, ``opt-barrier``) are folded by default:
  their users depend directly on the tasks they alias, so buffer lifetimes
  (peak memory) follow the real buffers.
* Dependencies come from operands and ``control-predecessors``.

For an unscheduled module the text order is a valid order (operands are
defined before use), so the same function gives program order.

Any computation that runs as a sequence of kernels can be built, not only the
entry (``computation=``): ``while`` bodies and conditions, ``conditional``
branches, ``call`` targets (``hlo_passes.ir.loops.schedulable_computations``). A
control-flow instruction (``while``/``conditional``/``call``) is one compute
task whose duration comes from its callees' own schedules (``nested_us``,
computed bottom-up by ``control_flow_durations``: a while costs
``trips x (body + condition) + condition``); without it, the cost model's
flat estimate is used (which ignores the collectives inside). The graph of a
while body carries its ``LoopInfo`` (trip count, carried values and their
bytes), and its parameter (the carried tuple) stays live until the root: the
loop state is held for the whole iteration.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping

from concerto_jax.costmodel.hlo_ops import OpInfoCache, array_leaves, op_info
from concerto_jax.costmodel.model import CostModel
from concerto_jax.taskgraph import CollectiveInfo, Event, Phase, Task, TaskGraph, TaskKind
from hlo_passes.ir import (
    ALIAS_OPCODES,
    LoopInfo,
    analyze_while,
    control_flow_callees,
    device_groups,
)

log = logging.getLogger(__name__)

_SYNC_COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                               "collective-permute", "collective-broadcast", "ragged-all-to-all"})


@dataclasses.dataclass(frozen=True)
class HloTaskGraph:
    """A task graph built from an HLO module.

    Attributes:
      graph: the tasks (costed) and dependencies.
      events: the module's own order of the entry computation as a schedule.
      task_of: instruction name -> task index (both members of an async pair map
        to their task; folded aliases are absent).
      aliases: folded instruction name -> the task indices it aliases.
      module_name: the module's name.
      computation: the computation the graph was built from.
      loop: for a while body or condition, the loop it belongs to (trip count,
        carried values and their bytes); None otherwise.
    """

    graph: TaskGraph
    events: list[Event]
    task_of: dict[str, int]
    aliases: dict[str, tuple[int, ...]]
    module_name: str = ""
    computation: str = ""
    loop: LoopInfo | None = None


def _is_async_compute_done(inst) -> bool:
    """Whether ``inst`` is the done (or an update) of an async compute pair (``async-start`` of a
    non-collective op, ``fusion-start``)."""
    if inst.async_role not in ("done", "update"):
        return False
    start = inst.async_start()
    return start is not None and start.opcode in ("async-start", "fusion-start")


def _collective_of(inst):
    """The instruction carrying the collective's attributes (the wrapped one for generic async
    and for collective kernel fusions)."""
    return inst.collective_op or inst


def _payload_bytes(kind: str, start, done) -> int:
    if kind == "all-gather":
        leaves = array_leaves(done.shape)
        return leaves[-1].bytes if leaves else 0
    coll = _collective_of(start)
    if kind == "ragged-all-to-all":
        # operands: input, output buffer, offsets and sizes: what it can send is the input
        return sum(a.bytes for a in array_leaves(coll.operands[0].shape)) if coll.operands else 0
    return sum(a.bytes for o in coll.operands for a in array_leaves(o.shape))


def default_stream(kind: str) -> int:
    """All collectives on communication stream 1 (XLA:GPU issues async collectives on one stream)."""
    return 1


def loops_of(module) -> dict[str, LoopInfo]:
    """Body and condition name -> ``LoopInfo`` of the while running them."""
    out: dict[str, LoopInfo] = {}
    for inst in module.instructions():
        if inst.opcode == "while":
            info = analyze_while(inst)
            out.setdefault(info.body, info)
            out.setdefault(info.condition, info)
    return out


def control_flow_durations(comp, makespan_us: Mapping[str, float],
                           on_unknown_trips: Callable[[LoopInfo], None] | None = None) -> dict[str, float]:
    """Duration of each ``while``/``conditional``/``call`` of ``comp`` from its callees' makespans.

    Args:
      comp: the computation holding the instructions.
      makespan_us: computation name -> makespan of one run of it (its schedule).
      on_unknown_trips: called with the ``LoopInfo`` of a while whose trip count is
        unknown (it is then costed as one iteration).

    Returns:
      Instruction name -> duration (µs); instructions whose callees are not all in
      ``makespan_us`` are left out.
    """
    out: dict[str, float] = {}
    for inst in comp.instructions:
        callees = control_flow_callees(inst)
        if not callees or any(c.name not in makespan_us for c in callees):
            continue
        if inst.opcode == "while":
            info = analyze_while(inst)
            trips = info.trip_count
            if trips is None:
                if on_unknown_trips is not None:
                    on_unknown_trips(info)
                trips = 1
            body, cond = makespan_us[info.body], makespan_us[info.condition]
            out[inst.name] = trips * (body + cond) + cond
        elif inst.opcode == "conditional":
            out[inst.name] = max(makespan_us[c.name] for c in callees)
        else:
            out[inst.name] = sum(makespan_us[c.name] for c in callees)
    return out


def with_durations(hg: HloTaskGraph, durations: Mapping[str, float]) -> TaskGraph:
    """``hg.graph`` with the tasks of the named instructions given other durations (µs)."""
    tasks = list(hg.graph.tasks)
    for name, us in durations.items():
        i = hg.task_of.get(name)
        if i is not None:
            tasks[i] = dataclasses.replace(tasks[i], duration_us=us)
    return TaskGraph(tasks, hg.graph.preds)


def build_taskgraph(module, cost_model: CostModel, *, fold_aliases: bool = True,
                    stream_of: Callable[[str], int] = default_stream, computation=None,
                    nested_us: Mapping[str, float] | None = None,
                    loop: LoopInfo | None = None,
                    durations_us: Mapping[str, float] | None = None,
                    infos: OpInfoCache | None = None, check: bool = True) -> HloTaskGraph:
    """Build the costed task graph of one computation of ``module`` and its order.

    Args:
      module: an ``hlo_passes`` ``HloModule`` (scheduled or not).
      cost_model: gives compute and collective times on the target.
      fold_aliases: fold ``ALIAS_OPCODES`` into their users' dependencies.
      stream_of: communication stream (>= 1) of a collective kind.
      computation: the computation (object or name); default the entry.
      nested_us: instruction name -> duration overriding the cost model, for
        control-flow instructions (see ``control_flow_durations``).
      loop: the loop ``computation`` is the body or condition of (default: looked
        up with ``loops_of``). In a body graph, the carried tuple (the parameter)
        stays live until the root.
      durations_us: instruction name -> duration overriding the cost model for any
        compute instruction (e.g. ``costmodel.fused.fused_costs(...).us``: each
        post-SPMD instruction's share of the XLA kernel it is fused into);
        ``nested_us`` wins where both name an instruction. Collectives and folded
        aliases are not affected.
      infos: the module's ``OpInfoCache``, where the caller builds the same computation under
        several cost models (the cost model's view of each instruction is made once).
      check: validate the graph and its order (skip only for a graph already built and checked
        from the same module under another cost model: the structure does not depend on costs).

    Returns:
      An ``HloTaskGraph``; ``events`` is the computation's order.
    """
    if computation is None:
        entry = module.entry
    elif isinstance(computation, str):
        entry = module.computation(computation)
    else:
        entry = computation
    if loop is None and not entry.is_entry:
        loop = loops_of(module).get(entry.name)
    nested = {**(durations_us or {}), **(nested_us or {})}
    num_devices = module.num_devices
    tasks: list[Task] = []
    preds: list[set[int]] = []
    events: list[Event] = []
    task_of: dict[str, int] = {}
    aliases: dict[str, tuple[int, ...]] = {}
    cache: dict = {}
    info_of = infos.info if infos is not None else (lambda inst: op_info(inst, cache))

    def sources(inst) -> set[int]:
        if inst.name in task_of:
            return {task_of[inst.name]}
        return set(aliases.get(inst.name, ()))

    def deps(inst) -> set[int]:
        out: set[int] = set()
        for o in list(inst.operands) + list(inst.control_predecessors):
            out |= sources(o)
        return out

    def add(task: Task, dep: set[int]) -> int:
        tasks.append(task)
        preds.append(dep)
        return len(tasks) - 1

    for inst in entry.instructions:
        role = inst.async_role
        kind = inst.collective_kind
        # the done of an async compute pair launches nothing and its result is the buffer
        # the start's kernel wrote: an alias of the start
        alias = inst.opcode in ALIAS_OPCODES or (kind is None and _is_async_compute_done(inst))
        if fold_aliases and alias:
            aliases[inst.name] = tuple(sorted(deps(inst)))
            continue
        if kind is not None and role in ("done", "update"):
            start = inst.async_start()
            i = task_of[start.name]
            task_of[inst.name] = i
            if role == "done":
                tasks[i] = _costed_collective(tasks[i], kind, start, inst, cost_model, num_devices)
                preds[i] |= deps(inst) - {i}
                events.append(Event(i, Phase.DONE))
            continue
        if kind is not None and (role == "start" or inst.opcode in _SYNC_COLLECTIVES
                                 or inst.opcode == "fusion"):  # a collective kernel fusion
            placeholder = Task(inst.name, TaskKind.COLLECTIVE, 0.0, stream=stream_of(kind),
                               opcode=inst.opcode, collective=CollectiveInfo(kind, 0, 1))
            i = add(placeholder, deps(inst))
            task_of[inst.name] = i
            events.append(Event(i, Phase.START))
            if role is None:  # synchronous collective
                tasks[i] = _costed_collective(tasks[i], kind, inst, inst, cost_model, num_devices)
                events.append(Event(i, Phase.DONE))
            continue
        info = info_of(inst)
        out_bytes = 0 if alias else info.result_bytes
        duration = nested[inst.name] if inst.name in nested else cost_model.compute_us(info)
        i = add(Task(inst.name, TaskKind.COMPUTE, duration, out_bytes=out_bytes,
                     opcode=inst.opcode), deps(inst))
        task_of[inst.name] = i
        events.append(Event(i, Phase.RUN))
    if loop is not None and entry.name == loop.body and entry.root is not None:
        # The loop state lives across iterations: keep the carried tuple live until the root.
        root = task_of.get(entry.root.name)
        params = [task_of[p.name] for p in entry.parameters if p.name in task_of]
        if root is not None:
            preds[root] |= {p for p in params if p != root}
    graph = TaskGraph(tasks, preds)
    if check:
        graph.validate()
        graph.check_schedule(events)
    log.debug("built %r from %s of module %s", graph, entry.name, module.name)
    return HloTaskGraph(graph, events, task_of, aliases, module.name, entry.name, loop)


_KERNEL_STRATEGY = re.compile(r'"kernel_strategy"\s*:\s*"KERNEL_STRATEGY_TRITON_(ONE|TWO)_SHOT"')


def kernel_strategy(coll) -> str | None:
    """``"one_shot"``/``"two_shot"``: the strategy XLA wrote in a kernel all-reduce's
    ``collective_backend_config`` (None where it wrote none: XLA's rule decides)."""
    m = _KERNEL_STRATEGY.search(str(coll.attrs.get("backend_config", "")))
    return None if m is None else f"{m.group(1).lower()}_shot"


def _costed_collective(task: Task, kind: str, start, done, cost_model: CostModel, num_devices: int) -> Task:
    coll = _collective_of(start)
    groups = device_groups(coll, num_devices)
    nbytes = _payload_bytes(kind, start, done)
    if kind == "all-reduce" and start.is_collective_kernel:
        # XLA:GPU's Triton all-reduce kernel (jaxlib >= 0.11), not NCCL
        cost = cost_model.all_reduce_kernel(nbytes, groups, kernel_strategy(coll))
    else:
        cost = cost_model.collective(kind, nbytes, groups)
    hosts = {cost_model.cluster.host_of(d) for g in groups[:1] for d in g if d < cost_model.cluster.num_devices}
    key = (tuple(tuple(g) for g in groups), coll.attrs.get("to_apply").name if hasattr(coll.attrs.get("to_apply"), "name") else "",
           array_leaves(done.shape)[-1].dtype if array_leaves(done.shape) else "")
    info = CollectiveInfo(kind, nbytes, max((len(g) for g in groups), default=1), key, len(hosts) > 1)
    out_bytes = sum(a.bytes for a in array_leaves(done.shape))
    return dataclasses.replace(task, duration_us=cost.time_us, collective=info, out_bytes=out_bytes)


def collective_cost_fn(cost_model: CostModel) -> Callable:
    """Duration (µs) of a (fused) collective's ``CollectiveInfo`` under ``cost_model``
    (``groups_key[0]`` holds the device groups): the cost of a bucket ``taskgraph.build_fused_graph`` makes."""

    def cost(info) -> float:
        groups = [list(g) for g in info.groups_key[0]] if info.groups_key and info.groups_key[0] \
            else [list(range(info.group_size))]
        return cost_model.collective(info.op, info.bytes, groups).time_us

    return cost
