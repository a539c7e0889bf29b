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


@dataclasses.dataclass(frozen=True)
class Judged:
    """Hierarchical figures of one module (µs of one step).

    Attributes:
      us: the entry's simulated time in the module's own order (nested computations in theirs).
      bound_us: the entry's bound (nested computations at their bounds).
      computations: schedulable computations.
      loops: one dict per while body (body, trips, collectives, us).
      collectives / collectives_in_loops: collective tasks in all computations / in loop bodies.
      overlap: computation -> {collective: µs of its transfer during which a kernel runs}.
      runs: computation -> how many times it runs per step (products of trip counts).
      nested_us: computation -> its simulated time in its own order (``us`` of each), for
        rebuilding a caller's graph with its callees' durations.
      compute_us / comm_us: kernel time and collective transfer time of one step at full
        speed (no overlap slowdown), every computation's own tasks weighted by its runs per
        step: what the step computes and communicates, whatever the order. Two programs of
        the same model (a scanned one and its unrolled twin) can differ here.
    """

    us: float
    bound_us: float
    computations: int
    loops: list[dict]
    collectives: int
    collectives_in_loops: int
    overlap: dict[str, dict[str, float]]
    runs: dict[str, int]
    nested_us: dict[str, float] = dataclasses.field(default_factory=dict)
    compute_us: float = 0.0
    comm_us: float = 0.0


_CONTROL_FLOW = frozenset({"while", "conditional", "call"})


def judge_module(text: str, cost_model) -> Judged:
    """Every computation of ``text`` simulated in its own order, combined bottom-up, and the bound."""
    from hlo_passes.parser import parse_module

    return judge_parsed(parse_module(text), cost_model)


def judge_parsed(module, cost_model) -> Judged:
    """``judge_module`` of a parsed module (not modified: one parse serves several cost models)."""
    from concerto_jax.hlo_taskgraph import (
        build_taskgraph,
        control_flow_durations,
        loops_of,
        with_durations,
    )
    from concerto_jax.simulator import SimOptions, lower_bounds, simulate
    from hlo_passes.loops import analyze_while, control_flow_callees, schedulable_computations

    sim_opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, check=False, memory=False)
    times: dict[str, dict[str, float]] = {"own": {}, "bound": {}}
    bodies = {info.body: info for info in loops_of(module).values()}
    loops, overlap, n_coll, n_loop_coll = [], {}, 0, 0
    own_work: dict[str, tuple[float, float]] = {}  # computation -> (compute, comm) µs of its own tasks
    comps = schedulable_computations(module)
    for comp in comps:
        nested = {k: control_flow_durations(comp, times[k]) for k in times}
        hg = build_taskgraph(module, cost_model, computation=comp, nested_us=nested["own"])
        sim = simulate(hg.graph, hg.events, sim_opts)
        times["own"][comp.name] = sim.step_time_us
        times["bound"][comp.name] = lower_bounds(with_durations(hg, nested["bound"])).bound_us
        overlap[comp.name] = overlap_by_collective(hg.graph, sim)
        own_work[comp.name] = (
            sum(t.duration_us for t in hg.graph.tasks if not t.is_collective and t.opcode not in _CONTROL_FLOW),
            sum(t.duration_us for t in hg.graph.tasks if t.is_collective))
        c = sum(t.is_collective for t in hg.graph.tasks)
        n_coll += c
        if comp.name in bodies:
            n_loop_coll += c
            loops.append({"body": comp.name, "trips": bodies[comp.name].trip_count, "collectives": c,
                          "us": round(sim.step_time_us, 1)})
    runs = {comps[-1].name: 1}
    for comp in reversed(comps):  # callers before callees
        m = runs.get(comp.name, 0)
        for inst in comp.instructions:
            if inst.opcode == "while":
                info = analyze_while(inst)
                trips = info.trip_count or 1
                runs[info.body] = runs.get(info.body, 0) + m * trips
                runs[info.condition] = runs.get(info.condition, 0) + m * (trips + 1)
            else:
                for callee in control_flow_callees(inst):
                    runs[callee.name] = runs.get(callee.name, 0) + m
    entry = comps[-1].name
    compute = sum(runs.get(c, 0) * w[0] for c, w in own_work.items())
    comm = sum(runs.get(c, 0) * w[1] for c, w in own_work.items())
    return Judged(times["own"][entry], times["bound"][entry], len(comps), loops, n_coll, n_loop_coll,
                  overlap, runs, dict(times["own"]), compute_us=compute, comm_us=comm)


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
    from concerto_jax.hlo_taskgraph import build_taskgraph, control_flow_durations
    from concerto_jax.simulator import SimOptions, simulate
    from hlo_passes.parser import parse_module

    module = parse_module(text)
    built = build_taskgraph(module, cost_model,
                            nested_us=control_flow_durations(module.entry, judged.nested_us))
    opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, memory=False)
    return built, opts, simulate(built.graph, built.events, opts), module.entry.name


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
    from concerto_jax.simulator import simulate

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
        plan = simulate(built.graph, planned_events(built.graph, built.events), opts)
        overlap = dict(final.overlap)
        overlap[entry] = overlap_by_collective(built.graph, plan)
        planned = dataclasses.replace(final, us=plan.step_time_us, overlap=overlap)
    kept, planned_ov = overlap_kept(planned, final)
    return Fidelity(round(planned.us, 1), round(final.us, 1), round(stock.us, 1),
                    round(planned_ov, 1), round(kept * planned_ov, 1),
                    round(kept, 4) if planned_ov > 0 else 1.0)

