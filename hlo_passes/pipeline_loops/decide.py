"""The decisions of the ``pipeline_loops`` pass: whether a loop's prefetch or rotation pays.

``decide_loop`` tries the prefetch rewrite (``prefetch.pipeline_prefetch``) of one ``while`` on a
copy and schedules the body both ways with the judge (``concerto_jax.judge``, costs for
``Options.target``); ``decide_rotation`` does the same for the rotation (``rotation.rotate_loop``,
used by ``decompose`` after a split). See ``hlo_passes.pipeline_loops.run`` for the pass.
"""

from __future__ import annotations

import dataclasses
import logging

from concerto_jax.costmodel import CostModel
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.judge import budget_share, judge_computation
from hlo_passes.ir import module_to_text, parse_module
from hlo_passes.ir.loops import analyze_while
from hlo_passes.pipeline_loops.prefetch import (
    loop_shape_problem,
    pipeline_prefetch,
    prefetch_candidates,
)
from hlo_passes.pipeline_loops.rotation import rotate_loop, rotation_candidates

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Body:
    makespan_us: float
    input_peak_bytes: int | None
    peak_bytes: int | None


def _schedule_body(module, body_name: str, cost_model: CostModel, sched_options) -> _Body:
    result = judge_computation(module, cost_model, body_name, fold_aliases=False,
                               schedule=sched_options).schedule
    return _Body(result.makespan_us, result.input_peak_memory_bytes, result.peak_memory_bytes)


def _serial_us(module, names, computation: str, cost_model: CostModel) -> float:
    """The named instructions' task durations in ``computation``'s graph, summed."""
    hg = build_taskgraph(module, cost_model, computation=computation)
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
    trial = parse_module(module_to_text(module))
    trial_inst = trial.computation(inst.parent.name).instruction(inst.name)
    prologue = pipeline_prefetch(trial, trial_inst, names)
    # The rewritten body is held to the ORIGINAL body's limit (its extra buffers count).
    trial_options = options.scheduler if limit is None else dataclasses.replace(
        options.scheduler, memory_limit_bytes=limit)
    new = _schedule_body(trial, info.body, cost_model, trial_options)
    prologue_us = _serial_us(trial, prologue, inst.parent.name, cost_model)
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


ROTATION_MARGIN = 0.02
"""A rotation is kept when its loop plans at least this fraction faster than the loop as is."""

ROTATION_CANDIDATES = 3
"""Rotations tried per loop: around the last collectives of the body, in body order."""

ROTATION_MAX_CARRIED = 2.05
"""A rotation may carry at most this many times its collective's result bytes (2x, and the
vectors that come with them: a recomputed bias broadcast carries its bias). Every carried
value is a loop-state buffer XLA materialises, which the unfused post-SPMD graph the
decision schedules does not see. Held-out Llama TP=8 scan: the forward body's rotation
carries 2x (the chunk's partial sum and residual) and its final module runs 628 -> 540 us a
trip; the backward body's best carried 12x (the norm backward of both chunks) and its final
module ran 1,623 -> 1,806 us a trip (XLA could no longer reassociate an all-reduce pair)."""


def decide_rotation(module, inst, cost_model: CostModel, options, budget: int | None = None) -> dict:
    """Rotate ``inst`` (``rotation.rotate_loop``) around the body collective
    whose rotated body plans fastest, if the loop then pays; the record says what and why.

    Candidates carry at most ``ROTATION_MAX_CARRIED`` times their collective's bytes. Each
    candidate is tried on a copy of the module and its body scheduled by the RCPSP
    scheduler, held to the ORIGINAL body's memory limit (the carried tail inputs count).
    The loop as is costs ``trips x body``; rotated, ``(trips - 1) x body'`` plus one
    original iteration split between the prologue (the head) and the epilogue (the
    tail), costed as the original body's makespan plus the tail's serial time. Kept when
    that is at least ``ROTATION_MARGIN`` shorter. ``budget``: the whole program's memory
    budget; the body's limit is then at least its share (``judge.budget_share``).
    """
    info = analyze_while(inst)
    record = {"loop": inst.name, "body": info.body, "trips": info.trip_count, "rotated": False}
    body = module.computation(info.body)
    every = rotation_candidates(module, inst)
    cands = [r for r in every
             if r.bytes <= ROTATION_MAX_CARRIED * body.instruction(r.collective).shape.byte_size]
    cands = cands[-ROTATION_CANDIDATES:]
    if not cands or not info.trip_count or info.trip_count < 2:
        record["why"] = ("fewer than 2 trips" if cands else
                         f"every rotation would carry more than {ROTATION_MAX_CARRIED:g}x its "
                         f"collective's bytes ({len(every)} candidates)" if every
                         else "no collective to rotate around")
        return record
    base = _schedule_body(module, info.body, cost_model, options.scheduler)
    limit = options.scheduler.memory_limit_for(base.input_peak_bytes)
    if limit is not None and budget is not None:
        limit = max(limit, budget_share(module, body, budget))
    trial_options = options.scheduler if limit is None else dataclasses.replace(
        options.scheduler, memory_limit_bytes=limit)
    tried, best = [], None
    for rot in reversed(cands):  # ties go to the body's last collective (the last chunk's)
        trial = parse_module(module_to_text(module))
        rotate_loop(trial, trial.computation(inst.parent.name).instruction(inst.name), rot.collective)
        new = _schedule_body(trial, info.body, cost_model, trial_options)
        fits = limit is None or new.peak_bytes is None or new.peak_bytes <= limit
        tail_us = _serial_us(module, rot.tail, info.body, cost_model)
        after = (info.trip_count - 1) * new.makespan_us + base.makespan_us + tail_us
        tried.append({"collective": rot.collective, "body_us": round(new.makespan_us, 1),
                      "loop_us": round(after, 1), "carried_bytes": rot.bytes,
                      "peak_bytes": new.peak_bytes, "fits": fits})
        if fits and (best is None or after < best[1]):
            best = (rot, after)
    before = info.trip_count * base.makespan_us
    record.update(body_us=round(base.makespan_us, 1), loop_us=round(before, 1),
                  memory_limit_bytes=limit, tried=tried)
    if best is None:
        record["why"] = "over the memory limit"
    elif best[1] > (1.0 - ROTATION_MARGIN) * before:
        record["why"] = "does not pay under the cost model"
    else:
        rotate_loop(module, inst, best[0].collective)
        record.update(rotated=True, collective=best[0].collective, rotated_loop_us=round(best[1], 1),
                      carried_bytes=best[0].bytes, why="pays and fits")
    log.info("rotation of %s: %s", inst.name, record)
    return record
