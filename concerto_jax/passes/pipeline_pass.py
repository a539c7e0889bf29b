"""The ``pipeline_loops`` pass: prefetch next iteration's FSDP all-gathers where the schedule says it pays.

For every ``while`` of the module (scanned layers) whose body gathers slices of
loop-invariant stacked weights (``hlo_passes.pipelining.prefetch_candidates``),
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

import dataclasses
import logging

import hlo_passes
from concerto_jax import scheduler
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.pipeline import PassOutcome
from hlo_passes.loops import analyze_while, schedulable_computations
from hlo_passes.pipelining import loop_shape_problem, pipeline_prefetch, prefetch_candidates

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Body:
    makespan_us: float
    input_peak_bytes: int | None
    peak_bytes: int | None


def _schedule_body(module, body_name: str, cost_model: CostModel, sched_options) -> _Body:
    hg = build_taskgraph(module, cost_model, fold_aliases=False, computation=body_name)
    result = scheduler.schedule(hg.graph, sched_options, initial=hg.events)
    return _Body(result.makespan_us, result.input_peak_memory_bytes, result.peak_memory_bytes)


def _prologue_us(module, names: list[str], parent: str, cost_model: CostModel) -> float:
    hg = build_taskgraph(module, cost_model, computation=parent)
    return sum(hg.graph.tasks[hg.task_of[n]].duration_us for n in names if n in hg.task_of)


def decide_loop(module, inst, cost_model: CostModel, options) -> dict:
    """Try the rewrite of one while on a copy; the record says whether and why it pays."""
    info = analyze_while(inst)
    record = {"loop": inst.name, "body": info.body, "trips": info.trip_count, "applied": False}
    problem = loop_shape_problem(module, inst, info)
    if problem is not None:
        record["why"] = problem
        return record
    cands = prefetch_candidates(module, inst)
    record.update(candidates=len(cands), extra_bytes=sum(c.bytes for c in cands))
    if not cands or not info.trip_count:
        record["why"] = "no prefetchable all-gather" if not cands else "zero trips"
        return record
    names = [c.collective for c in cands]
    base = _schedule_body(module, info.body, cost_model, options.scheduler)
    limit = options.scheduler.memory_limit_for(base.input_peak_bytes)
    trial = hlo_passes.parse_module(hlo_passes.module_to_text(module))
    trial_inst = trial.computation(inst.parent.name).instruction(inst.name)
    prologue = pipeline_prefetch(trial, trial_inst, names)
    # The rewritten body is held to the ORIGINAL body's limit (its extra buffers count).
    trial_options = options.scheduler if limit is None else dataclasses.replace(
        options.scheduler, memory_limit_bytes=limit)
    new = _schedule_body(trial, info.body, cost_model, trial_options)
    prologue_us = _prologue_us(trial, prologue, inst.parent.name, cost_model)
    before = info.trip_count * base.makespan_us
    after = info.trip_count * new.makespan_us + prologue_us
    record.update(body_us=round(base.makespan_us, 1), pipelined_body_us=round(new.makespan_us, 1),
                  prologue_us=round(prologue_us, 1), loop_us=round(before, 1),
                  pipelined_loop_us=round(after, 1), body_peak_bytes=base.peak_bytes,
                  pipelined_peak_bytes=new.peak_bytes, memory_limit_bytes=limit)
    if limit is not None and new.peak_bytes is not None and new.peak_bytes > limit:
        record["why"] = f"over the memory limit ({new.peak_bytes} > {limit} bytes)"
    elif after >= before:
        record["why"] = "does not pay under the cost model"
    else:
        pipeline_prefetch(module, inst, names)
        record.update(applied=True, why="pays and fits")
    return record


def pipeline_loops_pass(module, options) -> PassOutcome:
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
