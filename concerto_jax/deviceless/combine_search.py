"""The combine-threshold search of ``compile_for_target``: the program planned at other XLA
combine thresholds, candidates ranked by XLA's combiners emulated on one compiled module
(``deviceless.thresholds.CombineProxy``) and the best few compiled and judged."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time

from concerto_jax.autoccl.knobs import gpu_combine_threshold_options
from concerto_jax.deviceless import planning
from concerto_jax.deviceless.budget import PARALLEL_COMPILE_COST, TimeBudget
from concerto_jax.deviceless.planning import Plan
from concerto_jax.deviceless.thresholds import COMBINED_KINDS, CombineProxy
from concerto_jax.report import PassRecord
from concerto_jax.scheduler.progress import Progress
from hlo_passes.ir.loops import schedulable_computations
from hlo_passes.ir.parser import parse_module

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ThresholdSearch:
    """What the search found.

    Attributes:
      record: the "combine_thresholds" pass record (candidates, estimates, what was chosen).
      plan: the kept candidate's plan, or None when none beat the current plan.
      scheduled: XLA's scheduled module at the kept thresholds (None with ``plan``).
      compile_options: the serialized compile options of the backend compile at them (None
        with ``plan``).
    """

    record: PassRecord
    plan: Plan | None
    scheduled: str | None
    compile_options: bytes | None


def combine_threshold_options(nbytes: int) -> dict[str, int]:
    """XLA compiler options setting every combiner of ``COMBINED_KINDS`` to ``nbytes``."""
    return gpu_combine_threshold_options(dict.fromkeys(COMBINED_KINDS, int(nbytes)))


def collectives_by_kind(text: str, combined: dict | None = None) -> tuple[dict[str, int], dict[str, tuple]]:
    """``(bytes, buckets)`` of the collectives of each ``COMBINED_KINDS`` kind in the module
    ``text`` (sync ops and async starts, sugared or generic, and collective kernel fusions):
    bytes in all (of the op carrying the collective: a sugared start's tuple counts operands
    and results, an over-estimate) and the sorted shapes of its collectives, which say how
    XLA combined them. Only the computations that run as sequences of ops are read: the
    collective inside an ``async-start``'s computation or a collective kernel's fused
    computation is counted once, through its wrapper. ``combined``, if given, receives per kind
    how many of its collectives XLA's combiners made (``_is_combined``)."""
    nbytes = dict.fromkeys(COMBINED_KINDS, 0)
    shapes: dict[str, list] = {k: [] for k in COMBINED_KINDS}
    for comp in schedulable_computations(parse_module(text)):
        for inst in comp.instructions:
            kind = inst.collective_kind
            if kind in nbytes and inst.async_role in (None, "start"):
                op = inst.collective_op or inst
                nbytes[kind] += op.shape.byte_size
                shapes[kind].append(str(op.shape))
                if combined is not None and _is_combined(inst, op):
                    combined[kind] = combined.get(kind, 0) + 1
    return nbytes, {k: tuple(sorted(v)) for k, v in shapes.items()}


ROBUST_COMBINE_CHECKS = 3
"""With an envelope, the combine-threshold search checks at most this many of its candidates that
plan faster than the given settings (fastest first) against the current plan over the envelope's
cost models, and keeps the first one ``Envelope.compare`` keeps (none: the given settings)."""


def _is_combined(inst, op) -> bool:
    """Whether the collective ``inst`` (its op ``op``) looks like what XLA's combiners made: more
    than one operand, or one flat operand built by a concatenate (XLA's ``AllReduceContiguous``
    runs a combined all-reduce over one buffer, its operands concatenated, fused or not). A
    user's own concatenate reads as combined too: the safe side for ``given_is_smallest``."""
    if len(op.operands) > 1:
        return True
    for x in inst.operands:
        while x.opcode in ("bitcast", "copy") and x.operands:
            x = x.operands[0]
        if x.opcode == "concatenate":
            return True
        comps = x.called_computations if x.opcode == "fusion" else []
        if comps and comps[0].root is not None and comps[0].root.opcode == "concatenate":
            return True
    return False


ESTIMATE_PRUNE_MARGIN = 0.02
"""A candidate of the pruned search (``combine_compiles``) is compiled only if its estimate,
scaled to plans by the module it was made on (that module's plan over its estimate), is at most
this fraction above the plan at the given settings: a candidate the estimate puts clearly
behind is not worth a compile (the estimates ranked the held-out steps' sizes as their plans
did, D35; what the scaled estimates missed by is in docs/DECISIONS.md D47)."""


def given_is_smallest(current_src: str, env: dict, present, smallest: int,
                      combined: dict | None = None) -> bool:
    """Whether XLA's module of the program at the smallest candidate size is the given one
    (``current_src``, compiled at the given settings ``env``), so that it need not be compiled.

    True where none of the ``present`` kinds' collectives in ``current_src`` was combined
    (``_is_combined``: XLA's combiners merged nothing) and the given threshold of each is not below
    ``smallest``: a combiner that merged no two collectives at a threshold merges none at a
    lower one (each merge it could make there fits under the higher one too; what stopped it,
    a data path or another kind, does not depend on the size), and the thresholds are read by
    the combiners alone. An unset threshold is XLA's default (``XLA_DEFAULT_COMBINE_THRESHOLD``,
    or larger ones XLA's heuristics choose for synchronous and pipelined collectives).
    ``combined``: ``collectives_by_kind``'s count of ``current_src`` where the caller has it.
    """
    if combined is None:
        combined = {}
        collectives_by_kind(current_src, combined)
    if any(combined.get(k) for k in present):
        return False
    for kind in present:
        (flag,) = gpu_combine_threshold_options({kind: 0})
        if int(env.get(flag, XLA_DEFAULT_COMBINE_THRESHOLD)) < smallest:
            return False
    return True


XLA_DEFAULT_COMBINE_THRESHOLD = 30 * 1024 * 1024 + 7
"""XLA's default all-reduce, all-gather and reduce-scatter combine threshold in bytes
(``xla/service/collective_utils.h``; the GPU combiners use larger ones of their own for
synchronous and pipelined collectives when the flag is left at it)."""


def tune_combiners(scheduled_at, env: dict, options, cost_model, current_us: float,
                   current_src: str, budget: int | None = None, envelope=None,
                   current_plan: Plan | None = None, stock_final: str | None = None,
                   clock: TimeBudget | None = None) -> ThresholdSearch:
    """Plan the program at other XLA combine thresholds and keep the fastest plan if it beats
    ``current_us`` (the plan at the user's settings, of XLA's scheduled module ``current_src``).

    Two stages, each candidate one XLA compile (``scheduled_at(env) -> (XLA's scheduled module,
    serialized compile options of the backend compile)``) and one reschedule, judged as the
    rewrite guard judges (``judge.judge_module``):

    1. uniform: XLA's all-reduce, all-gather and reduce-scatter thresholds all set to each
       size of ``options.deviceless.combine_thresholds``;
    2. per kind (``options.deviceless.combine_per_kind``, where two or more kinds are present): one round
       of coordinate descent from the best so far, each kind in turn at every size and at the
       given setting, the others held. A kind whose collectives hold no more bytes in all
       than the smallest size is left as it is (every size combines it alike), and a size
       at which stage 1 (or the given settings) combined that kind into the same buckets as
       the size held now is skipped (XLA's combiner of one kind groups by that kind's
       threshold: same buckets, same module), listed under ``skipped``.

    XLA merges small collectives of one kind into buckets up to its threshold, so that a step
    pays fewer launches and latencies; but a bucket waits for its last member, and the last
    gradients of a step (or the first weights of a ZeRO-3 step) then leave the whole bucket
    exposed. The best size differs per kind (a ZeRO-3 step's forward weight gathers want few
    big buckets, its backward reduce-scatters small ones) and is not monotonic in the size
    (bucket boundaries against layer boundaries), so it is judged by the plan. AutoCCL
    (NSDI'25) tunes such settings online on the GPU; without a GPU the plan is the
    measurement. A candidate that fails (compile, memory limit) is skipped and recorded.

    The smallest size is compiled first; every candidate is estimated on its module
    (``_estimate_candidates``: the record's ``estimates`` and each candidate's
    ``estimated_us``), and with ``options.deviceless.combine_compiles`` only that many of the
    best-estimated ones are compiled (instead of stages 1 and 2). With a ``clock``
    (``TimeBudget``), a candidate whose compile (as long as the slowest so far, or stock's)
    does not fit in what is left is not compiled (``cut_by_time_budget``); with the "auto"
    budget (a count of compiles) every compile is charged to it.

    With an ``envelope`` and the ``current_plan`` (a ``Plan``), the candidates that
    plan faster than the current plan are checked fastest first (at most
    ``ROBUST_COMBINE_CHECKS``) against it over the envelope's cost models; the first kept by
    ``Envelope.compare`` (maximin over stock XLA's final module ``stock_final``: a worst-case
    gain above the current plan's; without it: faster under every model) is kept (the
    record's ``robust``: each check's verdict).

    Returns:
      A ``ThresholdSearch``: its ``plan``, ``scheduled`` and ``compile_options`` None when no
      candidate beats the current plan. The record's ``chosen`` is ``{kind: bytes}`` for the kinds set (absent
      kinds: the given setting), None when nothing beat the current plan.
    """
    t0 = time.perf_counter()
    progress = Progress(log, "compile_for_target: combine thresholds")
    sizes = tuple(int(b) for b in options.deviceless.combine_thresholds)
    given_combined: dict = {}
    given, given_buckets = collectives_by_kind(current_src, given_combined)
    present = [k for k in COMBINED_KINDS if given[k] > 0]
    tried: list[dict] = []
    skipped: list[dict] = []
    seen: set = set()
    buckets_at: dict = {None: given_buckets}  # uniform size (None: given) -> buckets per kind
    best = None  # (judged, plan, src, compile_options, setting)
    faster: list = []  # every candidate that beat current_us, as best's tuples
    estimates: dict = {}  # candidate key -> the pruning model's estimate (thresholds.CombineProxy)
    durations: list[float] = []  # seconds per compiled candidate
    cut: list[dict] = []  # candidates the time budget left out

    def key_of(setting: dict[str, int]) -> tuple:
        return tuple(sorted((k, v) for k, v in setting.items() if k in present))

    def compile_at(setting: dict[str, int]):
        return scheduled_at({**env, **gpu_combine_threshold_options(setting)})

    def attempt(setting: dict[str, int], compiled=None) -> str | None:
        """Compile (unless ``compiled``: a future of ``compile_at``), plan and record one candidate."""
        nonlocal best
        key = key_of(setting)
        if not key or key in seen:  # nothing set on a present kind: the current plan
            return None
        seen.add(key)
        entry = {"thresholds": dict(key)}
        if key in estimates:
            entry["estimated_us"] = round(estimates[key], 1)
        if (compiled is None and clock is not None
                and not clock.fits(1, per_compile_s=max(durations, default=clock.compile_s))):
            cut.append(dict(key))
            return None
        t_attempt = time.perf_counter()
        try:
            if compiled is None:
                if clock is not None:
                    clock.spend(1)
                src, compile_options = compile_at(setting)
            else:
                src, compile_options = compiled.result()
            if src is None:
                raise RuntimeError("XLA wrote no scheduled module")
            plan = planning.plan_on(src, options, cost_model, {}, budget)
            judged = plan.judged
        except Exception as e:  # noqa: BLE001 - one candidate; the others and the current plan stand
            tried.append({**entry, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        durations.append(time.perf_counter() - t_attempt)
        tried.append({**entry, "planned_us": round(judged.us, 1)})
        if judged.us < current_us:
            faster.append((judged, plan, src, compile_options, dict(key)))
        if judged.us < current_us and (best is None or judged.us < best[0].us):
            best = (judged, plan, src, compile_options, dict(key))
        progress.update(candidates=len(tried), given_us=current_us,
                        best_us=current_us if best is None else best[0].us)
        return src

    varied = [k for k in present if sizes and given[k] > min(sizes)]
    per_kind = options.deviceless.combine_per_kind and len(varied) >= 2
    proxy_stats: dict = {}
    anchor_us = None  # the plan of the module the estimates are made on
    pruned: list[dict] = []  # candidates the estimate says cannot win (ESTIMATE_PRUNE_MARGIN)
    if len(sizes) > 1 and present:
        # the smallest size first: its module is what the others are estimated on
        smallest = dict.fromkeys(COMBINED_KINDS, min(sizes))
        if given_is_smallest(current_src, env, present, min(sizes), given_combined):
            key = key_of(smallest)
            seen.add(key)
            tried.append({"thresholds": dict(key), "planned_us": round(current_us, 1),
                          "same_module_as": "given"})
            src, anchor_us = current_src, current_us
            log.info("compile_for_target: combine thresholds: nothing combined at the given "
                     "settings: the smallest size's module is the given one (not compiled)")
        else:
            src = attempt(smallest)
            if src is not None:
                anchor_us = tried[-1]["planned_us"]
        if src is not None:
            buckets_at[min(sizes)] = collectives_by_kind(src)[1]
            proxy_stats = _estimate_candidates(src, cost_model, sizes, present, varied, per_kind, given,
                                               estimates, progress)
            for t in tried:  # the smallest size's own estimate, beside its plan
                k = tuple(sorted(t["thresholds"].items()))
                if k in estimates:
                    t["estimated_us"] = round(estimates[k], 1)
    ranked = proxy_stats.get("ranked")
    if options.deviceless.combine_compiles is not None and ranked is not None:
        batch = []
        for c in ranked[:options.deviceless.combine_compiles]:
            if not key_of(c) or key_of(c) in seen:
                continue
            # the estimate scaled to plans by the module it was made on (its plan / its estimate)
            predicted = anchor_us * estimates[key_of(c)] / proxy_stats["model_us"]
            if predicted > current_us * (1.0 + ESTIMATE_PRUNE_MARGIN):
                seen.add(key_of(c))
                pruned.append({"thresholds": dict(key_of(c)), "estimated_us": round(estimates[key_of(c)], 1),
                               "predicted_us": round(predicted, 1)})
                continue
            batch.append(c)
        fits = len(batch)
        if clock is not None:  # as many as fit, compiled side by side (PARALLEL_COMPILE_COST)
            one = max(durations, default=clock.compile_s)
            while fits and not clock.fits(1 + PARALLEL_COMPILE_COST * (fits - 1), per_compile_s=one):
                fits -= 1
            if fits:
                clock.spend(1 + PARALLEL_COMPILE_COST * (fits - 1))
        workers = max(1, min(fits, os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="threshold-compile") as pool:
            futures = [pool.submit(compile_at, c) for c in batch[:fits]]
            for c, f in zip(batch[:fits], futures, strict=True):
                attempt(c, compiled=f)
        for c in batch[fits:]:
            seen.add(key_of(c))
            cut.append(dict(key_of(c)))
        per_kind = False
    else:
        for size in sizes:
            src = attempt(dict.fromkeys(COMBINED_KINDS, size))
            if src is not None:
                buckets_at[size] = collectives_by_kind(src)[1]
    if per_kind:
        for kind in sorted(varied, key=lambda k: -given[k]):
            for size in (*sizes, None):
                base = dict(best[4]) if best is not None else {}
                held = base.get(kind)
                if (size != held and size in buckets_at and held in buckets_at
                        and buckets_at[size][kind] == buckets_at[held][kind]):
                    skipped.append({"kind": kind, "bytes": size, "same_buckets_as": held})
                    continue
                if size is None:
                    base.pop(kind, None)
                else:
                    base[kind] = size
                attempt(base)
    checks = []
    if envelope is not None and current_plan is not None and best is not None:
        # the nominal choice, then the next fastest, must beat the given settings under every model
        t1 = time.perf_counter()
        best = None
        for cand in sorted(faster, key=lambda c: c[0].us)[:ROBUST_COMBINE_CHECKS]:
            verdict = envelope.compare("combine_thresholds", cand[1].handed, current_plan.handed,
                                       candidate=f"thresholds {cand[4]}", baseline="given thresholds",
                                       nominal_us=(cand[0].us, current_us), reference_text=stock_final,
                                       reference="stock")
            checks.append(verdict.as_dict())
            if verdict.keep:
                best = cand
                break
        log.info("compile_for_target: combine thresholds over the envelope: %s (%.1f s)",
                 "none kept" if best is None else best[4], time.perf_counter() - t1)
    chosen = None if best is None else best[4]
    stats = {"target": options.target, "current_planned_us": round(current_us, 1),
             "kind_bytes": given, "varied_kinds": varied, "per_kind_round": per_kind,
             "candidates": tried, "skipped": skipped,
             # how many collectives of each kind XLA left at each uniform size (bytes as a
             # string; "given": the given settings)
             "collectives_at": {("given" if b is None else str(b)): {k: len(v[k]) for k in present}
                                for b, v in buckets_at.items()},
             "flags": sorted(combine_threshold_options(0)),
             "chosen": chosen}
    if proxy_stats:
        stats["estimates"] = {k: v for k, v in proxy_stats.items() if k != "ranked"}
        stats["compiled"] = sum("error" not in t and "same_module_as" not in t for t in tried)
    if pruned:
        stats["pruned_by_estimate"] = pruned
    if cut:
        stats["cut_by_time_budget"] = cut
        clock.cut.append(f"combine thresholds: {len(cut)} candidate(s) not compiled "
                         f"({', '.join(str(c) for c in cut[:3])}{', ...' if len(cut) > 3 else ''})")
    if checks:
        stats["robust"] = checks
    if best is not None:
        log.info("compile_for_target: combine thresholds %s plan %.1f us vs %.1f us at the given "
                 "settings: kept", chosen, best[0].us, current_us)
    record = PassRecord("combine_thresholds", best is not None, time.perf_counter() - t0, stats)
    if best is None:
        return ThresholdSearch(record, None, None, None)
    _, plan, src, compile_options, _ = best
    return ThresholdSearch(record, plan, src, compile_options)


def _estimate_candidates(src: str, cost_model, sizes, present, varied, per_kind: bool, given: dict,
                         estimates: dict, progress) -> dict:
    """Estimate every candidate of the threshold search on XLA's module at the smallest size
    (``thresholds.CombineProxy``) and rank them: the uniform sizes, then (``per_kind``) one round
    of coordinate descent over the ``varied`` kinds from the best estimated so far. Candidates
    whose emulated buckets equal the smallest size's, or an earlier-ranked candidate's, are
    dropped (the same module). Fills ``estimates`` (candidate key -> µs).

    Returns:
      ``{"ranked": [setting, ...] best first, "model_us": the estimate at the smallest size,
      "best": the first five ranked with their estimates, "candidates": how many were
      estimated, "same_buckets": how many dropped, "cycles", "seconds"}``; ``{}`` when the
      model cannot be built (the search then compiles them all).
    """
    t0 = time.perf_counter()
    try:
        proxy = CombineProxy(src, cost_model)
    except Exception as e:  # noqa: BLE001 - the model prunes; without it every candidate compiles
        log.warning("compile_for_target: combine thresholds: no pruning model (%s: %s); every "
                    "candidate is compiled", type(e).__name__, str(e)[:200])
        return {}
    uniform = {b: dict.fromkeys(COMBINED_KINDS, b) for b in sizes}
    found: dict = {}  # key -> (us, setting, signature)

    def estimate(setting: dict) -> float:
        key = tuple(sorted((k, v) for k, v in setting.items() if k in present))
        if key not in found:
            found[key] = (proxy.us(setting), dict(setting), proxy.signature(setting))
            estimates[key] = found[key][0]
            progress.update(estimated=len(found))
        return found[key][0]

    for b in sizes:
        estimate(uniform[b])
    if per_kind:
        base = dict(uniform[min(sizes, key=lambda b: estimate(uniform[b]))])
        for kind in sorted(varied, key=lambda k: -given[k]):
            base = min(({**base, kind: b} for b in sizes), key=estimate)
    smallest = found[tuple(sorted((k, min(sizes)) for k in present))]
    ranked, signatures, best = [], {smallest[2]}, []
    for us, setting, sig in sorted(found.values(), key=lambda f: f[0]):
        if sig not in signatures:
            signatures.add(sig)
            ranked.append(setting)
            best.append({"thresholds": {k: v for k, v in setting.items() if k in present},
                         "estimated_us": round(us, 1)})
    stats = {"model_us": round(smallest[0], 1), "best": best[:5], "candidates": len(found),
             "same_buckets": len(found) - 1 - len(ranked), "cycles": proxy.cycles,
             "seconds": round(time.perf_counter() - t0, 2)}
    log.info("compile_for_target: combine thresholds estimated: %s", stats)
    return {"ranked": ranked, **stats}
