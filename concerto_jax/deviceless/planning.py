"""Our order of XLA's scheduled module, judged: the plan every ``compile_for_target`` decision
compares (``plan_on``), within XLA's own scheduler memory limit on the target where asked
(``memory_budget``)."""

from __future__ import annotations

import dataclasses
import time

from concerto_jax.deviceless import reschedule
from concerto_jax.judge import Judged, judge_module
from concerto_jax.report import PassRecord
from hlo_passes.ir import parse_module
from hlo_passes.registry import NO_INPUTS, PassInputs


@dataclasses.dataclass(frozen=True)
class Plan:
    """One plan of a program on XLA's scheduled module.

    Attributes:
      handed: the module text for XLA's backend (our order; XLA's where "schedule" does not run).
      judged: its figures by the judge (``judge.judge_module``).
      record: the "schedule" pass record, or None without schedule.
      memory: ``input_peak_bytes`` / ``peak_bytes`` / ``memory_limit_bytes`` of the entry
        (empty without schedule).
    """

    handed: str
    judged: Judged
    record: PassRecord | None
    memory: dict


def rewriting_options(options, rewriting: tuple[str, ...], budget: int | None = None):
    """``options`` for the rewriting passes ``rewriting`` of a ``compile_for_target`` plan:
    decompose plans loop rotations within the program's memory budget ``budget``
    (``DecomposeOptions.memory_budget_bytes``, from ``memory_budget``)."""
    options = dataclasses.replace(options, passes=rewriting)
    if budget is None or "decompose" not in rewriting:
        return options
    return dataclasses.replace(options, decompose=dataclasses.replace(
        options.decompose, memory_budget_bytes=budget))


def pass_inputs(reference: str | None) -> PassInputs:
    """What the rewriting passes get besides the post-SPMD module: XLA's scheduled module of
    the stock compile ``reference`` (decompose costs each instruction by XLA's fusion of the
    same step); none without one."""
    return NO_INPUTS if reference is None else PassInputs(fused_reference=reference)


def xla_scheduler_memory_limit(module, gpu, compiler_options=None) -> int:
    """The memory limit XLA's GPU latency hiding scheduler holds a module to on ``gpu``.

    XLA (``gpu_hlo_schedule.cc``, ``GetSchedulerMemoryLimit``): 80 % of the device's memory,
    minus the bytes of the entry's parameters and outputs (assumed live throughout), times
    ``xla_gpu_memory_limit_slop_factor`` % (95 by default; read from ``compiler_options``
    where set). Aliased outputs are counted twice here (XLA subtracts them): a lower, safer
    limit. ``module``: an ``hlo_passes`` module; ``gpu``: a ``costmodel.specs.GpuSpec``.
    """
    slop = int(dict(compiler_options or {}).get("xla_gpu_memory_limit_slop_factor", 95))
    entry = module.entry
    io = sum(p.shape.byte_size for p in entry.parameters)
    if entry.root is not None:
        io += entry.root.shape.byte_size
    return max(0, (gpu.memory_bytes * 80 // 100 - io) * slop // 100)


def memory_budget(scheduled_src: str | None, options, cost_model) -> int | None:
    """XLA's own scheduler memory limit for the program of ``scheduled_src`` on the target
    (``xla_scheduler_memory_limit``) when ``plan_on`` should plan within it too; None where
    it should not (``Options.deviceless.memory_budget="input"``, no "schedule" pass, or a scheduler
    limit the user set in bytes or turned off)."""
    if (scheduled_src is None or options.deviceless.memory_budget == "input" or "schedule" not in options.passes
            or options.scheduler.memory_limit_bytes is not None
            or options.scheduler.memory_limit_ratio is None):
        return None
    return xla_scheduler_memory_limit(parse_module(scheduled_src, source="xla-after-lhs"),
                                      cost_model.gpu, options.compiler_options)


def plan_on(scheduled_src: str, options, cost_model, seconds: dict,
             budget: int | None = None) -> Plan:
    """Our order of XLA's scheduled module ``scheduled_src`` when "schedule" runs (else as is),
    judged (``judge.judge_module``): the plan every decision of a ``compile_for_target`` call
    compares.

    With a ``budget`` (``memory_budget``) the module is planned within that budget, the limit
    XLA's own scheduler has on the target; with ``memory_budget="both"`` it is also planned held
    to the peak of XLA's order (``options.scheduler``'s limit) and the faster by the judge is
    kept (the held one on a tie). Under ``"xla"`` the held plan is made for the chosen program
    only (``with_held_plan``; docs/DECISIONS.md D17, D48).

    Returns:
      A ``Plan`` (``memory`` empty without schedule).

    Raises:
      RuntimeError: our order's peak exceeds the memory limit.
    """
    if "schedule" not in options.passes:
        return Plan(scheduled_src, judge_module(scheduled_src, cost_model), None, {})
    if budget is None:
        return plan_once(scheduled_src, options, cost_model, seconds)
    within = dataclasses.replace(options, scheduler=dataclasses.replace(
        options.scheduler, memory_budget_bytes=budget))
    plan = plan_once(scheduled_src, within, cost_model, seconds)
    rec = plan.record
    plan = dataclasses.replace(plan, record=dataclasses.replace(rec, stats={
        **rec.stats, "memory_budget": options.deviceless.memory_budget, "xla_memory_limit_bytes": budget}))
    if options.deviceless.memory_budget == "both":
        plan = with_held_plan(plan, scheduled_src, options, cost_model, seconds, budget)
    return plan


def with_held_plan(plan: Plan, scheduled_src: str, options, cost_model, seconds: dict,
                   budget: int | None) -> Plan:
    """``plan`` (``plan_on``'s, within ``budget``) or the plan of the same module held to the peak
    of XLA's order, whichever the judge finds faster (the held one on a tie), with both in the
    schedule record's ``memory_candidates``. The held plan has less overlap; the scheduler's
    objective has no overlap slowdown, and XLA's passes after its scheduler treat the two orders
    differently, so it is sometimes the faster (D17, D48). ``plan`` itself where there is no
    budget, no schedule record, or the budget is not above the held limit."""
    if budget is None or plan.record is None or "memory_candidates" in plan.record.stats:
        return plan
    limit = options.scheduler.memory_limit_for(plan.memory.get("input_peak_bytes"))
    if limit is None or budget <= limit:
        return plan
    held = plan_once(scheduled_src, options, cost_model, seconds, same_as=plan)
    tried = [{"memory_limit_bytes": limit, "planned_us": round(held.judged.us, 1),
              "peak_bytes": held.memory.get("peak_bytes")},
             {"memory_limit_bytes": plan.memory.get("memory_limit_bytes"),
              "planned_us": round(plan.judged.us, 1), "peak_bytes": plan.memory.get("peak_bytes")}]
    kept = held if held.judged.us <= plan.judged.us else plan
    rec = kept.record
    return dataclasses.replace(kept, record=dataclasses.replace(rec, stats={
        **rec.stats, "memory_budget": options.deviceless.memory_budget, "xla_memory_limit_bytes": budget,
        "memory_candidates": tried}))


def plan_once(scheduled_src: str, options, cost_model, seconds: dict, same_as: Plan | None = None) -> Plan:
    """One run of the schedule pass over ``scheduled_src`` (``plan_on``), judged (the judge of
    ``same_as``, an earlier plan, reused when the order is the same)."""
    t0 = time.perf_counter()
    r = reschedule.reschedule_text(scheduled_src, cost_model, options)
    dt = time.perf_counter() - t0
    seconds["schedule"] = seconds.get("schedule", 0.0) + dt
    entry = r.computations[-1]
    stats = {"target": options.target, "computations": len(r.computations), "changed": list(r.changed),
             "tasks": sum(c.tasks for c in r.computations),
             "collectives": sum(c.collectives for c in r.computations),
             "program_order_us": round(r.input_us, 1), "scheduled_us": round(r.scheduled_us, 1),
             "gain": round(r.input_us / r.scheduled_us, 4) if r.scheduled_us > 0 else 1.0,
             "source": entry.source, "input_peak_bytes": entry.input_peak_bytes,
             "peak_bytes": entry.peak_bytes, "memory_limit_bytes": entry.memory_limit_bytes,
             "on": "xla_scheduled"}
    if (entry.memory_limit_bytes is not None and entry.peak_bytes is not None
            and entry.peak_bytes > entry.memory_limit_bytes):
        raise RuntimeError(f"our order's peak {entry.peak_bytes} B exceeds the memory limit "
                           f"{entry.memory_limit_bytes} B")
    same = same_as is not None and same_as.handed == r.text
    return Plan(r.text, same_as.judged if same else judge_module(r.text, cost_model),
                PassRecord("schedule", bool(r.changed), dt, stats),
                dict(input_peak_bytes=entry.input_peak_bytes, peak_bytes=entry.peak_bytes,
                     memory_limit_bytes=entry.memory_limit_bytes))
