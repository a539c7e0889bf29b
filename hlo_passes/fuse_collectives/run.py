"""The ``fuse_collectives`` pass: merge compatible collectives, fused sizes chosen by the cost model.

Decide on the task graph, rewrite the HLO (Concerto ASPLOS'25 §4.5, Algorithm 1):

1. The entry computation becomes a costed ``TaskGraph`` (costs for ``Options.target``);
   each synchronous ``all-reduce``/``all-gather`` gets the HLO compatibility key of
   ``hlo_passes.fuse_collectives.rewrite.fusion_key`` (groups, mode, dtype, reducer
   structure, gather dimension), every other collective a key of its own.
2. ``hlo_passes.fuse_collectives.grouping.fuse_collectives`` walks the collectives in program
   order and appends one to the open bucket of its key only where the rescheduled
   graph's makespan does not grow, with the fused duration from the cost model:
   the bucket size is a decision, not a constant (paper Figure 2).
3. ``hlo_passes.fuse_collectives.rewrite.fuse_group`` rewrites each bucket into one
   variadic collective plus ``get-tuple-element``s (results bitwise equal).

Memory: the peak of the program order after fusion (``scheduler.peak_memory`` on
the module's task graph) must not exceed the limit (``ScheduleOptions``: bytes, or
a ratio of the input order's peak, by default the input's peak itself). If it
does, fewer buckets are applied (the longest prefix in program order that fits,
found by bisection); if none fits, the pass changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph, collective_cost_fn
from concerto_jax.judge import judge_graph
from concerto_jax.taskgraph import TaskGraph
from hlo_passes.fuse_collectives.grouping import fuse_collectives
from hlo_passes.fuse_collectives.rewrite import fuse_group, fusion_key
from hlo_passes.ir import module_to_text, parse_module
from hlo_passes.options import PassOptions
from hlo_passes.registry import PassOutcome

log = logging.getLogger(__name__)


def keyed_graph(graph: TaskGraph, entry) -> TaskGraph:
    """``graph`` with every collective's ``groups_key`` set to ``(groups, HLO fusion key)``.

    Collectives that cannot fuse in HLO get a key naming themselves, so they never fuse.
    """
    tasks = []
    for t in graph.tasks:
        if t.is_collective:
            inst = entry.instruction(t.name)
            key = fusion_key(inst)
            groups = tuple(tuple(g) for g in (inst.replica_groups or ()))
            hlo_key = key if key is not None else ("unfusible", t.name)
            t = dataclasses.replace(t, collective=dataclasses.replace(
                t.collective, groups_key=(groups, hlo_key)))
        tasks.append(t)
    return TaskGraph(tasks, [list(p) for p in graph.preds])


def program_order_peak(module, cost_model: CostModel) -> int:
    """Peak live bytes of ``module``'s entry in its current order (the scheduler's memory model)."""
    hg = build_taskgraph(module, cost_model, fold_aliases=False)
    return judge_graph(hg.graph, hg.events).peak_bytes()


def apply_groups(module, groups: list[tuple[str, ...]]) -> int:
    """Fuse each group of collective names of ``module.entry``; returns the number of groups fused."""
    entry = module.entry
    for names in groups:
        fuse_group(entry, [entry.instruction(n) for n in names])
    return len(groups)


def _fits(module, groups, cost_model, limit) -> tuple[bool, int]:
    trial = parse_module(module_to_text(module), source="fusion trial")
    apply_groups(trial, groups)
    peak = program_order_peak(trial, cost_model)
    return peak <= limit, peak


def fuse_pass(module, options: PassOptions) -> PassOutcome:
    """Fuse compatible collectives of ``module.entry``; see the module docstring."""
    cost_model = CostModel(get_cluster(options.target))
    hg = build_taskgraph(module, cost_model, fold_aliases=False)
    entry = module.entry
    graph = keyed_graph(hg.graph, entry)
    n_coll = sum(t.is_collective for t in graph.tasks)
    input_peak = judge_graph(hg.graph, hg.events).peak_bytes()
    limit = options.scheduler.memory_limit_for(input_peak)
    stats: dict = {"target": options.target, "collectives": n_coll, "fused_groups": 0,
                   "collectives_after": n_coll, "input_peak_bytes": input_peak,
                   "peak_bytes": input_peak, "memory_limit_bytes": limit}
    if n_coll < 2:
        return PassOutcome(changed=False, stats=stats)
    fr = fuse_collectives(graph, collective_cost_fn(cost_model), events=hg.events,
                          max_evaluations=options.scheduler.fusion_max_evaluations,
                          progress=options.scheduler.progress)
    pos = {inst.name: k for k, inst in enumerate(entry.instructions)}
    groups = sorted((tuple(sorted(names, key=pos.__getitem__))
                     for names in fr.fused_to_originals.values()), key=lambda g: pos[g[0]])
    stats.update(makespan_before_us=round(fr.makespan_before_us, 1),
                 makespan_after_us=round(fr.makespan_after_us, 1), evaluations=fr.evaluations)
    peak = input_peak
    if groups and limit is not None:
        ok, peak = _fits(module, groups, cost_model, limit)
        if not ok:  # largest prefix of the groups (program order) within the limit
            lo, hi, best_peak = 0, len(groups) - 1, input_peak
            while lo < hi:
                mid = (lo + hi + 1) // 2
                fits, p = _fits(module, groups[:mid], cost_model, limit)
                if fits:
                    lo, best_peak = mid, p
                else:
                    hi = mid - 1
            log.info("fusion: %d groups exceed the memory limit (%d > %d bytes); keeping %d",
                     len(groups), peak, limit, lo)
            stats["dropped_for_memory"] = len(groups) - lo
            groups, peak = groups[:lo], best_peak
    apply_groups(module, groups)
    if groups and limit is None:
        peak = program_order_peak(module, cost_model)
    fused_members = sum(len(g) for g in groups)
    stats.update(fused_groups=len(groups), collectives_after=n_coll - fused_members + len(groups),
                 peak_bytes=peak)
    log.info("fuse_collectives pass: %s", stats)
    return PassOutcome(changed=bool(groups), stats=stats)
