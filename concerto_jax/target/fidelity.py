"""Planned vs final vs stock: one cost model and one simulator for the three step times.

* final: XLA's final module of our program, in XLA's order (``build_taskgraph`` of the
  scheduled module, simulated in its own order).
* planned: the same graph (the program XLA runs: fused, pinned) with every async
  collective started as soon as its operands allow and waited for right before its
  first reader: the window the pins ask XLA to keep, judged on the graph XLA runs
  (DESIGN.md section 5: plan and result must be compared on one program).
* stock: XLA's final module of the original step, in XLA's order.

Overlap of a collective = the part of its transfer interval during which a kernel
runs. ``overlap_kept`` sums, per collective, ``min(final overlap, planned overlap)``
and divides by the planned total, so that overlap XLA adds elsewhere does not make
up for planned overlap it lost.
"""

from __future__ import annotations

import dataclasses

from concerto_jax.taskgraph import COMPUTE_STREAM, Event, Phase


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """Simulated step times (us) and overlap of plan, final and stock (see module docstring)."""

    planned_step_us: float
    final_step_us: float
    stock_step_us: float
    planned_overlap_us: float
    final_overlap_us: float
    overlap_kept: float


def planned_events(graph, events) -> list:
    """``events`` with every collective's START as early and DONE as late as dependencies allow."""
    from concerto_jax.xla_order import order_by_priority

    key = {e: float(k) for k, e in enumerate(events)}
    last = {}  # task -> key of its last event
    for e in events:
        last[e.task] = key[e]
    first = {}
    for e in events:
        first.setdefault(e.task, key[e])
    for i, t in enumerate(graph.tasks):
        if not t.is_collective:
            continue
        ready = max((last[p] for p in graph.preds[i]), default=-1.0)
        key[Event(i, Phase.START)] = ready + 1e-3
        need = min((first[s] for s in graph.succs[i]), default=float(len(events)))
        key[Event(i, Phase.DONE)] = need - 1e-3
    out, _ = order_by_priority(graph, key)
    graph.check_schedule(out)
    return out


def overlap_by_collective(graph, sim) -> dict[str, float]:
    """``{collective name: time its transfer overlaps a running kernel}`` of a simulation."""
    from concerto_jax.simulator.result import union

    compute = union((t.start_us, t.end_us) for t in sim.timings if t.stream == COMPUTE_STREAM)
    out = {}
    for t in sim.timings:
        if t.stream == COMPUTE_STREAM:
            continue
        ov = 0.0
        for s, e in compute:
            lo, hi = max(s, t.start_us), min(e, t.end_us)
            if hi > lo:
                ov += hi - lo
        out[t.name] = ov
    return out


def _sim(text: str, cost_model):
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.simulator import SimOptions, simulate
    from hlo_passes.parser import parse_module

    built = build_taskgraph(parse_module(text), cost_model)
    opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, memory=False)
    return built, opts, simulate(built.graph, built.events, opts)


def measure(final_text: str, stock_text: str, cost_model, planned_text: str | None = None) -> Fidelity:
    """Planned, final and stock step times and the overlap kept (see the module docstring).

    Args:
      final_text: XLA's final module of our program.
      stock_text: XLA's final module of the original step.
      cost_model: the target's ``CostModel``.
      planned_text: the scheduled module we handed XLA (the backend-only path): the plan is
        then that module in its own order, not the as-early/as-late windows of
        ``planned_events`` on the final graph (the pin path).
    """
    from concerto_jax.simulator import simulate

    built, opts, final = _sim(final_text, cost_model)
    if planned_text is None:
        plan_graph = built.graph
        plan = simulate(built.graph, planned_events(built.graph, built.events), opts)
    else:
        plan_built, _, plan = _sim(planned_text, cost_model)
        plan_graph = plan_built.graph
    _, _, stock = _sim(stock_text, cost_model)
    p_ov = overlap_by_collective(plan_graph, plan)
    f_ov = overlap_by_collective(built.graph, final)
    planned = sum(p_ov.values())
    kept = sum(min(f_ov.get(n, 0.0), v) for n, v in p_ov.items())
    return Fidelity(round(plan.step_time_us, 1), round(final.step_time_us, 1), round(stock.step_time_us, 1),
                    round(planned, 1), round(kept, 1), round(kept / planned, 4) if planned > 0 else 1.0)
