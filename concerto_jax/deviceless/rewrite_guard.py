"""The rewrite guard of ``compile_for_target``: a program rewritten before XLA (decompose,
fuse_collectives, ...) is kept only where its plan on XLA's scheduled module beats the
original's, under the nominal cost model and, with ``Options.deviceless.robust``, under every
plausible one (maximin against stock). What a pass offers in its outcome as ``Retry``s is
judged the same way, whatever the pass: each ``"leave_one_out"`` part against the whole
(decompose: each loop rotation), and where the whole rewrite is dropped its ``"fallback"``
(decompose: the replicated operands' collectives without the split).
``program._backend_only`` runs it."""

from __future__ import annotations

import dataclasses
import logging
import time

from concerto_jax import pipeline
from concerto_jax.deviceless import planning
from concerto_jax.deviceless.compile import compile_replicated_for_target
from concerto_jax.deviceless.planning import Plan
from hlo_passes.registry import PassInputs, Retry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """The rewrite with a pass's fallback retry (``with_fallback``; decompose: without its split).

    Attributes:
      plan: its plan (after the threshold search where one ran).
      src: XLA's scheduled module of it.
      copts: the serialized compile options of its backend compile.
      record: the "combine_thresholds" record of its search, or None.
      passes: the rewriting passes' records of that program.
    """

    plan: Plan
    src: str
    copts: bytes
    record: object | None
    passes: list


GUARD_RETUNE_MARGIN = 0.02
"""When the rewrite's plan loses to the original's at the given combine thresholds, or wins
by less than this fraction of the original's, the rewrite guard does not decide there: with
``Options.deviceless.combine_thresholds`` on, both programs get the threshold search and the faster
searched plan is kept (``program._backend_only``; evoformer_dap8: dropped by 0.3 % at the
defaults, 3 % faster than the original after both searches; a held-out DP x TP Llama step:
16 % slower at XLA's default thresholds, where its combiners merged collectives of different
chunks, 5 % faster than the original after both searches)."""


def search_original_too(rewritten_us: float, plain_us: float, searched_rewritten_us: float) -> bool:
    """Whether the rewrite guard also searches the original program's combine thresholds after
    the rewrite won at the given ones (by more than ``GUARD_RETUNE_MARGIN``): yes where the
    rewrite's own search moved its plan by more than its lead (``plain_us - rewritten_us``),
    since the original's search may move it as far."""
    return rewritten_us - searched_rewritten_us > plain_us - rewritten_us


def robust_keep(envelope, decision: str, candidate: Plan, baseline: Plan, record: dict, keep: bool,
                seconds: dict, key: str = "robust", stock_final: str | None = None,
                names: tuple[str, str] = ("rewrite", "original"), ties_keep: bool = False) -> bool:
    """``keep`` (the nominal comparison of two plans) judged again over
    the envelope's cost models when there is one: the candidate's plan is kept only if its
    worst-case gain over stock XLA's final module ``stock_final`` is higher than the baseline
    plan's (``Envelope.compare``'s maximin rule; without ``stock_final``: only if it is faster
    under every model). ``record[key]``: the ``RobustVerdict`` as a dict; ``names``: the
    candidate's and the baseline's names in it; ``ties_keep``: a nominal tie keeps the
    candidate (as the caller's nominal rule does)."""
    if envelope is None:
        return keep
    t0 = time.perf_counter()
    verdict = envelope.compare(decision, candidate.handed, baseline.handed, candidate=names[0],
                               baseline=names[1], ties_keep=ties_keep,
                               nominal_us=(candidate.judged.us, baseline.judged.us),
                               reference_text=stock_final, reference="stock")
    seconds["robust"] = seconds.get("robust", 0.0) + time.perf_counter() - t0
    record[key] = verdict.as_dict()
    return verdict.keep


def fallback_retry(records) -> tuple[str, Retry] | None:
    """The first ``"fallback"`` retry a pass record offers, with the pass's name, or None."""
    return next(((r.name, retry) for r in records for retry in r.retries if retry.kind == "fallback"),
                None)


def with_fallback(pre_opts, inputs: PassInputs, post_spmd: str, options, cost_model, budget,
                  scheduled_at_program, tuned, retry: tuple[str, Retry]) -> Fallback:
    """The rewriting passes (``pre_opts``, given ``inputs``) again with the fallback ``retry``
    (``(pass name, Retry)``: decompose's is ``DecomposeOptions.split=False``, only the collectives
    of replicated operands), XLA's scheduled module of that program and its plan (after the
    combine-threshold search when ``tuned`` is given)."""
    name, fallback = retry
    pre = pipeline.run(post_spmd, fallback.applied(pre_opts, name), inputs)
    at = scheduled_at_program(pre.text)
    src, copts = at(dict(options.compiler_options))
    plan = planning.plan_on(src, options, cost_model, {}, budget)
    record = None
    if tuned is not None:
        plan, src, copts, record = tuned(at, plan, src, copts)
    log.info("compile_for_target: the rewrite without its %s plans %.1f us", fallback.label, plan.judged.us)
    return Fallback(plan, src, copts, record, list(pre.passes))


def rotation_guard(pre, pre_opts, inputs: PassInputs, scheduled_src: str, post_spmd: str, devices, env, options,
                   cost_model, seconds: dict, budget, envelope=None, stock_final: str | None = None,
                   clock=None):
    """Keep each part of a rewrite that a pass offers as a ``"leave_one_out"`` retry (decompose:
    each loop rotation) only where XLA's module of the program plans faster with it:
    ``(pipeline result, XLA's scheduled module, its plan or None)``.

    A rotation is decided on the post-SPMD graph, which does not see what XLA's passes make
    of the rotated loop (fusion across the cut, all-reduce pairs its reassociation merges,
    its own loop pipelining). So the program with every
    rotation is planned on XLA's scheduled module against the same program with one rotated
    loop left as it was, for each rotated loop (one more pipeline run + XLA compile + plan
    each); the fastest is kept, and the record of the pass that offered them gets
    ``rotation_guard``. With an
    ``envelope`` (``Options.deviceless.robust``), each comparison keeps the program with the rotation
    only where its worst-case gain over stock XLA's final module ``stock_final`` across the
    plausible cost models is at least the other's (maximin, as the rewrite guard;
    ``rotation_guard["robust"]`` holds each verdict). ``clock`` (``budget.TimeBudget``) records
    its compiles, uncharged.
    """
    retries = [(r.name, retry) for r in pre.passes for retry in r.retries if retry.kind == "leave_one_out"]
    if not retries:
        return pre, scheduled_src, None
    t0 = time.perf_counter()
    plan = planning.plan_on(scheduled_src, options, cost_model, {}, budget)
    best = (plan.judged.us, pre, scheduled_src, (), plan)
    tried = {"all": round(best[0], 1)}
    verdicts: dict = {}
    for name, retry in retries:
        body = retry.label
        alt = pipeline.run(post_spmd, retry.applied(pre_opts, name), inputs)
        _, _, _, src = compile_replicated_for_target(alt.text, devices, env, after_lhs=True)
        if clock is not None:  # part of the rewrite's own exploration: not charged
            clock.spend(1, charged=False)
        plan = planning.plan_on(src, options, cost_model, {}, budget)
        us = plan.judged.us
        tried[f"without {body}"] = round(us, 1)
        # the kept program so far (with this loop rotated) against the one without its rotation
        keep = robust_keep(envelope, "rotation_guard", best[4], plan, verdicts, best[0] <= us, seconds,
                            key=f"without {body}", stock_final=stock_final,
                            names=("rotated", "not rotated"), ties_keep=True)
        if not keep:
            best = (us, alt, src, (body,), plan)
    _, pre, scheduled_src, skipped, plan = best
    seconds["rotation_guard"] = time.perf_counter() - t0
    guard = {"planned_us": tried, "not_rotated": list(skipped)}
    if verdicts:
        guard["robust"] = verdicts
    log.info("compile_for_target: rotation guard %s", guard)
    offered = {name for name, _ in retries}
    passes = tuple(dataclasses.replace(r, stats={**r.stats, "rotation_guard": guard})
                   if r.name in offered else r for r in pre.passes)
    return dataclasses.replace(pre, passes=passes), scheduled_src, plan
