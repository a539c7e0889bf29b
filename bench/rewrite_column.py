"""The "rewrite + XLA's scheduler" column of the compile_for_target benches.

Our program is decompose's rewrite *and* our order of XLA's scheduled module. This column
keeps the proof that the second half is needed: decompose alone, handed to XLA's full
pipeline and its own latency-hiding scheduler (``compile_for_target(..., via="pin")`` with
``passes=("decompose",)``, which adds no pins; ``guard_rewrites=False`` and ``robust=()`` so
that what XLA makes of the rewrite is reported even where it is slower than stock), judged by
the same simulator as the stock and full-plan columns of the bench's row.

* ``rewrite_xla_us``: XLA's final module of the rewritten program, simulated µs/step.
* ``rewrite_xla_gain``: the row's stock µs / ``rewrite_xla_us``.
* ``rewrite_xla_worst_gain``: the smallest of that gain over the plausible cost models
  (``bench.robust_columns``' ``worst_gain``), to set beside the full plan's ``worst_gain``.
* ``rewrite_xla_split``: what decompose split on this path ("none": XLA compiled the step as
  stock, the column equals stock up to XLA's own choices).

One more decompose search and one more deviceless compile per case.
"""

from __future__ import annotations

COLUMNS = ("rewrite_xla_us", "rewrite_xla_gain", "rewrite_xla_worst_gain", "rewrite_xla_split")


def legend() -> str:
    """The columns' legend for a bench's markdown, one paragraph."""
    return " ".join(" ".join((__doc__ or "").split("\n\n")[:3]).split())


def columns(step, abstract_args: tuple, cluster: str, stock_us: float, options=None) -> dict:
    """``COLUMNS`` of one case: ``step`` over ``abstract_args`` through decompose and XLA's
    own pipeline for ``cluster``; ``options``: the bench's other ``Options`` fields to keep
    (compiler options, decompose options); ``passes``, ``robust`` and ``target`` are set here."""
    import dataclasses

    import concerto_jax
    from bench import robust_columns
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.judge import judge_module

    base = options if options is not None else concerto_jax.Options()
    opts = dataclasses.replace(base, passes=("decompose",), target=cluster,
                               deviceless=dataclasses.replace(base.deviceless, robust=()))
    res = concerto_jax.compile_for_target(step, *abstract_args, target=cluster, options=opts, via="pin",
                                          guard_rewrites=False)
    if res.fallback_reason is not None:
        return {"rewrite_xla_us": "", "rewrite_xla_gain": "", "rewrite_xla_worst_gain": "",
                "rewrite_xla_split": f"fallback: {res.fallback_reason[:100]}"}
    us = judge_module(res.final_text, CostModel(get_cluster(cluster))).us
    dec = next((p for p in res.passes if p.name == "decompose"), None)
    split = ("; ".join(f"{d.get('computation')} ax{d.get('axis')} N={d.get('n')}"
                       for d in dec.stats.get("decomposed", []))
             if dec is not None and dec.changed else "none")
    worst = robust_columns.columns(res.stock_final_text, res.final_text, cluster)["worst_gain"]
    return {"rewrite_xla_us": round(us, 1), "rewrite_xla_gain": round(stock_us / us, 4),
            "rewrite_xla_worst_gain": worst, "rewrite_xla_split": split or "none"}
