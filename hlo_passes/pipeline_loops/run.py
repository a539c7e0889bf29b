"""The ``pipeline_loops`` pass: prefetch next iteration's FSDP all-gathers where the schedule says it pays.

For every ``while`` of the module (scanned layers) whose body gathers slices of
loop-invariant stacked weights (``prefetch.prefetch_candidates``),
the pass tries the software-pipelining rewrite (``pipeline_prefetch``: the
gather of iteration ``i + 1`` is issued in iteration ``i``, a prologue gathers
iteration 0, the gathered buffers are carried) on a copy of the module and
schedules the loop body both ways with the RCPSP scheduler (costs for
``Options.target``). It keeps the rewrite when

* it pays: ``trips x body'`` plus the prologue's gathers is shorter than
  ``trips x body`` (both bodies scheduled, the nested loops at their input
  order's cost), and
* it fits: the rewritten body's peak live bytes (which now include the carried
  prefetched buffers for the whole iteration) stay within the scheduler's
  memory limit for that body (``ScheduleOptions.memory_limit_for`` of the
  original body's input peak: with the default ``memory_limit_ratio=1.0`` a
  rewrite that holds more memory than the body did is refused; raise the ratio
  or set ``memory_limit_bytes`` to allow it).

Run it before ``schedule`` (``passes=("pipeline_loops", "schedule")``): the
rewrite only makes the early gathers possible, ``schedule`` places them.
Results stay bitwise equal (the same gathers of the same data; the last
iteration's prefetch reads a clamped index and is discarded).
"""

from __future__ import annotations

import logging

from concerto_jax.costmodel import CostModel, get_cluster
from hlo_passes.ir.loops import schedulable_computations
from hlo_passes.options import PassOptions
from hlo_passes.pipeline_loops.decide import decide_loop
from hlo_passes.registry import PassOutcome

log = logging.getLogger(__name__)


def pipeline_loops_pass(module, options: PassOptions) -> PassOutcome:
    """Apply the prefetch rewrite to every loop where it pays and fits; see the module docstring."""
    cost_model = CostModel(get_cluster(options.target))
    loops = [inst for comp in schedulable_computations(module) for inst in comp.instructions
             if inst.opcode == "while"]
    records = [decide_loop(module, inst, cost_model, options) for inst in loops]
    applied = [r for r in records if r["applied"]]
    examined = [r for r in records if "body_peak_bytes" in r]
    # Peak of the loop bodies as kept (rewritten or not) and their limits; 0 when no loop
    # body was examined (nothing of this pass holds memory).
    peaks = [r["pipelined_peak_bytes"] if r["applied"] else r["body_peak_bytes"] for r in examined]
    limits = [r["memory_limit_bytes"] for r in examined]
    stats = {"target": options.target, "loops": len(records), "pipelined": len(applied),
             "prefetched_collectives": sum(r.get("candidates", 0) for r in applied),
             "extra_carried_bytes": sum(r.get("extra_bytes", 0) for r in applied),
             "peak_bytes": max(peaks, default=0),
             "memory_limit_bytes": (None if any(v is None for v in limits) else max(limits, default=0)),
             "per_loop": records}
    log.info("pipeline_loops pass: %s", stats)
    return PassOutcome(changed=bool(applied), stats=stats)
