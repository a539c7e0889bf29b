"""Planned vs final vs stock: one cost model and one simulator for the three step times.

* final: XLA's final module of our program, in XLA's order (``build_taskgraph`` of the
  scheduled module, simulated in its own order).
* planned: the same graph (the program XLA runs: fused, pinned) with every async
  collective started as soon as its operands allow and waited for right before its
  first reader: the window the pins ask XLA to keep, judged on the graph XLA runs
  (docs/ARCHITECTURE.md F4: plan and result must be compared on one program).
* stock: XLA's final module of the original step, in XLA's order.

Overlap of a collective = the part of its transfer interval during which a kernel
runs. ``overlap_kept`` sums, per collective, ``min(final overlap, planned overlap)``
and divides by the planned total, so that overlap XLA adds elsewhere does not make
up for planned overlap it lost.
"""

from __future__ import annotations

import dataclasses

from concerto_jax.hlo_taskgraph import build_taskgraph, control_flow_durations
from concerto_jax.judge.graph import judge_graph
from concerto_jax.judge.module import Judged, judge_module, overlap_by_collective
from concerto_jax.judge.orders import planned_events
from concerto_jax.simulator import SimOptions
from hlo_passes.ir.parser import parse_module


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """Simulated step times (us) and overlap of plan, final and stock (see module docstring)."""

    planned_step_us: float
    final_step_us: float
    stock_step_us: float
    planned_overlap_us: float
    final_overlap_us: float
    overlap_kept: float


def overlap_kept(planned: Judged, final: Judged) -> tuple[float, float]:
    """``(kept share, planned overlap µs per step)``: per collective min(final, planned) overlap,
    every computation weighted by its runs per step (``planned``'s), matched by names."""
    total = kept = 0.0
    for comp, ov in planned.overlap.items():
        runs = planned.runs.get(comp, 1)
        fin = final.overlap.get(comp, {})
        for name, us in ov.items():
            total += runs * us
            kept += runs * min(fin.get(name, 0.0), us)
    return (kept / total if total > 0 else 1.0), total


def _entry_sim(text: str, cost_model, judged: Judged):
    """The entry's graph of ``text`` with its callees at ``judged``'s times, its simulation, its name."""
    module = parse_module(text)
    built = build_taskgraph(module, cost_model,
                            nested_us=control_flow_durations(module.entry, judged.nested_us))
    opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, memory=False)
    return built, opts, judge_graph(built.graph, built.events, sim=opts).sim, module.entry.name


def measure(final_text: str, stock_text: str, cost_model, planned_text: str | None = None,
            planned_judged: Judged | None = None) -> Fidelity:
    """Planned, final and stock step times and the overlap kept (see the module docstring).

    Every computation is simulated (``judge_module``): a while loop costs trips x (body +
    condition) with its body simulated in its own order, so collectives inside scanned
    layers count in the step time and in the overlap (weighted by how often each
    computation runs per step).

    Args:
      final_text: XLA's final module of our program.
      stock_text: XLA's final module of the original step.
      cost_model: the target's ``CostModel``.
      planned_text: the scheduled module we handed XLA (the backend-only path): the plan is
        then that module in its own order, every computation. Without it (the pin path) the
        plan is the final module's entry with every collective's window as early/as late as
        ``planned_events`` allows, nested computations as in the final module (pins cover
        the entry only).
      planned_judged: ``judge_module(planned_text, cost_model)`` when the caller already has
        it (compile_for_target's rewrite guard judges the plan it keeps); used instead of
        simulating ``planned_text`` again. Only with ``planned_text``.

    Raises:
      ValueError: ``planned_judged`` without ``planned_text``.
    """
    if planned_judged is not None and planned_text is None:
        raise ValueError("planned_judged needs the planned_text it was judged from")
    final = judge_module(final_text, cost_model)
    stock = judge_module(stock_text, cost_model)
    if planned_judged is not None:
        planned = planned_judged
    elif planned_text is not None:
        planned = judge_module(planned_text, cost_model)
    else:
        built, opts, _, entry = _entry_sim(final_text, cost_model, final)
        plan = judge_graph(built.graph, planned_events(built.graph, built.events), sim=opts).sim
        overlap = dict(final.overlap)
        overlap[entry] = overlap_by_collective(built.graph, plan)
        planned = dataclasses.replace(final, us=plan.step_time_us + cost_model.options.compute.step_overhead_us,
                                      overlap=overlap)
    kept, planned_ov = overlap_kept(planned, final)
    return Fidelity(round(planned.us, 1), round(final.us, 1), round(stock.us, 1),
                    round(planned_ov, 1), round(kept * planned_ov, 1),
                    round(kept, 4) if planned_ov > 0 else 1.0)
