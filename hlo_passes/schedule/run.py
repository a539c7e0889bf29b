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

import logging
import warnings

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import loops_of
from concerto_jax.judge import plan_module
from hlo_passes.options import PassOptions
from hlo_passes.registry import PassOutcome

log = logging.getLogger(__name__)


def schedule_pass(module, options: PassOptions) -> PassOutcome:
    """Reorder every computation of ``module`` by the RCPSP scheduler; see the module docstring."""
    cost_model = CostModel(get_cluster(options.target))
    done, problems = plan_module(module, cost_model, options.scheduler)
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
