"""Concerto(S) vs stock XLA: our RCPSP and XLA's latency hiding scheduler ordering the SAME fused graph.

The fair comparison of ``docs/ARCHITECTURE.md`` F4. For each
suite case (``bench.suite``):

1. Deviceless GPU compile (``concerto_jax.deviceless.compile_lowered``) with the
   dumps around ``latency-hiding-scheduler``. The module LHS *received*
   (fused kernels, async start/done pairs, the memory scheduler's order) is
   parsed and turned into ONE costed ``TaskGraph`` (``build_taskgraph``).
   XLA's final order (``compiled.as_text()``) is mapped onto the tasks of that
   graph by instruction name (``map_order``): instructions that map keep
   their position, graph tasks the final module lacks are placed where the
   after-LHS order had them, instructions only the final module has are
   counted as ``extra``. The after-LHS dump is mapped the same way (a check, and
   where the final module's missing tasks are placed).
   When XLA ran no LHS for the target (no dump), the graph is built from the
   final module itself and XLA's order is its own order (coverage 100 %).
2. Concerto(S): ``scheduler.schedule(graph, options, initial=XLA's order)``
   and ``initial=the pre-LHS order``; both are simulated and the faster one
   is kept. If the scheduler's evaluator (no overlap slowdown) and the
   simulator (with slowdown) disagree so much that both are slower than
   XLA's order under the simulator, XLA's order itself is kept and the source
   says ``xla (fallback)`` (never worse than XLA by construction; verified per
   case and reported). Concerto(S+F): ``fuse_collectives`` on the chosen
   order with the cost model's collective time as ``cost_fn``, then
   ``schedule`` on the fused graph (reported as is, no fallback).
3. Everything is simulated by ``concerto_jax.simulator.simulate`` with the
   same cost model (overlap slowdown included): step times, gain, lower bound
   (``max(compute, comm, critical path)``), a slowdown-aware resource bound and,
   where CP-SAT proves one within its time limit, the RCPSP optimum bound
   (the graph's best makespan at full speed, which no order beats).
4. Stability: every task duration is multiplied by an independent
   ``U(1-noise, 1+noise)`` factor (``noise_trials`` trials, seeds
   ``noise_seed..``); the chosen schedule (computed on unperturbed costs) and
   XLA's order are re-simulated on the noisy graph (sensitivity of the step to
   execution noise). And robustness to cost-model error: the scheduler is run
   on each noisy graph and its schedule judged on the true costs, against the
   schedule made from the true costs.

Every number written comes from the run that writes it. Command line::

    python -m bench.concerto_vs_xla [--case NAME] [--quick] [--noise 0.1 --noise-trials 5]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import random
import sys
import time
from collections.abc import Sequence

from bench import concerto_report, suite
from concerto_jax.hlo_taskgraph import collective_cost_fn
from concerto_jax.judge import MappedOrder, map_order, order_by_priority

log = logging.getLogger(__name__)

COLUMNS = (
    "case", "status", "cluster", "mesh", "graph_from", "tasks", "collectives",
    "xla_coverage_pct", "xla_extra_insts", "xla_opcode_mismatch", "xla_repairs", "after_lhs_coverage_pct",
    "compile_s",
    "xla_step_us", "xla_after_lhs_step_us", "pre_lhs_step_us", "ours_step_us", "ours_source", "gain",
    "ours_vs_xla_ok", "lower_bound_us", "slowdown_bound_us", "rcpsp_bound_us", "rcpsp_bound_status",
    "ours_gap_to_bound_pct", "xla_gap_to_bound_pct", "ours_gap_to_slowdown_bound_pct",
    "best_bound_us", "ours_gap_to_best_bound_pct", "within_5pct", "within_5pct_of_best_bound", "why_not_within_5pct",
    "critical_path_us", "total_compute_us", "total_comm_us",
    "xla_exposed_comm_pct", "ours_exposed_comm_pct", "xla_peak_mem_mib", "ours_peak_mem_mib",
    "xla_peak_model_mib", "ours_peak_model_mib", "memory_limit_mib", "ours_within_memory_limit",
    "sched_eval_us", "sched_s", "sched_s_from_xla", "sched_s_from_pre",
    "sf_step_us", "sf_gain", "sf_collectives", "sf_fused_groups", "sf_lower_bound_us", "sf_s",
    "noise", "noise_trials", "noise_max_abs_delta_pct", "noise_mean_delta_pct", "noise_xla_max_abs_delta_pct",
    "noise_wins", "noise_min_gain", "noise_ok_2pct",
    "resched_max_delta_pct", "resched_mean_delta_pct", "resched_wins", "resched_ok_2pct",
    "overlap_slowdown", "case_wall_s",
)


@dataclasses.dataclass(frozen=True)
class ConcertoBenchOptions:
    """How the comparison runs.

    Attributes:
      out_dir: where CSV, markdown, trace and Gantt go.
      prefix: file-name prefix of the results.
      schedule: options of ``concerto_jax.scheduler.schedule`` (None: its defaults).
      from_pre_lhs: also schedule from the pre-LHS order (keep the better).
      fusion: also run Concerto(S+F) (collective fusion, then scheduling).
      fusion_max_evaluations: cap on candidate merges tried by ``fuse_collectives``.
      rcpsp_bound_s: CP-SAT wall limit for the proven RCPSP bound (0: skip).
      rcpsp_bound_max_tasks: skip that bound above this many tasks.
      noise: relative half-width of the uniform noise on every task duration.
      noise_trials: number of noisy re-simulations (0: no stability check).
      noise_seed: seed of the first trial (trial k uses ``noise_seed + k``).
      trace_case: case exported as Perfetto traces + Gantt PNGs of ours and XLA's
        (None: the first case that runs).
    """

    out_dir: str = "bench/results"
    prefix: str = "concerto_vs_xla"
    schedule: object | None = None
    from_pre_lhs: bool = True
    fusion: bool = True
    fusion_max_evaluations: int | None = 200
    rcpsp_bound_s: float = 10.0
    rcpsp_bound_max_tasks: int = 1200
    noise: float = 0.1
    noise_trials: int = 5
    noise_seed: int = 0
    trace_case: str | None = None




def noisy_graph(graph, noise: float, seed: int):
    """``graph`` with every duration multiplied by an independent ``U(1-noise, 1+noise)`` factor."""
    from concerto_jax.taskgraph import TaskGraph

    rng = random.Random(seed)
    tasks = [dataclasses.replace(t, duration_us=t.duration_us * rng.uniform(1 - noise, 1 + noise))
             for t in graph.tasks]
    return TaskGraph(tasks, graph.preds)


def slowdown_bound(total_compute: float, total_comm: float, critical_path: float, slowdown: float) -> float:
    """Lower bound with the overlap slowdown: compute overlapping communication runs ``slowdown`` x slower.

    With compute work P, one communication stream busy C and o of the communication
    overlapped: step = P + (C - o) + o (1 - 1/s) >= P + C (1 - 1/s) while C <= P s, else
    C. Also at least the critical path (at full speed).
    """
    p, c, s = total_compute, total_comm, slowdown
    res = p + c * (1 - 1 / s) if c <= p * s else c
    return max(res, critical_path)


def _fused_initial(original, fused_graph, mapping: dict, events: Sequence):
    """``events`` of ``original`` carried over to the fused graph (a fused collective at its members' positions)."""
    from concerto_jax.taskgraph import Event, Phase

    member_of = {m: f for f, ms in mapping.items() for m in ms}
    key: dict = {}
    for pos, e in enumerate(events):
        name = original.tasks[e.task].name
        j = fused_graph.index(member_of.get(name, name))
        ev = Event(j, e.phase)
        if e.phase is Phase.START:
            key[ev] = max(key.get(ev, -1.0), float(pos))  # launched once every member could be
        else:
            key[ev] = min(key.get(ev, float("inf")), float(pos))  # waited for where the first member was
    out, _ = order_by_priority(fused_graph, key)
    fused_graph.check_schedule(out)
    return out


@dataclasses.dataclass
class Comparison:
    """Everything ``compare`` measured on one graph (row fields plus objects for traces)."""

    row: dict
    graph: object
    xla_events: tuple
    ours_events: tuple
    xla_sim: object
    ours_sim: object


def compare(before_text: str | None, final_text: str, cost_model, options: ConcertoBenchOptions = ConcertoBenchOptions(),
            *, after_text: str | None = None, label: str = "") -> Comparison:
    """Compare Concerto(S) (and S+F) with XLA's order on the graph of the module LHS received.

    Args:
      before_text: the module just before ``latency-hiding-scheduler`` (None: XLA ran no LHS;
        the graph is then built from ``final_text``).
      final_text: XLA's final scheduled module.
      cost_model: the ``CostModel`` of the target (used for the graph, fusion and simulation).
      options: scheduler, fusion, bound and noise settings.
      after_text: the module right after LHS (its order is mapped as a check).
      label: name for log lines.

    Returns:
      A ``Comparison`` whose ``row`` has the ``COLUMNS`` this function measures.
    """
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.scheduler import ScheduleOptions, schedule
    from concerto_jax.scheduler.program_model import auto_resolution, solve_program
    from concerto_jax.scheduler.rcpsp import SchedulerError, SolverParams
    from concerto_jax.simulator import SimOptions, lower_bounds, simulate
    from hlo_passes.fuse_collectives import fuse_collectives
    from hlo_passes.ir.parser import parse_module

    row: dict = {}
    slow = cost_model.options.overlap_slowdown
    sim_opts = SimOptions(overlap_slowdown=slow)
    fast_opts = SimOptions(overlap_slowdown=slow, check=False, memory=False)
    sched_opts = options.schedule if options.schedule is not None else ScheduleOptions()
    final_mod = parse_module(final_text)
    after_mapped = None
    if before_text is not None:
        built = build_taskgraph(parse_module(before_text), cost_model)
        if after_text is not None:
            after_mapped = map_order(parse_module(after_text), built)
        # Tasks the final module lacks (e.g. copies removed after LHS) go where LHS put them.
        mapped = map_order(final_mod, built, after_mapped.events if after_mapped is not None else None)
        row["graph_from"] = "before_lhs"
    else:
        built = build_taskgraph(final_mod, cost_model)
        mapped = MappedOrder(tuple(built.events), len(built.events), len(built.events), (), (), 0)
        row["graph_from"] = "final (no LHS run)"
    g = built.graph
    xla_events = mapped.events
    xla = simulate(g, xla_events, sim_opts)
    row.update(tasks=len(g), collectives=sum(t.is_collective for t in g.tasks),
               xla_coverage_pct=round(mapped.coverage_pct, 1), xla_extra_insts=len(mapped.extra),
               xla_opcode_mismatch=len(mapped.opcode_mismatch), xla_repairs=mapped.repairs,
               xla_step_us=round(xla.step_time_us, 1), overlap_slowdown=slow)
    if mapped.extra:
        log.info("%s: XLA's final module has %d instructions the before-LHS graph lacks, e.g. %s",
                 label, len(mapped.extra), list(mapped.extra[:5]))
    if after_mapped is not None:
        row["after_lhs_coverage_pct"] = round(after_mapped.coverage_pct, 1)
        row["xla_after_lhs_step_us"] = round(simulate(g, after_mapped.events, sim_opts).step_time_us, 1)
    pre_events = tuple(built.events) if before_text is not None else None
    if pre_events is not None:
        row["pre_lhs_step_us"] = round(simulate(g, pre_events, sim_opts).step_time_us, 1)

    # Memory limit (default: XLA's own order's peak under the scheduler's memory model), the
    # same for both starting orders, so the pre-LHS start cannot bring its own higher peak.
    from concerto_jax.scheduler import peak_memory as sched_peak
    from concerto_jax.simulator import timeline

    def model_peak(events) -> int:
        tl = timeline(g, list(events))
        return sched_peak(g, tl.start, tl.end)

    xla_model_peak = model_peak(xla_events)
    mem_limit = sched_opts.memory_limit_for(xla_model_peak)
    sched_opts = dataclasses.replace(sched_opts, memory_limit_bytes=mem_limit)
    # Concerto(S): from XLA's order and from the pre-LHS order; keep the better under the simulator.
    cands = []
    starts = [("xla", xla_events)] + ([("pre_lhs", pre_events)] if pre_events is not None and options.from_pre_lhs else [])
    sched_total = 0.0
    for name, init in starts:
        res = schedule(g, sched_opts, initial=init)
        sched_total += res.wall_time_s
        row[f"sched_s_from_{'xla' if name == 'xla' else 'pre'}"] = round(res.wall_time_s, 1)
        step = simulate(g, res.events, fast_opts).step_time_us
        log.info("%s: Concerto(S) from %s order: evaluator %.1f us, simulated %.1f us (%s) in %.1fs",
                 label, name, res.makespan_us, step, res.source, res.wall_time_s)
        if mem_limit is not None and model_peak(res.events) > mem_limit:
            # A start order above XLA's peak (pre-LHS) can give a schedule above the limit.
            log.info("%s: Concerto(S) from %s order is above the memory limit; not a candidate",
                     label, name)
            continue
        cands.append((step, f"{res.source} from {name}", res))
    if not cands:  # XLA's own order is within the limit by definition
        cands.append((xla.step_time_us, "xla (memory fallback)",
                      dataclasses.replace(res, events=tuple(xla_events))))
    step, source, best = min(cands, key=lambda c: c[0])
    ours_events = tuple(best.events)
    if step > xla.step_time_us:
        log.warning("%s: both schedules simulate slower than XLA's order (%.1f > %.1f us): keeping XLA's",
                    label, step, xla.step_time_us)
        ours_events, source = xla_events, "xla (fallback)"
    ours = simulate(g, ours_events, sim_opts)
    ours_model_peak = model_peak(ours_events)
    row.update(xla_peak_model_mib=round(xla_model_peak / 2**20, 2),
               ours_peak_model_mib=round(ours_model_peak / 2**20, 2),
               memory_limit_mib=round(mem_limit / 2**20, 2) if mem_limit is not None else "",
               ours_within_memory_limit=mem_limit is None or ours_model_peak <= mem_limit)
    lb = lower_bounds(g)
    sbound = slowdown_bound(lb.total_compute_us, lb.total_comm_us, lb.critical_path_us, slow)
    row.update(ours_step_us=round(ours.step_time_us, 1), ours_source=source,
               gain=round(xla.step_time_us / ours.step_time_us, 4) if ours.step_time_us else "",
               ours_vs_xla_ok=ours.step_time_us <= xla.step_time_us + 1e-6,
               lower_bound_us=round(lb.bound_us, 1), slowdown_bound_us=round(sbound, 1),
               critical_path_us=round(lb.critical_path_us, 1), total_compute_us=round(lb.total_compute_us, 1),
               total_comm_us=round(lb.total_comm_us, 1),
               xla_exposed_comm_pct=round(xla.exposed_comm_pct, 1), ours_exposed_comm_pct=round(ours.exposed_comm_pct, 1),
               xla_peak_mem_mib=round(xla.peak_memory_bytes / 2**20, 1),
               ours_peak_mem_mib=round(ours.peak_memory_bytes / 2**20, 1),
               sched_eval_us=round(best.makespan_us, 1), sched_s=round(sched_total, 1))
    gap = 100 * (ours.step_time_us / lb.bound_us - 1) if lb.bound_us else 0.0
    row["ours_gap_to_bound_pct"] = round(gap, 2)
    row["xla_gap_to_bound_pct"] = round(100 * (xla.step_time_us / lb.bound_us - 1), 2) if lb.bound_us else ""
    row["ours_gap_to_slowdown_bound_pct"] = round(100 * (ours.step_time_us / sbound - 1), 2) if sbound else ""

    # Proven RCPSP bound (full speed): the best makespan any order of this graph can reach without slowdown.
    rcpsp_lb = None
    if options.rcpsp_bound_s > 0 and len(g) <= options.rcpsp_bound_max_tasks:
        try:
            sol = solve_program(g, SolverParams(time_limit_s=options.rcpsp_bound_s, num_workers=2))
            slack = len(g) * auto_resolution(g, range(len(g))) / 2  # duration rounding to ticks
            rcpsp_lb = max(sol.lower_bound_us - slack, lb.bound_us)
            row.update(rcpsp_bound_us=round(rcpsp_lb, 1), rcpsp_bound_status=sol.status)
        except SchedulerError as err:
            row["rcpsp_bound_status"] = f"failed: {str(err)[:60]}"
    best_bound = max(lb.bound_us, sbound, rcpsp_lb or 0.0)
    row["best_bound_us"] = round(best_bound, 1)
    row["ours_gap_to_best_bound_pct"] = round(100 * (ours.step_time_us / best_bound - 1), 2) + 0.0 if best_bound else ""
    row["within_5pct_of_best_bound"] = ours.step_time_us <= 1.05 * best_bound
    row["within_5pct"] = gap <= 5.0
    row["why_not_within_5pct"] = "" if gap <= 5.0 else _why(ours.step_time_us, lb, sbound, rcpsp_lb, best, ours)

    # Concerto(S+F): fusion on the chosen order, then scheduling of the fused graph.
    if options.fusion and row["collectives"] > 1:
        t0 = time.perf_counter()
        fr = fuse_collectives(g, collective_cost_fn(cost_model), events=list(ours_events),
                              max_evaluations=options.fusion_max_evaluations)
        fg = fr.graph
        init = _fused_initial(g, fg, fr.fused_to_originals, ours_events)
        sres = schedule(fg, sched_opts, initial=init)
        sf = simulate(fg, sres.events, sim_opts)
        row.update(sf_step_us=round(sf.step_time_us, 1),
                   sf_gain=round(xla.step_time_us / sf.step_time_us, 4) if sf.step_time_us else "",
                   sf_collectives=sum(t.is_collective for t in fg.tasks), sf_fused_groups=len(fr.fused_to_originals),
                   sf_lower_bound_us=round(lower_bounds(fg).bound_us, 1), sf_s=round(time.perf_counter() - t0, 1))
        log.info("%s: Concerto(S+F): %d -> %d collectives, %.1f us", label, row["collectives"],
                 row["sf_collectives"], sf.step_time_us)

    # Stability under noise: the schedules are fixed, the costs move.
    if options.noise_trials > 0:
        deltas, xdeltas, gains = [], [], []
        for k in range(options.noise_trials):
            ng = noisy_graph(g, options.noise, options.noise_seed + k)
            o = simulate(ng, ours_events, fast_opts).step_time_us
            x = simulate(ng, xla_events, fast_opts).step_time_us
            deltas.append(100 * (o / ours.step_time_us - 1))
            xdeltas.append(100 * (x / xla.step_time_us - 1))
            gains.append(x / o)
        mx = max(abs(d) for d in deltas)
        row.update(noise=options.noise, noise_trials=options.noise_trials,
                   noise_max_abs_delta_pct=round(mx, 2), noise_mean_delta_pct=round(sum(deltas) / len(deltas), 2),
                   noise_xla_max_abs_delta_pct=round(max(abs(d) for d in xdeltas), 2),
                   noise_wins=f"{sum(gn >= 1 - 1e-9 for gn in gains)}/{len(gains)}",
                   noise_min_gain=round(min(gains), 4), noise_ok_2pct=mx <= 2.0)
        # Robustness to cost-model error: schedule on noisy costs, judge on the true costs.
        rdeltas, rwins = [], 0
        for k in range(options.noise_trials):
            ng = noisy_graph(g, options.noise, options.noise_seed + k)
            res = schedule(ng, sched_opts, initial=xla_events)
            true_step = simulate(g, res.events, fast_opts).step_time_us
            rdeltas.append(100 * (true_step / ours.step_time_us - 1))
            rwins += true_step <= xla.step_time_us + 1e-6
        rmx = max(rdeltas)
        row.update(resched_max_delta_pct=round(rmx, 2),
                   resched_mean_delta_pct=round(sum(rdeltas) / len(rdeltas), 2),
                   resched_wins=f"{rwins}/{len(rdeltas)}", resched_ok_2pct=rmx <= 2.0)
    return Comparison(row, g, tuple(xla_events), ours_events, xla, ours)


def _why(step: float, lb, sbound: float, rcpsp_lb: float | None, best, ours) -> str:
    """Why ours is more than 5 % above the simple bound (from the bounds' figures)."""
    parts = []
    if rcpsp_lb is not None and rcpsp_lb > lb.bound_us * 1.05:
        parts.append(f"bound not reachable: CP-SAT proves >= {rcpsp_lb:.0f} us at full speed "
                     f"(+{100 * (rcpsp_lb / lb.bound_us - 1):.1f}% over the simple bound)")
    if sbound > lb.bound_us * 1.005:
        parts.append(f"overlap slowdown alone lifts the bound to {sbound:.0f} us "
                     f"(ours {100 * (step / sbound - 1):+.1f}% of it)")
    if lb.critical_path_us >= 0.95 * lb.bound_us:
        parts.append("critical-path dominated")
    if best.makespan_us <= lb.bound_us * 1.05 and step > lb.bound_us * 1.05:
        parts.append(f"the scheduler's full-speed evaluator reaches {best.makespan_us:.0f} us; the simulated "
                     "slowdown of overlapped compute adds the rest")
    if not parts:
        parts.append(f"not explained by the bounds; exposed comm {ours.exposed_comm_pct:.1f}% of the step")
    return "; ".join(parts)


# -------------------------------------------------------------------------------------------- suite


def run_case(case, options: ConcertoBenchOptions, *, export_trace: bool = False) -> dict:
    """Compile one suite case deviceless, compare, optionally export traces; returns a row of ``COLUMNS``."""
    from bench.baseline import compile_case
    from models.registry import MODELS

    t0 = time.perf_counter()
    row = dict.fromkeys(COLUMNS, "")
    row.update(case=case.name, cluster=case.cluster, mesh="x".join(map(str, case.mesh_shape)))
    if case.model not in MODELS:
        row["status"] = f"skipped: model {case.model!r} not registered in models"
        return row
    cc = compile_case(case)
    cluster, cost_model, tc, preset = cc.cluster, cc.cost_model, cc.compiled, cc.preset
    log.info("%s: compiled in %.1fs (LHS dump: %s)", case.name, tc.compile_s, tc.before_lhs_text is not None)
    cmp_ = compare(tc.before_lhs_text, tc.final_text, cost_model, options, after_text=tc.after_lhs_text,
                   label=case.name)
    row.update(cmp_.row)
    row.update(status=f"ok ({preset})", compile_s=round(tc.compile_s, 1),
               case_wall_s=round(time.perf_counter() - t0, 1))
    if export_trace:
        base = os.path.join(options.out_dir, f"{options.prefix}_{case.name}")
        concerto_report.write_trace_pair(f"{base}.trace.json", cmp_, case.name, cluster.name)
        concerto_report.write_gantt_pair(f"{base}.gantt.png", cmp_, case.name)
    return row


def run(cases: Sequence, options: ConcertoBenchOptions = ConcertoBenchOptions(), command: str = "") -> list[dict]:
    """Run ``cases``; write ``<prefix>.csv`` and ``<prefix>.md`` under ``options.out_dir``; returns the rows."""
    from concerto_jax.costmodel import CostModel, get_cluster

    os.makedirs(options.out_dir, exist_ok=True)
    t0 = time.perf_counter()

    def done(k, case, row):
        log.info("[%d/%d] %s: xla %s us, ours %s us (gain %s, %s), S+F %s us, bound %s us, noise max |d| %s%% "
                 "[%.0fs elapsed] %s", k, len(cases), case.name, row["xla_step_us"], row["ours_step_us"],
                 row["gain"], row["ours_source"], row["sf_step_us"], row["lower_bound_us"],
                 row["noise_max_abs_delta_pct"], time.perf_counter() - t0, row["status"])

    rows = suite.run_each(cases, lambda case, export_trace: run_case(case, options, export_trace=export_trace),
                          COLUMNS, options.trace_case, done)
    with open(os.path.join(options.out_dir, f"{options.prefix}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    desc = CostModel(get_cluster(cases[0].cluster)).describe() if cases else {}
    with open(os.path.join(options.out_dir, f"{options.prefix}.md"), "w") as f:
        f.write(concerto_report.markdown(rows, command, desc, options, time.perf_counter() - t0))
    log.info("wrote %s.{csv,md}", os.path.join(options.out_dir, options.prefix))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options (shared by ``main`` and a ``concerto`` subcommand of ``bench.cli``)."""
    parser.add_argument("--case", action="append", help="run only this case (repeatable)")
    parser.add_argument("--quick", action="store_true", help="run only the quick subset (bench.suite.QUICK)")
    parser.add_argument("--noise", type=float, default=0.1, help="relative half-width of the duration noise")
    parser.add_argument("--noise-trials", type=int, default=5, help="noisy re-simulations per case (0: none)")
    parser.add_argument("--no-fusion", action="store_true", help="skip Concerto(S+F)")
    parser.add_argument("--rcpsp-bound-s", type=float, default=10.0, help="CP-SAT limit of the proven bound (0: skip)")
    parser.add_argument("--out", default="bench/results", help="output directory")
    parser.add_argument("--prefix", default=None, help="result file prefix (default: concerto_vs_xla[_quick])")
    parser.add_argument("--trace-case", default=None, help="case exported as Perfetto traces + Gantt PNG")
    parser.add_argument("--memory-ratio", type=float, default=1.0,
                        help="memory limit = this x the peak of XLA's order (scheduler's memory model)")
    parser.add_argument("-v", "--verbose", action="store_true")


def command_line(args: argparse.Namespace, program: str = "python -m bench.concerto_vs_xla") -> str:
    """The command that reproduces ``args`` (for the report)."""
    parts = [program] + [f"--case {c}" for c in args.case or ()]
    parts += ["--quick"] if args.quick else []
    parts += [f"--noise {args.noise}", f"--noise-trials {args.noise_trials}"]
    parts += ["--no-fusion"] if args.no_fusion else []
    parts += [f"--rcpsp-bound-s {args.rcpsp_bound_s}"] if args.rcpsp_bound_s != 10.0 else []
    parts += [f"--out {args.out}"] if args.out != "bench/results" else []
    parts += [f"--prefix {args.prefix}"] if args.prefix else []
    parts += [f"--trace-case {args.trace_case}"] if args.trace_case else []
    return " ".join(parts)


def run_from_args(args: argparse.Namespace, program: str = "python -m bench.concerto_vs_xla") -> int:
    """Run the comparison for parsed ``args`` (see ``add_arguments``); prints the markdown; returns the exit status."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compile: JAX on CPU (set before JAX starts)
    import jax

    # This module's imports already loaded JAX (which read the environment then): set the
    # platform through the config too, before any backend or plugin starts.
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from concerto_jax.scheduler import ScheduleOptions

    cases = suite.select_cases(args.case, args.quick)
    prefix = args.prefix or ("concerto_vs_xla_quick" if args.quick or args.case else "concerto_vs_xla")
    opts = ConcertoBenchOptions(out_dir=args.out, prefix=prefix, fusion=not args.no_fusion,
                                rcpsp_bound_s=args.rcpsp_bound_s, noise=args.noise,
                                noise_trials=args.noise_trials, trace_case=args.trace_case,
                                schedule=ScheduleOptions(memory_limit_ratio=args.memory_ratio))
    rows = run(cases, opts, command_line(args, program))
    with open(os.path.join(args.out, f"{prefix}.md")) as f:
        sys.stdout.write(f.read())
    bad = [r["case"] for r in rows if str(r["status"]).startswith("ok") and r["ours_vs_xla_ok"] is not True]
    over = [r["case"] for r in rows if str(r["status"]).startswith("ok")
            and r.get("ours_within_memory_limit") is not True]
    if over:
        log.error("ours above the memory limit on %s", over)
        bad += over
    if bad:
        log.error("ours slower than XLA on %s", bad)
    return 0 if not bad and all(not str(r["status"]).startswith("error") for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.concerto_vs_xla [--case NAME] [--quick] [--noise 0.1 --noise-trials 5]``."""
    parser = argparse.ArgumentParser(prog="python -m bench.concerto_vs_xla", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
