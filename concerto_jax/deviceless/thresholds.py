"""XLA's collective combiners emulated on a task graph: the threshold search's pruning model.

Each candidate of the combine-threshold search (``combine_search.tune_combiners``) costs one XLA
compile (about as long as stock XLA's whole compile) plus one plan. Most of them lose. This
module ranks the candidates before any of them is compiled, from ONE real candidate: XLA's
scheduled module at the smallest threshold tried (``CombineProxy``), where every bucket XLA
made is at most that size. A larger threshold only merges such buckets, so its bucket
structure can be emulated on that module's task graphs:

* per computation, the collectives of each combined kind (``COMBINED_KINDS``) walked in the
  module's order (XLA's schedule), each joining the open bucket of its kind and device groups
  while the bucket stays within the threshold and the collective does not depend on a member
  (XLA's combiners: same kind and groups, no data path between members, result bytes up to
  the threshold: a reduce-scatter counts its scattered result); otherwise it opens a new bucket; one larger than the threshold by itself is left
  alone and leaves the open bucket open (XLA's combiners skip it);
* a bucket costed as one collective of its summed bytes (the cost model), the graph ordered by
  the list heuristic and timed (``judge.judge_graph``); nested computations by their callees'
  times, as the judge does.

The estimate is a ranking device only: which candidates are worth a compile. The search then
compiles the best-ranked few and judges their real plans as before, so what it keeps is always
a real, judged plan (``Options.deviceless.combine_compiles``; ``None``: every candidate compiled).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from concerto_jax.costmodel import CostModel
from concerto_jax.hlo_taskgraph import (
    build_taskgraph,
    collective_cost_fn,
    control_flow_durations,
    loops_of,
    with_durations,
)
from concerto_jax.judge.graph import judge_graph
from concerto_jax.scheduler.heuristics import list_schedule
from concerto_jax.taskgraph import TaskGraph, build_fused_graph
from hlo_passes.ir import parse_module
from hlo_passes.ir.loops import schedulable_computations

log = logging.getLogger(__name__)

COMBINED_KINDS = ("all-reduce", "all-gather", "reduce-scatter")
"""Collective kinds whose XLA combine threshold ``Options.deviceless.combine_thresholds`` sets
(``autoccl.knobs.gpu_combine_threshold_options``, the flags AutoCCL's online stage 1 tunes)."""


@dataclasses.dataclass
class _Comp:
    name: str
    hg: object  # HloTaskGraph
    walk: list[int]  # combinable collectives in the module's order (task indices)
    descendants: list[int]  # per task: bitset of the tasks reachable from it


def _topological(graph) -> list[int]:
    """A topological order of ``graph``'s tasks (shorter than the graph: it has a cycle)."""
    n = len(graph)
    succs = [[] for _ in range(n)]
    indeg = [0] * n
    for v, ps in enumerate(graph.preds):
        for p in ps:
            succs[p].append(v)
            indeg[v] += 1
    order, queue = [], [v for v in range(n) if indeg[v] == 0]
    while queue:
        v = queue.pop()
        order.append(v)
        for s in succs[v]:
            indeg[s] -= 1
            if indeg[s] == 0:
                queue.append(s)
    return order


def _descendants(graph) -> list[int]:
    """Per task, the bitset (a Python int) of the tasks reachable from it by a non-empty path."""
    succs = [[] for _ in range(len(graph))]
    for v, ps in enumerate(graph.preds):
        for p in ps:
            succs[p].append(v)
    desc = [0] * len(graph)
    for v in reversed(_topological(graph)):
        bits = 0
        for s in succs[v]:
            bits |= desc[s] | (1 << s)
        desc[v] = bits
    return desc


def _without_collective_order(hg, comp):
    """``hg`` without the control edges from one collective to another: XLA's GPU pipeline may
    order the collectives of a scheduled module by control edges so that every device issues
    them alike (its collective-schedule linearizer); such an order is made for this module's
    buckets, not for the emulated ones, whose merging it could block or turn into a cycle."""
    data = set()
    for inst in comp.instructions:
        v = hg.task_of.get(inst.name)
        for o in inst.operands:
            p = hg.task_of.get(o.name)
            if p is not None and v is not None and p != v:
                data.add((p, v))
    tasks = hg.graph.tasks
    preds = [[p for p in ps if (p, v) in data or not (tasks[p].is_collective and tasks[v].is_collective)]
             for v, ps in enumerate(hg.graph.preds)]
    return dataclasses.replace(hg, graph=TaskGraph(list(tasks), preds))


class CombineProxy:
    """Estimated planned time of XLA's module at other combine thresholds (module docstring).

    Args:
      scheduled_src: XLA's scheduled module at the smallest threshold of the search.
      cost_model: the target's cost model.
    """

    def __init__(self, scheduled_src: str, cost_model: CostModel):
        self.cost_model = cost_model
        module = parse_module(scheduled_src, source="combine-threshold proxy")
        loops = loops_of(module)
        self._comps: list[_Comp] = []
        for comp in schedulable_computations(module):  # callees first
            hg = _without_collective_order(build_taskgraph(
                module, cost_model, fold_aliases=False, computation=comp, loop=loops.get(comp.name)), comp)
            position = {}
            for k, e in enumerate(hg.events):
                position.setdefault(e.task, k)  # a task's first event: its start
            walk = sorted((i for i, t in enumerate(hg.graph.tasks)
                           if t.is_collective and t.collective.op in COMBINED_KINDS),
                          key=lambda i: position.get(i, i))
            self._comps.append(_Comp(comp.name, hg, walk, _descendants(hg.graph) if walk else []))
        self._module = module
        self.cycles = 0  # settings whose emulated buckets formed a cycle (estimated unfused)

    def buckets(self, setting: Mapping[str, int]) -> dict[str, list[list[int]]]:
        """Emulated buckets (task indices, two or more members) per computation name at
        ``setting`` (kind -> threshold bytes; an absent kind keeps this module's buckets)."""
        out = {}
        for c in self._comps:
            groups: list[list[int]] = []
            open_: dict[tuple, tuple[int, int, int]] = {}  # key -> (group index, bytes, descendants)
            for i in c.walk:
                task = c.hg.graph.tasks[i]
                info, size = task.collective, task.out_bytes  # XLA's combiners count result bytes
                limit = setting.get(info.op)
                if limit is None or size > limit:  # larger than the threshold: left alone
                    continue
                key = (info.op, info.groups_key[0] if info.groups_key else (), info.crosses_hosts)
                g = open_.get(key)
                if g is not None and g[1] + size <= limit and not (g[2] >> i) & 1:
                    groups[g[0]].append(i)
                    open_[key] = (g[0], g[1] + size, g[2] | c.descendants[i])
                else:
                    groups.append([i])
                    open_[key] = (len(groups) - 1, size, c.descendants[i])
            out[c.name] = [g for g in groups if len(g) > 1]
        return out

    def signature(self, setting: Mapping[str, int]) -> tuple:
        """The emulated bucket structure at ``setting``: equal signatures, equal modules."""
        return tuple((name, tuple(map(tuple, groups))) for name, groups in sorted(self.buckets(setting).items()))

    def us(self, setting: Mapping[str, int]) -> float:
        """Estimated time (µs) of the entry at ``setting``: emulated buckets, list heuristic."""
        cost = collective_cost_fn(self.cost_model)
        buckets = self.buckets(setting)
        times: dict[str, float] = {}
        for c in self._comps:
            comp = self._module.computation(c.name)
            graph = with_durations(c.hg, control_flow_durations(comp, times))
            if buckets[c.name]:
                fused, _, _ = build_fused_graph(graph, buckets[c.name], cost)
                if len(_topological(fused)) == len(fused):
                    graph = fused
                else:  # a cycle through two buckets (XLA would not merge both): estimated unfused
                    self.cycles += 1
            events = list_schedule(graph)
            times[c.name] = judge_graph(graph, events).makespan_us()
        return times[self._comps[-1].name]
