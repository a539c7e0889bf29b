"""The ``decompose`` pass: split the computation around critical collectives (Concerto ASPLOS'25 §5).

Two strategies. **Regions** first (``DecomposeOptions.region_degree``, default 2;
``hlo_passes.decompose.region``): in each computation the best-scoring region
of a collective (everything that splits with it along one axis, the whole
forward and backward pass for a batch axis) becomes ``N`` micro-batches that
share the weights, each reading them through its own opt-barriers so that XLA
cannot fuse the chunks back together; weight gradients and losses are summed
(declared tolerance ``region_tolerance``, 1e-3). Where no computation has a
region with a positive score, the per-collective **contexts** below. After the region
split of a loop body, the loop may be **rotated** (``DecomposeOptions.rotate_loops``,
``hlo_passes.pipeline_loops.decide_rotation``): the last chunk's final collective of iteration ``i``
completes during iteration ``i + 1``, against the next layer's first chunk, where the rotated
body plans faster within the body's memory limit (bitwise: only the order changes).

After either strategy, **collectives of replicated operands**
(``DecomposeOptions.replicated_reductions``, ``hlo_passes.replicated_reductions.decide``): an
all-reduce (reduce-scatter, all-gather) whose operand every device of an orthogonal group
holds equal (a replicated parameter's gradient under data x tensor parallelism, proven by
``hlo_passes.ir.uniformity``) moves ``1/h`` of it and all-gathers the rest over that group,
where the cost model says it is cheaper (across hosts; bitwise: each element is reduced
over the same devices).

Contexts: finds the collectives that independent work cannot hide, grows each one's
decomposition context along every axis the SPMD rules allow, predicts the
gain of each degree, chooses by CP-SAT, revises the choice by scheduling and
simulating the rewritten module (``DecomposeOptions.joint``), and rewrites
the module (``hlo_passes.decompose.rewrite``). Run it before ``schedule``,
which then places the chunks' collectives against each other's compute.

Every context split the rules allow keeps each output element's arithmetic (no sum is
reassociated). Results are bitwise equal except where a dot or convolution is
split: XLA:CPU may then block the chunk's GEMM differently (observed max
relative difference 4e-5). The pass declares ``DecomposeOptions.split_tolerance``
(1e-4) to the first-step check whenever a decomposed context holds a dot or a
convolution, and 0 (bitwise) otherwise. A strategy whose rewrite fails (a rule
could not prove the split safe for this instruction) is dropped with one
warning and the rest of the module is still decomposed.

Costs: given XLA's scheduled module of the same step
(``PassInputs.fused_reference``, given by ``compile_for_target``), every
judgement uses fusion-aware costs (``costmodel.fused.fused_costs``, computed
once on the unsplit module); otherwise one kernel per op.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.costmodel.fused import fused_costs
from hlo_passes.decompose import rules
from hlo_passes.decompose.choose import choose
from hlo_passes.decompose.cost import CALIBRATION_FILE, Calibration
from hlo_passes.decompose.options import DecomposeOptions
from hlo_passes.decompose.region import (
    build_region,
    grow_through_carries,
    pull_in_inputs,
    score_region,
)
from hlo_passes.decompose.rewrite import (
    barrier_state_reads,
    carried_splits,
    release_barrier_state_reads,
    split_instructions,
    split_while_body,
)
from hlo_passes.decompose.search import apply, computations_to_search, find_candidates, joint_revise
from hlo_passes.ir import channel_counter
from hlo_passes.ir.errors import HloError
from hlo_passes.options import PassOptions
from hlo_passes.pipeline_loops.decide import decide_rotation
from hlo_passes.registry import NO_INPUTS, PassInputs, PassOutcome, Retry
from hlo_passes.replicated_reductions.decide import plan_replicated_reductions
from hlo_passes.replicated_reductions.rewrite import split_replicated_collective

log = logging.getLogger(__name__)


_BLOCKED_OPS = frozenset({"dot", "convolution"})
"""Ops whose chunks XLA:CPU may compute with a differently blocked kernel (not bitwise)."""


class DecomposeWarning(UserWarning):
    """A strategy was dropped because its rewrite could not be proven safe."""


def decompose_pass(module, options: PassOptions, inputs: PassInputs = NO_INPUTS) -> PassOutcome:
    """Decompose ``module``'s critical collectives; see the module docstring. ``inputs``: XLA's
    scheduled module of the same step (fusion-aware costs) or nothing (unfused costs)."""
    dopts = getattr(options, "decompose", None) or DecomposeOptions()
    cost_model = CostModel(get_cluster(options.target))
    if dopts.split:
        outcome = _split(module, options, dopts, cost_model, inputs)
    else:
        outcome = PassOutcome(changed=False, stats={"target": options.target,
                                                    "strategy": "none (DecomposeOptions.split=False)"})
    if not dopts.replicated_reductions:
        return outcome
    records = _replicated_reductions(module, cost_model)
    if not records:
        return outcome
    # where the split changed the module, compile_for_target's guard may try the program
    # without it (the replicated-operand collectives alone) when the whole rewrite loses
    fallback = (Retry("fallback", "split", (("split", False),)),) if outcome.changed else ()
    return PassOutcome(changed=True, stats={**outcome.stats, "replicated": records,
                                            "split_changed": outcome.changed},
                       tolerance=outcome.tolerance, retries=outcome.retries + fallback)


def _replicated_reductions(module, cost_model) -> list[dict]:
    """Every all-reduce, reduce-scatter or all-gather of an operand replicated over an
    orthogonal group whose sliced form is cheaper (``hlo_passes.replicated_reductions.decide``),
    rewritten; one record each."""
    fresh = channel_counter(module)

    records = []
    for plan in plan_replicated_reductions(module, cost_model):
        inst = plan.pop("instruction")
        name = inst.name
        try:
            split_replicated_collective(inst, plan["gather_groups"], plan["dim"], fresh)
        except HloError as err:
            log.warning("decompose: %s of a replicated operand left whole: %s", name, err)
            continue
        records.append({"collective": name, "kind": inst.opcode, "computation": plan["computation"],
                        "h": plan["h"], "dim": plan["dim"], "bytes": plan["bytes"],
                        "before_us": plan["before_us"], "after_us": plan["after_us"],
                        "gather_groups": len(plan["gather_groups"])})
    if records:
        log.info("decompose: %d collectives of replicated operands sliced: %s", len(records), records)
    return records


def _split(module, options, dopts: DecomposeOptions, cost_model, inputs: PassInputs) -> PassOutcome:
    """The region or context split (module docstring)."""
    calibration = Calibration.load(dopts.calibration_path or CALIBRATION_FILE)
    measured_slowdown = calibration.overlap_slowdown
    if calibration.platform != "gpu":
        # Every target cluster is a GPU one; a slowdown measured on the CPU (2 shared cores:
        # core contention, 1.5-2.3 between runs) says nothing about SM / HBM sharing. Use
        # the cost model's configured figure, the one every simulated bench figure uses.
        calibration = dataclasses.replace(
            calibration, overlap_slowdown=cost_model.options.overlap_slowdown)
    sched_opts = getattr(options, "scheduler", None)
    region_stats = None
    if dopts.region_degree is not None and dopts.force_degree is None:
        outcome = _region_split(module, options, dopts, cost_model)
        if outcome.changed:
            return outcome
        region_stats = outcome.stats
    fused, fused_stats = None, None
    if inputs.fused_reference is not None:
        try:
            fused = fused_costs(module, inputs.fused_reference, cost_model, unmapped=dopts.fused_unmapped)
            fused_stats = fused.summary()
        except Exception as err:  # noqa: BLE001 - a cost refinement; unfused costs still work
            log.warning("decompose: fused costs failed (%s); judging with unfused costs", err)
            fused_stats = {"error": str(err)}
    found = find_candidates(module, cost_model, calibration, dopts, sched_opts, fused=fused)
    if dopts.force_degree is not None:
        forced = [dataclasses.replace(c, gain_us=1.0) for c in found.candidates
                  if c.n == dopts.force_degree
                  and (dopts.force_axis is None or c.axis == dopts.force_axis)]
        chosen = choose(forced, time_limit_s=dopts.choice_time_limit_s)
    else:
        chosen = choose(found.candidates, time_limit_s=dopts.choice_time_limit_s)
    joint_stats = {}
    if dopts.joint and chosen and dopts.force_degree is None:
        chosen, joint_stats = joint_revise(module, found, chosen, cost_model, calibration, dopts,
                                           sched_opts, fused=fused)
    decomposed, dropped = [], []
    tolerance = 0.0
    for cand in chosen:
        ctx = found.contexts[cand.key]
        try:
            decomposed.extend(apply(module, [cand], found.contexts, isolate=dopts.isolate_chunks == "all"))
        except HloError as err:
            dropped.append(f"{cand.collective} axis {cand.axis} N={cand.n}: {err}")
            continue
        if any(i.opcode in _BLOCKED_OPS for i in ctx.plans):
            tolerance = max(tolerance, dopts.split_tolerance)
    if dropped:
        warnings.warn(f"decompose: {len(dropped)} strategies dropped (the rewrite could not be "
                      f"proven safe); the rest of the module is optimised. First: {dropped[0]}",
                      DecomposeWarning, stacklevel=2)
    stats = {
        "target": options.target,
        "collectives": found.collectives,
        "criticality": dopts.criticality,
        "costs": "fused" if fused is not None else "unfused",
        "fused_costs": fused_stats,
        "critical": found.critical,
        "most_exposed": found.exposed[:10],
        "judged": found.judged,
        "candidates": len(found.candidates),
        "decomposed": decomposed,
        "dropped": dropped,
        "calibration": {"overlap_slowdown": calibration.overlap_slowdown,
                        "measured_overlap_slowdown": measured_slowdown,
                        "measured_on": calibration.platform,
                        "chunk_overhead": calibration.chunk_overhead,
                        "source": calibration.source},
        "tolerance": tolerance,
        **joint_stats,
    }
    if region_stats is not None:
        stats["region"] = {k: v for k, v in region_stats.items() if k != "target"}
    stats["strategy"] = "contexts"
    log.info("decompose pass: %s", stats)
    return PassOutcome(changed=bool(decomposed), stats=stats, tolerance=tolerance)


def _best_region(comp, n: int, cost_model, num_devices: int, loop=None, pull_in: bool = False):
    """The region of ``comp`` with the best ``region.score_region`` among those whose split
    dimensions divide by ``n`` and whose score is positive; ``(region, score)`` or None.
    Seeds: every synchronous array collective along every axis its rule splits; a
    collective already inside a region found along the same axis is not seeded again (its
    region is the same). ``loop``: the while whose body ``comp`` is; its regions grow to
    the loop state they read split (``grow_through_carries``), and the loop state that can
    be carried in chunks (``carried_splits``) costs no slicing or concatenation. ``pull_in``:
    each region also takes in the outside operands it can split at their sources
    (``region.pull_in_inputs``)."""
    best, covered = None, set()
    for coll in list(comp.instructions):
        if not coll.is_collective or coll.async_role is not None or not coll.shape.is_array:
            continue
        for axis in rules.axis_map(coll):
            if (coll.name, axis) in covered:
                continue
            region = build_region(coll, axis)
            if region is not None and pull_in:
                region = pull_in_inputs(region, comp)
            if region is not None and loop is not None:
                region = grow_through_carries(region, comp)
            if region is None or not region.divisible_by(n):
                continue
            for inst, plan in region.plans.items():
                if inst.is_collective and plan.partial is None:
                    covered.add((inst.name, plan.out_dim))
            free: set = set()
            if loop is not None:
                carried = carried_splits(loop, region.plans, n)
                param, root = comp.parameters[0], comp.root
                free = {u for u in param.users if u.tuple_index in carried}
                free |= {root.operands[i] for i in carried}
            score = score_region(region, n, cost_model, num_devices, free=free,
                                 loop_body=loop is not None)
            if score.score_us > 0 and (best is None or score.score_us > best[1].score_us):
                best = (region, score)
    return best


def _read_split_outside(region) -> list:
    """The instructions outside ``region`` that its members read split (sliced per chunk)."""
    out: dict = {}
    for inst, plan in region.plans.items():
        for op, d in zip(inst.operands, plan.operand_dims, strict=True):
            if d is not None and op not in region.plans:
                out[id(op)] = op
    return list(out.values())


def _region_split(module, options, dopts: DecomposeOptions, cost_model) -> PassOutcome:
    """The region strategy (``hlo_passes.decompose.region``): in the entry computation and
    (with ``loop_bodies``) every while body, the best region (``_best_region``) is split
    into ``region_degree`` chunks. A region whose rewrite fails is left as it was, with one
    warning."""

    n = dopts.region_degree
    fresh = channel_counter(module)

    loops = {id(i.attr("body")): i for i in module.instructions()
             if i.opcode == "while" and i.attr("body") is not None}
    decomposed, dropped, tolerance = [], [], 0.0
    for comp in computations_to_search(module, dopts):
        loop = loops.get(id(comp)) if dopts.carry_chunks else None
        found = _best_region(comp, n, cost_model, module.num_devices, loop=loop,
                             pull_in=dopts.region_pull_in)
        released: list[str] = []
        if found is not None and loop is not None:
            # loop state the region reads split through a remat barrier: released from it,
            # it can be carried in chunks (release_barrier_state_reads)
            reads = barrier_state_reads(comp, _read_split_outside(found[0]))
            if reads:
                released = release_barrier_state_reads(comp, reads)
                found = _best_region(comp, n, cost_model, module.num_devices, loop=loop,
                                     pull_in=dopts.region_pull_in)
        if found is None:
            continue
        region, score = found
        carried: dict = {}
        try:
            if loop is not None:
                res, carried = split_while_body(loop, region.plans, n, fresh,
                                                isolate=dopts.isolate_chunks != "none",
                                                wide_partials=dopts.wide_partials,
                                                keep_axis=dopts.partials_keep_axis)
            else:
                res = split_instructions(comp, region.plans, n, fresh,
                                         isolate=dopts.isolate_chunks != "none",
                                         wide_partials=dopts.wide_partials,
                                         keep_axis=dopts.partials_keep_axis)
        except HloError as err:
            dropped.append(f"region of {region.collective.name} in {comp.name}: {err}")
            continue
        blocked = any(i.opcode in _BLOCKED_OPS for i in region.plans)
        tolerance = max(tolerance, dopts.region_tolerance if region.partial
                        else (dopts.split_tolerance if blocked else 0.0))
        decomposed.append({"collective": region.collective.name, "computation": comp.name,
                           "axis": region.axis, "n": n, "sides": "region",
                           "members": len(region.plans), "collectives": region.collectives(),
                           "partial": len(region.partial), "sources": len(region.sources),
                           "slices": len(res.slices), "concats": len(res.concats),
                           "sums": len(res.sums), "barriers": len(res.barriers),
                           "carried_in_chunks": sorted(carried),
                           "released_from_barriers": released,
                           "comm_us": round(score.comm_us, 1),
                           "overhead_us": round(score.overhead_us, 1),
                           "predicted_gain_us": None})
    rotations = (_rotate_split_loops(module, options, cost_model, decomposed, dopts.memory_budget_bytes,
                                     skip=dopts.rotate_skip) if dopts.rotate_loops else [])
    if dropped:
        warnings.warn(f"decompose: {len(dropped)} region splits dropped (the rewrite could not be "
                      f"proven safe); the rest of the module is optimised. First: {dropped[0]}",
                      DecomposeWarning, stacklevel=2)
    stats = {"target": options.target, "strategy": "region", "degree": n,
             "decomposed": decomposed, "dropped": dropped, "tolerance": tolerance,
             "rotations": rotations}
    log.info("decompose (region): %s", stats)
    # each rotation may lose on XLA's module of the program: compile_for_target's rotation
    # guard judges the program with each rotated loop left as it was
    retries = tuple(Retry("leave_one_out", r["body"], (("rotate_skip", (r["body"],)),))
                    for r in rotations if r.get("rotated"))
    return PassOutcome(changed=bool(decomposed), stats=stats, tolerance=tolerance, retries=retries)


def _rotate_split_loops(module, options, cost_model, decomposed: list[dict],
                        budget: int | None, skip: tuple[str, ...] = ()) -> list[dict]:
    """After every region split: each while whose body was split gets a rotation where it
    pays (``pipeline_loops.decide_rotation``, within ``budget``: ``DecomposeOptions.
    memory_budget_bytes``) unless its body is in ``skip``; the split's record says which
    (``rotated``).
    A rotation that fails is skipped with a log line (the split stays)."""

    records = []
    for entry in decomposed:
        loop = next((w for w in module.instructions() if w.opcode == "while"
                     and w.attr("body") is not None and w.attr("body").name == entry["computation"]),
                    None)
        if loop is None:
            continue
        if entry["computation"] in skip:
            records.append({"loop": loop.name, "body": entry["computation"], "rotated": False,
                            "why": "skipped (DecomposeOptions.rotate_skip)"})
            entry["rotated"] = None
            continue
        try:
            record = decide_rotation(module, loop, cost_model, options, budget=budget)
        except (HloError, ValueError) as err:
            log.warning("decompose: rotation of %s skipped: %s", loop.name, err)
            record = {"loop": loop.name, "rotated": False, "why": f"failed: {err}"}
        entry["rotated"] = record.get("collective") if record.get("rotated") else None
        records.append(record)
    return records
