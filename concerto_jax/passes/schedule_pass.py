"""The ``schedule`` pass: order every computation of a module as an RCPSP (Concerto ASPLOS'25 §4).

Every computation that runs as a sequence of kernels is scheduled, callees
before callers (``hlo_passes.ir.loops.schedulable_computations``): ``while``
bodies and conditions, ``conditional`` branches, ``call`` targets, nested
loops, then the entry. Each becomes a costed ``TaskGraph``
(``concerto_jax.hlo_taskgraph``, costs for ``Options.target``) in which a
control-flow instruction costs what its callees' schedules cost (a while:
``trips x (body + condition) + condition``); its current order is the initial
schedule (program order, every collective synchronous), the scheduler
(``concerto_jax.scheduler.schedule``: list heuristic, CP-SAT, odd-even windows)
finds an order that is never slower under the cost model, and the
instructions are put in that order. Only the order changes, so results stay
bitwise equal. Remat'd forward work inside a backward loop body is ordinary
work of that body: the scheduler may overlap the body's collectives with it.

A synchronous collective is placed at its START event (its operands are ready
there, and every user comes after its DONE). The statistics are for the whole
program: the entry's predicted time with every nested computation in its input
order (``program_order_us``) and in its scheduled order (``scheduled_us``),
and a bound built from the nested computations' bounds (``lower_bound_us``).

Not handled (one warning per module, the computation keeps its order or its
cost is a guess): computations with side effects (infeed/outfeed, send/recv,
side-effecting custom-calls, RNG state) are not reordered; a while whose trip
count is not static is scheduled but costed as one iteration.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence

from concerto_jax import scheduler
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import (
    HloTaskGraph,
    build_taskgraph,
    control_flow_durations,
    loops_of,
    with_durations,
)
from concerto_jax.simulator import lower_bounds, makespan
from concerto_jax.taskgraph import Event, Phase
from hlo_passes.ir.loops import control_flow_depths, schedulable_computations, side_effects
from hlo_passes.options import PassOptions
from hlo_passes.registry import PassOutcome

log = logging.getLogger(__name__)


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
class ComputationSchedule:
    """What the pass did to one computation.

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


def schedule_computation(module, comp, cost_model: CostModel, options, times: dict,
                         problems: list[str]) -> ComputationSchedule:
    """Schedule one computation whose callees are already in ``times``; reorder it in place.

    ``times`` maps ``"program"``/``"scheduled"``/``"bound"`` to ``{computation: µs}``;
    this computation's three figures are added to it.
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
    program_us = makespan(program_graph, hg.events)
    bound_us = lower_bounds(with_durations(hg, nested["bound"])).bound_us
    effects = side_effects(comp)
    skipped, source, solver_s = "", "kept", 0.0
    memory: dict = {}
    if effects:
        skipped = f"side effects ({', '.join('%' + i.name for i in effects[:3])})"
        problems.append(f"computation %{comp.name} keeps its order: {skipped}")
        scheduled_us, changed = makespan(hg.graph, hg.events), False
    else:
        sched_opts = options.scheduler
        if sched_opts.memory_budget_bytes is not None:
            sched_opts = dataclasses.replace(sched_opts, memory_budget_bytes=budget_share(
                module, comp, sched_opts.memory_budget_bytes))
        result = scheduler.schedule(hg.graph, sched_opts, initial=hg.events)
        hg.graph.check_schedule(list(result.events))
        old = list(comp.instructions)
        new = order_from_events(hg, result.events, old)
        changed = [i.name for i in new] != [i.name for i in old]
        if changed:
            comp.set_order(new)
        scheduled_us = result.makespan_us
        source, solver_s = result.source, result.wall_time_s
        memory = dict(input_peak_bytes=result.input_peak_memory_bytes,
                      peak_bytes=result.peak_memory_bytes,
                      memory_limit_bytes=result.memory_limit_bytes)
    times["program"][comp.name] = program_us
    times["scheduled"][comp.name] = scheduled_us
    times["bound"][comp.name] = bound_us
    is_body = loop is not None and loop.body == comp.name
    return ComputationSchedule(
        name=comp.name, tasks=len(hg.graph),
        collectives=sum(t.is_collective for t in hg.graph.tasks),
        program_us=program_us, scheduled_us=scheduled_us, lower_bound_us=bound_us,
        changed=changed, trip_count=loop.trip_count if is_body else None,
        carried_bytes=loop.carried_bytes if is_body else 0, skipped=skipped, source=source,
        solver_s=solver_s, **memory)


def schedule_pass(module, options: PassOptions) -> PassOutcome:
    """Reorder every computation of ``module`` by the RCPSP scheduler; see the module docstring."""
    cost_model = CostModel(get_cluster(options.target))
    times: dict[str, dict[str, float]] = {"program": {}, "scheduled": {}, "bound": {}}
    problems: list[str] = []
    done = [schedule_computation(module, comp, cost_model, options, times, problems)
            for comp in schedulable_computations(module)]
    entry = done[-1]
    body_names = {info.body for info in loops_of(module).values()}
    bodies = [c for c in done if c.name in body_names]
    program, scheduled = entry.program_us, entry.scheduled_us
    stats = {
        "target": options.target,
        "tasks": sum(c.tasks for c in done),
        "collectives": sum(c.collectives for c in done),
        "collectives_in_loops": sum(c.collectives for c in bodies),
        "computations": len(done),
        "loops": [{"body": c.name, "trips": c.trip_count, "carried_bytes": c.carried_bytes,
                   "collectives": c.collectives, "program_us": round(c.program_us, 1),
                   "scheduled_us": round(c.scheduled_us, 1), "changed": c.changed,
                   "peak_bytes": c.peak_bytes}
                  for c in bodies],
        "program_order_us": round(program, 1),
        "scheduled_us": round(scheduled, 1),
        "lower_bound_us": round(entry.lower_bound_us, 1),
        "gain": round(program / scheduled, 4) if scheduled > 0 else 1.0,
        "source": entry.source,
        "solver_s": round(sum(c.solver_s for c in done), 2),
        "input_peak_bytes": entry.input_peak_bytes,
        "peak_bytes": entry.peak_bytes,
        "memory_limit_bytes": entry.memory_limit_bytes,
    }
    if problems:
        message = ("concerto_jax schedule pass: some computations not fully handled: "
                   + "; ".join(problems))
        warnings.warn(message, stacklevel=2)
        log.warning("%s", message)
        stats["not_handled"] = problems
    log.info("schedule pass: %s", stats)
    return PassOutcome(changed=any(c.changed for c in done), stats=stats)
