"""Strategy search of the ``decompose`` pass: candidates, CP-SAT choice, joint revision by scheduling.

Stages, per computation (the entry, and while bodies of scanned layers)::

    task graph (costed)  -> judge's schedule (the schedule pass's scheduler) + simulation
                         -> critical collectives: P/S/I rule, then simulated stall (critical.py)
    each critical D, each axis its rule splits -> context BFS (context.py)
    each degree N = 2, 4, ... dividing the context -> predicted gain (cost.py)
    candidates with a positive gain -> CP-SAT choice (choose.py)
    joint: rewrite + schedule + simulate the whole module; try other N / axis / none
           for each chosen collective, keep what the simulated step says is faster

The paper decides the decomposition first and schedules after; the joint
stage judges every strategy by the schedule it actually gets.

Compute costs: one kernel per HLO op (the cost model's unfused estimate) unless
the pass was given XLA's scheduled module of the same step
(``PassInputs.fused_reference``); then every stage costs an instruction
by its share of the XLA kernel it is fused into (``costmodel.fused``), a chunk
of a decomposed instruction ``o`` by ``ratio(o) x`` the chunk's unfused
estimate, and the slices / concatenations a split adds by their unfused
estimate (see ``trial_durations``).

References: Concerto (ASPLOS'25) §5.
"""

from __future__ import annotations

import dataclasses
import logging
import types

from concerto_jax import scheduler
from concerto_jax.costmodel.fused import FusedCosts
from concerto_jax.costmodel.hlo_ops import op_info
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.judge import judge_graph
from concerto_jax.simulator import SimOptions
from hlo_passes.decompose import rules
from hlo_passes.decompose.choose import Candidate
from hlo_passes.decompose.context import build_context
from hlo_passes.decompose.cost import Calibration, strategy_cost
from hlo_passes.decompose.critical import exposed_by_schedule, find_critical
from hlo_passes.decompose.options import DecomposeOptions
from hlo_passes.decompose.rewrite import split_instructions
from hlo_passes.ir import channel_counter, device_groups, module_to_text, parse_module

log = logging.getLogger(__name__)


def _view(module, comp):
    """A module-like view whose entry is ``comp`` (the task graph of one computation)."""
    return types.SimpleNamespace(entry=comp, num_devices=module.num_devices,
                                 name=f"{module.name}/{comp.name}",
                                 # the whole module's: a loop body's graph looks up its while
                                 instructions=module.instructions,
                                 computation=module.computation)


def computations_to_search(module, options: DecomposeOptions) -> list:
    """The entry computation and, with ``loop_bodies``, every while body."""
    comps = [module.entry]
    if options.loop_bodies:
        for inst in module.instructions():
            if inst.opcode == "while" and inst.attr("body") is not None:
                body = inst.attr("body")
                if body not in comps:
                    comps.append(body)
    return comps


def judge_options(options: DecomposeOptions,
                  schedule_options: scheduler.ScheduleOptions | None = None) -> scheduler.ScheduleOptions:
    """The scheduler settings of the judge: the schedule pass's (``schedule_options``), with
    the whole-graph CP-SAT solve off, ``options.judge_rounds`` odd-even rounds (0: the list
    heuristic alone) and no progress lines. The memory rule is the schedule pass's."""
    base = schedule_options or scheduler.ScheduleOptions()
    oe = None
    if options.judge_rounds > 0:
        oe = dataclasses.replace(base.odd_even or scheduler.OddEvenOptions(),
                                 rounds=options.judge_rounds, progress=False)
    return dataclasses.replace(base, full_model_max_tasks=0, odd_even=oe, progress=False)


def judge_schedule(graph, initial, sched_options: scheduler.ScheduleOptions, slowdown: float,
                   with_result: bool = False):
    """(events, ``SimResult``) of ``graph`` scheduled by the judge and simulated (and the
    ``ScheduleResult`` with ``with_result``)."""
    j = judge_graph(graph, initial, schedule=sched_options,
                    sim=SimOptions(overlap_slowdown=slowdown, memory=False))
    events = list(j.events)
    return (events, j.sim, j.schedule) if with_result else (events, j.sim)


@dataclasses.dataclass
class Found:
    """Candidates and the context of each, for one module.

    ``exposed`` lists the critical collectives, most exposed first, as dicts
    (computation, collective, opcode, time, exposed, P/S/I bound, the rule that decided);
    ``judged`` per computation: the judge's simulated step and exposed communication.
    """

    candidates: list[Candidate]
    contexts: dict  # Candidate.key: (computation, collective, axis, variant) -> Context
    critical: int = 0
    collectives: int = 0
    exposed: list = dataclasses.field(default_factory=list)
    judged: dict = dataclasses.field(default_factory=dict)


def find_candidates(module, cost_model, calibration: Calibration,
                    options: DecomposeOptions,
                    schedule_options: scheduler.ScheduleOptions | None = None,
                    fused: FusedCosts | None = None) -> Found:
    """Critical collectives, their contexts and the strategies predicted to gain.

    Args:
      module: the post-SPMD module (not modified).
      cost_model: the target's cost model.
      calibration: measured overlap slowdown and per-chunk overhead.
      options: the pass's options.
      schedule_options: the schedule pass's scheduler options (the judge derives its own
        from them, see ``judge_options``); None: the defaults.
      fused: fusion-aware costs of ``module``'s instructions (``fused_costs``); None: the
        cost model's unfused estimate, one kernel per op.
    """
    cache: dict = {}
    durations = fused.us if fused is not None else None
    copies = 0.0 if fused is not None and options.split_copies == "zero" else 1.0

    def cost_of(inst) -> float:
        if durations is not None and inst.name in durations:
            return durations[inst.name]
        return cost_model.compute_us(op_info(inst, cache))

    found = Found([], {})
    judge = judge_options(options, schedule_options)
    for comp in computations_to_search(module, options):
        hg = build_taskgraph(_view(module, comp), cost_model, durations_us=durations)
        # Fused costs already hold each kernel's launch once (shared by its instructions).
        launch = (cost_model.options.compute.launch_overhead_us
                  if options.fused_slack and fused is None else 0.0)
        stalls = None
        if options.criticality == "schedule" and any(t.is_collective for t in hg.graph.tasks):
            events, sim = judge_schedule(hg.graph, hg.events, judge, calibration.overlap_slowdown)
            stalls = exposed_by_schedule(hg.graph, events, sim.timings)
            prog = judge_graph(hg.graph, hg.events, sim=SimOptions(
                overlap_slowdown=calibration.overlap_slowdown, memory=False)).sim
            found.judged[comp.name] = {"program_order_us": round(prog.step_time_us, 1),
                                       "step_us": round(sim.step_time_us, 1),
                                       "exposed_comm_us": round(sim.exposed_comm_us, 1)}
        crits = find_critical(hg.graph, only_critical=False, launch_us=launch,
                              scheduled_exposed=stalls, min_exposed_us=options.min_exposed_us,
                              min_exposed_frac=options.min_exposed_frac)
        found.collectives += len(crits)
        for rec in crits:
            found.critical += rec.critical
            if rec.critical:
                found.exposed.append({
                    "computation": comp.name, "collective": rec.name,
                    "opcode": comp.instruction(rec.name).opcode, "time_us": round(rec.time_us, 1),
                    "exposed_us": round(rec.exposed_us, 1),
                    "psi_bound_us": round(rec.bound_exposed_us, 1), "rule": rec.rule})
            if not rec.critical and options.force_degree is None:
                continue
            coll = comp.instruction(rec.name)
            if coll.async_role is not None:
                continue  # already async (a scheduled module): not ours to split
            groups = device_groups(coll, module.num_devices)
            for axis in sorted(rules.axis_map(coll)):
                ctx = build_context(coll, axis, cost_of, max_ops=options.max_context_ops,
                                    cover_us=options.cover_factor * rec.time_us)
                if ctx is None or (not ctx.pre and not ctx.post):
                    continue
                variants = {"both": ctx}
                if ctx.pre and ctx.post and options.one_sided:
                    variants["pre"] = ctx.trimmed(True, False, cost_of)
                    variants["post"] = ctx.trimmed(False, True, cost_of)
                for variant, vctx in variants.items():
                    if not vctx.pre and not vctx.post:
                        continue
                    found.contexts[(comp.name, coll.name, axis, variant)] = vctx
                    n = 2
                    while n <= min(options.max_degree, vctx.max_degree()):
                        if vctx.divisible_by(n):
                            sc = strategy_cost(vctx, n, cost_model, rec.exposed_us, rec.time_us,
                                               calibration, groups, fused=fused,
                                               copies=copies)
                            found.candidates.append(Candidate(
                                coll.name, axis, n, sc.gain_us, frozenset(vctx.members()),
                                comp.name, variant))
                        n *= 2
    found.exposed.sort(key=lambda r: -r["exposed_us"])
    return found


def apply(module, chosen: list[Candidate], contexts: dict,
          chunks_of: dict[str, str] | None = None, isolate: bool = False) -> list[dict]:
    """Rewrite ``module`` in place by the chosen strategies (contexts found on ``module``
    or on a module with the same instruction names); with ``chunks_of``, record there
    each chunk's name -> the name of the instruction it is a chunk of. ``isolate``: see
    ``split_instructions`` (chunks read their outside operands through their own
    opt-barriers, so that XLA cannot fuse the chunks back together)."""
    fresh = channel_counter(module)

    done = []
    for c in chosen:
        ctx = contexts[c.key]
        comp = module.computation(c.computation)
        plans = {comp.instruction(i.name): p for i, p in ctx.plans.items()}
        res = split_instructions(comp, plans, c.n, fresh, isolate=isolate)
        if chunks_of is not None:
            for orig, names in res.chunks.items():
                chunks_of.update(dict.fromkeys(names, chunks_of.get(orig, orig)))
        done.append({"collective": c.collective, "computation": c.computation, "axis": c.axis,
                     "n": c.n, "sides": c.variant, "predicted_gain_us": round(c.gain_us, 2),
                     "members": len(ctx.plans), "slices": len(res.slices),
                     "concats": len(res.concats), "barriers": len(res.barriers)})
    return done


def trial_durations(module, fused: FusedCosts, chunks_of: dict[str, str], cost_model,
                    split_copies: str = "estimate") -> dict[str, float]:
    """Compute durations of a rewritten copy of the module ``fused`` was computed on.

    Instructions still there keep their fused cost; a chunk of instruction ``o`` costs
    ``fused.ratio(o)`` x its own unfused estimate (a chunk of a GEMM fused with its epilogue
    stays a GEMM with a free epilogue); the slices and concatenations the rewrite adds are
    left out (``build_taskgraph`` gives them their unfused estimate: conservative, XLA may
    fuse them into a neighbour, only its final module tells), or cost 0 with
    ``split_copies="zero"``.
    """
    out = dict(fused.us)
    cache: dict = {}
    for inst in module.instructions():
        orig = chunks_of.get(inst.name)
        if orig is not None and inst.collective_kind is None:
            out[inst.name] = fused.ratio(orig) * cost_model.compute_us(op_info(inst, cache))
        elif (split_copies == "zero" and inst.name not in out
              and inst.opcode in ("slice", "concatenate")):
            out[inst.name] = 0.0
    return out


def simulated_step_us(module, cost_model, slowdown: float,
                      sched_options: scheduler.ScheduleOptions | None = None,
                      with_limit: bool = False, durations_us: dict[str, float] | None = None):
    """Step time of ``module``'s entry computation scheduled by the judge
    (``judge_options``; None: the list heuristic under the default memory rule) and
    simulated with the measured overlap slowdown (with ``with_limit``: and the memory
    limit in bytes the schedule was held to); ``durations_us`` as in ``build_taskgraph``."""
    hg = build_taskgraph(module, cost_model, durations_us=durations_us)
    if sched_options is None:
        sched_options = scheduler.ScheduleOptions(full_model_max_tasks=0, odd_even=None,
                                                  progress=False)
    _, sim, res = judge_schedule(hg.graph, hg.events, sched_options, slowdown, with_result=True)
    return (sim.step_time_us, res.memory_limit_bytes) if with_limit else sim.step_time_us


def _copy(module):
    return parse_module(module_to_text(module), source="decompose-trial")


def joint_revise(module, found: Found, chosen: list[Candidate], cost_model,
                 calibration: Calibration, options: DecomposeOptions,
                 schedule_options: scheduler.ScheduleOptions | None = None,
                 fused: FusedCosts | None = None) -> tuple[list[Candidate], dict]:
    """Judge ``chosen`` by the simulated schedule of the rewritten module and revise it.

    Only the entry computation is simulated (while bodies are judged by the
    predicted gain alone). Each chosen collective in turn tries its other
    candidates and "none"; a change is kept when the simulated step is faster.

    With ``fused``, every simulated module is costed by ``trial_durations``.

    Returns:
      The revised choice and the figures (baseline, first choice, final, and one verdict
      per tried strategy: ``"kept"``, ``"dropped"`` or ``"replaced by axis a N=n"``).
    """
    evals = [0]
    judge = judge_options(options, schedule_options)

    def score(choice: list[Candidate]) -> float:
        evals[0] += 1
        trial = _copy(module)
        entry_choice = [c for c in choice if c.computation == module.entry.name]
        chunks_of: dict[str, str] = {}
        apply(trial, entry_choice, found.contexts, chunks_of, isolate=options.isolate_chunks == "all")
        durations = None if fused is None else trial_durations(trial, fused, chunks_of, cost_model,
                                                               options.split_copies)
        return simulated_step_us(trial, cost_model, calibration.overlap_slowdown, judge,
                                 durations_us=durations)

    evals[0] += 1
    base, limit = simulated_step_us(_copy(module), cost_model, calibration.overlap_slowdown,
                                    judge, with_limit=True,
                                    durations_us=None if fused is None else fused.us)
    # Every rewritten graph is held to the unsplit module's limit in bytes: the memory rule
    # is relative to the input order's peak, and a split that raises the program-order peak
    # would otherwise buy its schedule more memory (a "gain" that is not the split's).
    if limit is not None:
        judge = dataclasses.replace(judge, memory_limit_bytes=limit)
    current = list(chosen)
    best = score(current) if current else base
    first = best
    entry = module.entry.name
    verdicts = []
    for c in list(current):
        if c.computation != entry:
            continue
        orig, before = c, best
        alts = [a for a in found.candidates if a.computation == entry
                and a.collective == c.collective and (a.axis, a.n, a.variant)
                != (c.axis, c.n, c.variant)]
        alts.sort(key=lambda a: -a.gain_us)
        for alt in [None] + alts[:options.joint_alternatives]:
            if evals[0] >= options.joint_max_evaluations:
                break
            others = [x for x in current if x is not c]
            if alt is not None and any(alt.members & x.members for x in others
                                       if x.computation == alt.computation):
                continue
            trial = others + ([alt] if alt is not None else [])
            t = score(trial)
            if t < best - 1e-9:
                best, current = t, trial
                if alt is None:
                    break
                c = alt
        if c is orig and orig in current:
            verdict = "kept"
        elif c is orig:
            verdict = "dropped"
        else:
            verdict = f"replaced by axis {c.axis} N={c.n} sides {c.variant}"
        verdicts.append({"collective": orig.collective, "axis": orig.axis, "n": orig.n,
                         "sides": orig.variant,
                         "predicted_gain_us": round(orig.gain_us, 2), "verdict": verdict,
                         "simulated_before_us": round(before, 1), "simulated_after_us": round(best, 1)})
    stats = {"baseline_us": round(base, 1), "first_choice_us": round(first, 1),
             "joint_us": round(best, 1), "evaluations": evals[0], "verdicts": verdicts}
    return current, stats
