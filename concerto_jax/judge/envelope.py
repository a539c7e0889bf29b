"""Decisions judged over the plausible cost models of ``costmodel.envelope`` (the set, the
rule and the verdicts are defined there; this module simulates the modules under each model)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

from concerto_jax.costmodel.envelope import (
    ENVELOPE,
    NOMINAL,
    RobustVerdict,
    Variant,
    VariantFigures,
)
from concerto_jax.costmodel.hlo_ops import OpInfoCache
from concerto_jax.judge.module import step_us_parsed
from hlo_passes.ir.parser import parse_module

log = logging.getLogger(__name__)


class Envelope:
    """Judges modules under every model of ``variants`` (``judge.step_us_parsed``: each module
    parsed once and its instructions described once, simulated once per model, figures cached by
    its text) and decides over them (``compare``).

    Args:
      cluster: the target cluster.
      variants: the models (``ENVELOPE`` by default); the one named ``nominal`` is the model the
        caller decides with (its figures may be passed to ``compare`` instead of re-judged).
        Without one, the caller's nominal figures are still reported and count in the rule.
    """

    def __init__(self, cluster, variants: Sequence[Variant] = ENVELOPE):
        self.cluster = cluster
        self.variants = tuple(variants)
        self._models = {v.name: v.cost_model(cluster) for v in self.variants}
        self._us: dict[tuple[str, str], float] = {}
        self._parsed: dict[str, object] = {}
        self.seconds = 0.0
        self.simulations = 0
        self.verdicts: list[RobustVerdict] = []

    def step_us(self, text: str, variant: str) -> float:
        """``text``'s simulated step time under ``variant`` (cached)."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        if (digest, variant) not in self._us:
            t0 = time.perf_counter()
            first = digest not in self._parsed
            if first:  # the module and its instructions' OpInfos, shared by every model
                self._parsed[digest] = (parse_module(text), OpInfoCache())
            module, infos = self._parsed[digest]
            # the task graphs' structure does not depend on the model: checked on the first build
            self._us[(digest, variant)] = float(step_us_parsed(module, self._models[variant], infos,
                                                               check=first))
            self.seconds += time.perf_counter() - t0
            self.simulations += 1
        return self._us[(digest, variant)]

    def forget_modules(self) -> None:
        """Drop the parsed modules (the figures stay cached)."""
        self._parsed.clear()

    def compare(self, decision: str, candidate_text: str, baseline_text: str, *,
                nominal_us: tuple[float, float] | None = None, robust: bool = True,
                ties_keep: bool = False, candidate: str = "candidate",
                baseline: str = "baseline", reference_text: str | None = None,
                reference: str = "reference") -> RobustVerdict:
        """Judge ``candidate_text`` against ``baseline_text`` under every model.

        Args:
          decision: the decision's name, for the record.
          nominal_us: ``(candidate, baseline)`` µs the caller has under its nominal model (not
            simulated again).
          robust: decide by the worst case (True) or report only and decide by the nominal
            model (False).
          ties_keep: a gain of exactly 1 keeps the candidate.
          reference_text: with it, the maximin rule: each program's gain over this module
            (``reference``, e.g. stock XLA's final module) is taken under every model, and the
            candidate is kept where its worst-case gain is higher than the baseline's (equal at
            4 digits: where the nominal model keeps it). Without it, the worst-case rule: the
            candidate must win against the baseline under every model.
        """
        t0 = time.perf_counter()
        raw: list[tuple[str, float, float]] = []  # (model, candidate µs, baseline µs)
        for v in self.variants:
            if v.name == NOMINAL and nominal_us is not None:
                raw.append((v.name, *nominal_us))
            else:
                raw.append((v.name, self.step_us(candidate_text, v.name), self.step_us(baseline_text, v.name)))
        if nominal_us is not None and NOMINAL not in self._models:
            raw.insert(0, (NOMINAL, *nominal_us))

        def wins(c: float, b: float) -> bool:
            return b >= c if ties_keep else b > c

        # the caller's nominal figures are compared as the caller compares them; the other
        # models' at 0.1 µs, the precision results are reported at (two modules that simulate
        # alike differ by float noise, which must not decide)
        decides = [(n, c, b) if (n == NOMINAL and nominal_us is not None) else (n, round(c, 1), round(b, 1))
                   for n, c, b in raw]
        failing = {n for n, c, b in decides if not wins(c, b)}
        ref = ({n: self.step_us(reference_text, n) for n, _, _ in raw if n in self._models}
               if reference_text is not None else {})
        figures = tuple(VariantFigures(n, round(c, 1), round(b, 1), round(b / c, 4) if c > 0 else 1.0,
                                       round(ref[n], 1) if n in ref else None)
                        for n, c, b in raw)
        nominal = next((f for f in figures if f.variant == NOMINAL), figures[0])
        worst = min(figures, key=lambda f: (f.gain, f.variant not in failing))
        nominal_keep = nominal.variant not in failing
        cand_worst = base_worst = None
        if ref:
            cand_worst = round(min(ref[n] / c for n, c, _ in raw if n in ref), 4)
            base_worst = round(min(ref[n] / b for n, _, b in raw if n in ref), 4)
            rule = "maximin"
            keep = cand_worst > base_worst or (cand_worst == base_worst and nominal_keep)
        else:
            rule = "worst_case"
            keep = not failing
        if not robust:
            rule, keep = "nominal", nominal_keep
        verdict = RobustVerdict(decision, candidate, baseline, nominal.gain, worst.gain, worst.variant,
                                keep, nominal_keep, rule, ties_keep, figures,
                                round(time.perf_counter() - t0, 2), reference if ref else None,
                                cand_worst, base_worst)
        self.verdicts.append(verdict)
        log.info("%s: %s vs %s: nominal gain %.4f, worst %.4f (%s): %s%s", decision, candidate, baseline,
                 verdict.nominal_gain, verdict.worst_gain, verdict.worst_variant,
                 "kept" if keep else "dropped",
                 " (the nominal model alone keeps it)" if verdict.changed_decision else "")
        return verdict
