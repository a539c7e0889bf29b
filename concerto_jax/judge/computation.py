"""Judging and planning one computation of a module: its task graph built, scheduled, simulated."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax.costmodel import CostModel
from concerto_jax.hlo_taskgraph import (
    HloTaskGraph,
    build_taskgraph,
    control_flow_durations,
    loops_of,
    with_durations,
)
from concerto_jax.judge.graph import Judgement, judge_graph
from concerto_jax.scheduler import ScheduleOptions
from concerto_jax.simulator import SimOptions, lower_bound
from concerto_jax.taskgraph import Event, Phase
from hlo_passes.ir.loops import control_flow_depths, schedulable_computations, side_effects


def judge_computation(module, cost_model: CostModel, computation=None, *,
                      schedule: ScheduleOptions | None = None, sim: SimOptions | None = None,
                      fold_aliases: bool = True, nested_us=None, durations_us=None,
                      loop=None) -> Judgement:
    """``build_taskgraph(module, cost_model, ...)`` of one computation (None: the entry), judged
    from its own order by ``judge_graph``; ``Judgement.built`` is the HLO task graph."""
    hg = build_taskgraph(module, cost_model, fold_aliases=fold_aliases, computation=computation,
                         nested_us=nested_us, loop=loop, durations_us=durations_us)
    return judge_graph(hg.graph, hg.events, schedule=schedule, sim=sim, built=hg)


def order_from_events(hg: HloTaskGraph, events: Sequence[Event], instructions) -> list:
    """Instruction order of a computation for an event order of its task graph.

    A synchronous collective sits at its START event (its operands are ready there, every
    user comes after its DONE). The halves of an async collective pair (a scheduled module,
    e.g. XLA's after its latency hiding scheduler) sit at their own events: the start at
    START, the done (and any ``async-update``) at DONE.

    Args:
      hg: the task graph built from the computation with ``fold_aliases=False``.
      events: a valid schedule of ``hg.graph``.
      instructions: the computation's instructions (current order).

    Returns:
      The instructions in the new order (each exactly once).

    Raises:
      ValueError: an instruction has no task (the graph was built with folded aliases).
    """
    at_start: dict[int, list] = {}
    at_done: dict[int, list] = {}
    for inst in instructions:
        if inst.name not in hg.task_of:
            raise ValueError(f"instruction %{inst.name} has no task; build the graph with "
                             "fold_aliases=False to reorder a computation")
        late = inst.collective_kind is not None and inst.async_role in ("done", "update")
        (at_done if late else at_start).setdefault(hg.task_of[inst.name], []).append(inst)
    order: list = []
    for e in events:
        order.extend((at_done if e.phase is Phase.DONE else at_start).pop(e.task, ()))
    if at_start or at_done:
        raise ValueError(f"{len(at_start) + len(at_done)} tasks have no event in the schedule")
    return order


@dataclasses.dataclass(frozen=True)
class ComputationPlan:
    """The plan of one computation (``plan_computation``).

    Attributes:
      name: the computation.
      tasks: tasks of its graph; collectives: collective tasks among them.
      program_us: one run in its input order (nested computations in theirs).
      scheduled_us: one run in the chosen order (nested computations in theirs).
      lower_bound_us: bound of one run (nested computations at their bounds).
      changed: whether its order changed.
      trip_count: iterations of the loop whose body it is (None otherwise or unknown).
      carried_bytes: bytes of the loop state of that loop (0 otherwise).
      skipped: why it kept its order ("" when scheduled).
      source: the scheduler's winning candidate ("input", "heuristic", "cp", "kept").
      solver_s: scheduler wall time.
      input_peak_bytes / peak_bytes: peak live bytes of one run in the input / chosen
        order (a loop body's include its carried state).
      memory_limit_bytes: the limit the scheduler applied to it (None: none).
    """

    name: str
    tasks: int
    collectives: int
    program_us: float
    scheduled_us: float
    lower_bound_us: float
    changed: bool
    trip_count: int | None = None
    carried_bytes: int = 0
    skipped: str = ""
    source: str = "kept"
    solver_s: float = 0.0
    input_peak_bytes: int | None = None
    peak_bytes: int | None = None
    memory_limit_bytes: int | None = None


def budget_share(module, comp, budget: int) -> int:
    """The part of a whole-program memory budget that computation ``comp`` is planned within.

    A called computation's live bytes come on top of its callers' at the call, which its
    own graph does not see. So where the module has control flow, a computation at nesting
    depth ``d`` (``hlo_passes.ir.loops.control_flow_depths``: entry 0, a loop body 1) gets
    ``budget / 2**(d + 1)``: along any chain of calls the shares sum to less than the
    budget. A module without control flow gives its entry the whole budget. (XLA's own
    scheduler holds every computation to the whole limit.) Each computation's limit is
    still at least its input order's peak times the ratio (``ScheduleOptions``).
    """
    depths = control_flow_depths(module)
    if len(depths) <= 1:
        return budget
    return budget >> (depths.get(comp.name, 0) + 1)


def plan_computation(module, comp, cost_model: CostModel, schedule: ScheduleOptions, times: dict,
                     problems: list[str]) -> tuple[ComputationPlan, tuple[str, ...]]:
    """Plan one computation whose callees are already in ``times`` (the ``schedule`` pass's core).

    ``times`` maps ``"program"``/``"scheduled"``/``"bound"`` to ``{computation: µs}``;
    this computation's three figures are added to it. Returns the plan and its instructions'
    names in the planned order (the current order when unchanged). The computation is not
    reordered: the caller applies that order (``comp.set_order``) before it plans the
    computation's callers.
    """
    loops = loops_of(module)
    loop = loops.get(comp.name)

    def unknown(info):
        problems.append(f"while %{info.name}: trip count unknown ({info.source}); "
                        "costed as one iteration")

    nested = {key: control_flow_durations(comp, times[key], unknown if key == "scheduled" else None)
              for key in times}
    hg = build_taskgraph(module, cost_model, fold_aliases=False, computation=comp,
                         nested_us=nested["scheduled"], loop=loop)
    program_graph = with_durations(hg, nested["program"])
    program_us = judge_graph(program_graph, hg.events).makespan_us()
    bound_us = lower_bound(with_durations(hg, nested["bound"]))
    effects = side_effects(comp)
    order = tuple(i.name for i in comp.instructions)
    skipped, source, solver_s = "", "kept", 0.0
    memory: dict = {}
    if effects:
        skipped = f"side effects ({', '.join('%' + i.name for i in effects[:3])})"
        problems.append(f"computation %{comp.name} keeps its order: {skipped}")
        scheduled_us, changed = judge_graph(hg.graph, hg.events).makespan_us(), False
    else:
        sched_opts = schedule
        if sched_opts.memory_budget_bytes is not None:
            sched_opts = dataclasses.replace(sched_opts, memory_budget_bytes=budget_share(
                module, comp, sched_opts.memory_budget_bytes))
        result = judge_graph(hg.graph, hg.events, schedule=sched_opts).schedule
        hg.graph.check_schedule(list(result.events))
        old = list(comp.instructions)
        new = order_from_events(hg, result.events, old)
        changed = [i.name for i in new] != [i.name for i in old]
        scheduled_us = result.makespan_us
        source, solver_s = result.source, result.wall_time_s
        memory = dict(input_peak_bytes=result.input_peak_memory_bytes,
                      peak_bytes=result.peak_memory_bytes,
                      memory_limit_bytes=result.memory_limit_bytes)
        kept_us = judge_graph(hg.graph, hg.events).makespan_us() if changed else scheduled_us
        over_limit = (result.input_peak_memory_bytes is not None and result.memory_limit_bytes is not None
                      and result.input_peak_memory_bytes > result.memory_limit_bytes)
        if changed and not over_limit and scheduled_us > kept_us * (1.0 - schedule.min_gain):
            # no material modelled gain: XLA's order stays (ties and slivers are not worth a change)
            changed, scheduled_us = False, kept_us
            source = f"kept (gain {1 - result.makespan_us / kept_us:.2%} < min_gain)" if kept_us else "kept"
            memory["peak_bytes"] = result.input_peak_memory_bytes
        if changed:
            order = tuple(i.name for i in new)
    times["program"][comp.name] = program_us
    times["scheduled"][comp.name] = scheduled_us
    times["bound"][comp.name] = bound_us
    is_body = loop is not None and loop.body == comp.name
    return ComputationPlan(
        name=comp.name, tasks=len(hg.graph),
        collectives=sum(t.is_collective for t in hg.graph.tasks),
        program_us=program_us, scheduled_us=scheduled_us, lower_bound_us=bound_us,
        changed=changed, trip_count=loop.trip_count if is_body else None,
        carried_bytes=loop.carried_bytes if is_body else 0, skipped=skipped, source=source,
        solver_s=solver_s, **memory), order


def plan_module(module, cost_model: CostModel, schedule: ScheduleOptions) -> tuple[list[ComputationPlan], list[str]]:
    """Plan every schedulable computation of ``module`` (``plan_computation``), callees first,
    each reordered in place before its callers are planned on its order.

    Returns:
      The plans (the entry's last) and the problems met (one line each).
    """
    times: dict[str, dict[str, float]] = {"program": {}, "scheduled": {}, "bound": {}}
    problems: list[str] = []
    done = []
    for comp in schedulable_computations(module):
        plan, order = plan_computation(module, comp, cost_model, schedule, times, problems)
        if plan.changed:
            comp.set_order([comp.instruction(n) for n in order])
        done.append(plan)
    return done, problems
