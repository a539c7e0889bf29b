"""Columns every compile_for_target bench reports per case: the gain over stock XLA under the
nominal cost model and its worst case over the plausible models (``costmodel.envelope``), and
what our program costs in kernels and bytes.

* ``nominal_gain``: stock µs / ours µs, XLA's final modules, nominal model.
* ``worst_gain`` / ``worst_variant``: the smallest of that ratio over ``envelope.ENVELOPE`` and
  the model giving it.
* ``adverse_gain``: the ratio at ``envelope.ADVERSE`` (every figure at its hostile end at once;
  a stress point, outside the set).
* ``calibrated_gain``: the ratio under the kernel rates measured on an H200
  (``envelope.CALIBRATED_H200``, ``costmodel.calibration``) on the target's own peak rates (on
  an H200 target they are the nominal model).
* ``stock_kernels`` / ``ours_kernels``: kernels launched per step by each final module (loop
  bodies times their trip counts; collectives not counted), ``added_kernels`` the difference.
* ``added_mb``: HBM bytes the kernels of ours move per step minus stock's (MB; negative: fewer).
* ``decisions`` (``decisions``): every decision the compile judged over the plausible models, in
  the order taken: kept or dropped, nominal and worst-case gain, and the model giving the worst
  (the assumption the decision depends on most).

Every figure is a simulation of the two fixed modules (no recompile): about 2 x 15 module
simulations per case.
"""

from __future__ import annotations

COLUMNS = ("nominal_gain", "worst_gain", "worst_variant", "adverse_gain", "calibrated_gain", "stock_kernels", "ours_kernels",
           "added_kernels", "added_mb")


def legend() -> str:
    """The columns' legend for a bench's markdown, one paragraph."""
    return " ".join(" ".join((__doc__ or "").split("\n\n")[:2]).split())


def kernels_and_bytes(text: str) -> tuple[int, float]:
    """``(kernels, HBM bytes)`` per step of a scheduled module: every compute kernel of every
    computation that runs as a sequence of kernels, weighted by how often it runs per step."""
    total = kernels_and_bytes_by(text, lambda inst: None).get(None, [0, 0.0])
    return total[0], total[1]


def kernels_and_bytes_by(text: str, key) -> dict:
    """``key(instruction) -> [kernels per step, HBM bytes per step]`` of a scheduled module (the
    kernels ``kernels_and_bytes`` counts, grouped by ``key``)."""
    import collections

    from concerto_jax.costmodel.compute import kernel_count, work_of
    from concerto_jax.hlo_taskgraph import ALIAS_OPCODES, op_info
    from hlo_passes.ir.loops import runs_per_step, schedulable_computations
    from hlo_passes.ir.parser import parse_module

    comps = schedulable_computations(parse_module(text))
    runs = runs_per_step(comps)
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for comp in comps:
        m = runs.get(comp.name, 0)
        for inst in comp.instructions:
            if (inst.opcode in ALIAS_OPCODES or inst.opcode in ("while", "call", "conditional")
                    or inst.collective_kind is not None):
                continue
            info = op_info(inst)
            n = kernel_count(info)
            if n:
                entry = out[key(inst)]
                entry[0] += m * n
                entry[1] += m * work_of(info).bytes
    return dict(out)


def columns(stock_text: str, ours_text: str, cluster: str) -> dict:
    """The ``COLUMNS`` of one case (``cluster``: a ``costmodel.CLUSTERS`` name)."""
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.costmodel.envelope import ADVERSE, CALIBRATED_H200, ENVELOPE
    from concerto_jax.judge import Envelope

    env = Envelope(get_cluster(cluster), (*ENVELOPE, ADVERSE, CALIBRATED_H200))
    verdict = env.compare("bench", ours_text, stock_text, robust=False, ties_keep=True,
                          candidate="ours", baseline="stock")
    inside = [f for f in verdict.figures if f.variant not in (ADVERSE.name, CALIBRATED_H200.name)]
    worst = min(inside, key=lambda f: f.gain)
    (sk, sb), (ok, ob) = kernels_and_bytes(stock_text), kernels_and_bytes(ours_text)
    return {"nominal_gain": verdict.gain("nominal"), "worst_gain": worst.gain, "worst_variant": worst.variant,
            "adverse_gain": verdict.gain(ADVERSE.name), "calibrated_gain": verdict.gain(CALIBRATED_H200.name),
            "stock_kernels": sk, "ours_kernels": ok,
            "added_kernels": ok - sk, "added_mb": round((ob - sb) / 1e6, 1)}


def robust_changes(res) -> str:
    """The decisions the worst-case rule took otherwise than the nominal model would have
    (``TargetResult.robust``), one clause each; "none", or "off" without the rule."""
    return ("; ".join(f"{v.decision}: {'kept' if v.keep else 'dropped'} ({v.worst_variant} {v.worst_gain}, "
                      f"nominal {v.nominal_gain})" for v in res.robust if v.changed_decision)
            or ("none" if res.robust else "off"))


def decisions(res) -> str:
    """Every decision judged over the plausible cost models (``TargetResult.robust``, in the order
    taken), one clause each: kept or dropped, its nominal gain and its worst case with the model
    that gives it (the assumption the decision depends on most). "off" without the rule."""
    return "; ".join(f"{v.decision}: {'kept' if v.keep else 'dropped'} (nominal {v.nominal_gain}, "
                     f"worst {v.worst_gain} at {v.worst_variant})" for v in res.robust) or "off"


def split_guard(res) -> str:
    """What the rewrite guard decided on ``decompose``'s split (``TargetResult.passes``): kept or
    dropped, the plans with and without it (and after both threshold searches where they ran)."""
    dec = next((p for p in res.passes if p.name == "decompose"), None)
    guard = (dec.stats.get("final_module_guard") or {}) if dec else {}
    if not guard:
        return ""
    searched, alone = guard.get("after_combine_thresholds"), guard.get("without_split")
    return (("kept" if guard.get("kept") else "dropped")
            + f" ({guard.get('without_rewrite_planned_us')} us without -> {guard.get('rewritten_planned_us')}"
            " us with the split" + (f"; after both threshold searches {searched['without_rewrite_planned_us']}"
                                    f" -> {searched['rewritten_planned_us']} us" if searched else "")
            + (f"; the replicated collectives without the split {alone['planned_us']} us: "
               + ("kept" if alone["kept"] else "dropped") if alone else "") + ")")
