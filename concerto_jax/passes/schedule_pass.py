"""The ``schedule`` pass: order a module's entry computation as an RCPSP (Concerto ASPLOS'25 §4).

The entry computation becomes a costed ``TaskGraph`` (``concerto_jax.hlo_taskgraph``,
costs for ``Options.target``), its current order is the initial schedule
(program order, every collective synchronous), the scheduler
(``concerto_jax.scheduler.schedule``: list heuristic, CP-SAT, odd-even windows)
finds an order that is never slower under the cost model, and the instructions
are put in that order. Only the order changes, so results stay bitwise equal.

A synchronous collective is placed at its START event (its operands are ready
there, and every user comes after its DONE). The predicted step times of the
input order and of the chosen order are the pass's statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from concerto_jax import scheduler
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import HloTaskGraph, build_taskgraph
from concerto_jax.pipeline import PassOutcome, register_pass
from concerto_jax.taskgraph import Event, Phase

log = logging.getLogger(__name__)


def order_from_events(hg: HloTaskGraph, events: Sequence[Event], instructions) -> list:
    """Instruction order of the entry computation for an event order of its task graph.

    Args:
      hg: the task graph built from the computation with ``fold_aliases=False``.
      events: a valid schedule of ``hg.graph``.
      instructions: the computation's instructions (current order).

    Returns:
      The instructions in the new order (each exactly once).

    Raises:
      ValueError: an instruction has no task (the graph was built with folded aliases).
    """
    by_task: dict[int, list] = {}
    for inst in instructions:
        if inst.name not in hg.task_of:
            raise ValueError(f"instruction %{inst.name} has no task; build the graph with "
                             "fold_aliases=False to reorder a computation")
        by_task.setdefault(hg.task_of[inst.name], []).append(inst)
    order: list = []
    for e in events:
        if e.phase is Phase.DONE:
            continue  # synchronous collectives sit at their START
        order.extend(by_task.pop(e.task, ()))
    if by_task:
        raise ValueError(f"{len(by_task)} tasks have no event in the schedule")
    return order


@register_pass("schedule")
def schedule_pass(module, options) -> PassOutcome:
    """Reorder ``module.entry`` by the RCPSP scheduler; see the module docstring."""
    cost_model = CostModel(get_cluster(options.target))
    hg = build_taskgraph(module, cost_model, fold_aliases=False)
    result = scheduler.schedule(hg.graph, options.scheduler, initial=hg.events)
    hg.graph.check_schedule(list(result.events))
    entry = module.entry
    old = list(entry.instructions)
    new = order_from_events(hg, result.events, old)
    changed = [i.name for i in new] != [i.name for i in old]
    if changed:
        entry.set_order(new)
    n_coll = sum(t.is_collective for t in hg.graph.tasks)
    stats = {
        "target": options.target,
        "tasks": len(hg.graph),
        "collectives": n_coll,
        "program_order_us": round(result.input_makespan_us or 0.0, 1),
        "scheduled_us": round(result.makespan_us, 1),
        "lower_bound_us": round(result.lower_bound_us, 1),
        "gain": round((result.input_makespan_us or result.makespan_us) / result.makespan_us, 4)
        if result.makespan_us > 0 else 1.0,
        "source": result.source,
        "solver_s": round(result.wall_time_s, 2),
        "input_peak_bytes": result.input_peak_memory_bytes,
        "peak_bytes": result.peak_memory_bytes,
        "memory_limit_bytes": result.memory_limit_bytes,
    }
    log.info("schedule pass: %s", stats)
    return PassOutcome(changed=changed, stats=stats)
