"""Every computation of a module judged in its own order, combined bottom-up (``judge_module``)."""

from __future__ import annotations

import dataclasses

from concerto_jax.hlo_taskgraph import (
    build_taskgraph,
    control_flow_durations,
    loops_of,
    with_durations,
)
from concerto_jax.judge.graph import judge_graph
from concerto_jax.simulator import SimOptions, lower_bounds
from concerto_jax.simulator.result import union
from concerto_jax.taskgraph import COMPUTE_STREAM
from hlo_passes.ir.loops import (
    runs_per_step,
    schedulable_computations,
)
from hlo_passes.ir.parser import parse_module


def overlap_by_collective(graph, sim) -> dict[str, float]:
    """``{collective name: time its transfer overlaps a running kernel}`` of a simulation."""
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


def step_us_parsed(module, cost_model, infos, *, check: bool = False) -> float:
    """``judge_parsed(module, cost_model).us`` alone (the entry in its own order, nested
    computations in theirs), for judging one module under many cost models: each instruction's
    ``OpInfo`` comes from ``infos`` (the module's ``hlo_ops.OpInfoCache``), no bound, overlap
    or work sums, and the graphs are not validated again unless ``check``."""
    sim_opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, check=False, memory=False)
    own: dict[str, float] = {}
    comps = schedulable_computations(module)
    for comp in comps:
        hg = build_taskgraph(module, cost_model, computation=comp, nested_us=control_flow_durations(comp, own),
                             infos=infos, check=check)
        own[comp.name] = judge_graph(hg.graph, hg.events, sim=sim_opts).sim.step_time_us
    return own[comps[-1].name] + cost_model.options.compute.step_overhead_us


def judge_module(text: str, cost_model) -> Judged:
    """Every computation of ``text`` simulated in its own order, combined bottom-up, and the bound."""
    return judge_parsed(parse_module(text), cost_model)


def judge_parsed(module, cost_model) -> Judged:
    """``judge_module`` of a parsed module (not modified: one parse serves several cost models)."""
    sim_opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, check=False, memory=False)
    times: dict[str, dict[str, float]] = {"own": {}, "bound": {}}
    bodies = {info.body: info for info in loops_of(module).values()}
    loops, overlap, n_coll, n_loop_coll = [], {}, 0, 0
    own_work: dict[str, tuple[float, float]] = {}  # computation -> (compute, comm) µs of its own tasks
    comps = schedulable_computations(module)
    for comp in comps:
        nested = {k: control_flow_durations(comp, times[k]) for k in times}
        hg = build_taskgraph(module, cost_model, computation=comp, nested_us=nested["own"])
        sim = judge_graph(hg.graph, hg.events, sim=sim_opts).sim
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
    runs = runs_per_step(comps)
    entry = comps[-1].name
    compute = sum(runs.get(c, 0) * w[0] for c, w in own_work.items())
    comm = sum(runs.get(c, 0) * w[1] for c, w in own_work.items())
    step = cost_model.options.compute.step_overhead_us  # once per step (ComputeOptions)
    return Judged(times["own"][entry] + step, times["bound"][entry] + step, len(comps), loops, n_coll, n_loop_coll,
                  overlap, runs, dict(times["own"]), compute_us=compute, comm_us=comm)
