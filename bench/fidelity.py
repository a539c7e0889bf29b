"""Fidelity and gain: does XLA's final module of our program keep the plan, and beat stock XLA?

For every suite case (``bench.suite``): ``concerto_jax.compile_for_target`` with
``Options(passes=("schedule",))``, deviceless for the case's cluster, by default on the
backend-only path (our scheduler orders XLA's after-LHS module, XLA's backend compiles it
as is; ``--via pin`` for the opt-barrier path). Columns (simulated us/step, one cost model,
``concerto_jax.judge.fidelity``): planned (backend-only: the module we handed XLA in its
order; pin: the pinned graph XLA runs with every collective's window opened as pinned),
final (XLA's final module of our program), stock (XLA's final module of the original
step), the overlap kept, the pins, the memory peak of XLA's and our order (scheduler's
model), and the three checks ``final <= 1.02 planned``, ``overlap_kept >= 0.95``,
``final < stock``. Every number comes from the run
that writes it. Command line::

    python -m bench.cli fidelity [--case NAME] [--quick]
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
import time
from collections.abc import Sequence

from bench import suite

log = logging.getLogger(__name__)

COLUMNS = (
    "case", "status", "via", "cluster", "mesh", "planned_step_us", "final_step_us", "stock_step_us",
    "gain_vs_stock", "overlap_kept", "planned_overlap_us", "final_overlap_us", "pins", "windows",
    "fidelity_ok", "overlap_ok", "faster_than_stock", "schedule_pass_program_us", "schedule_pass_us",
    "schedule_pass_s", "stock_compile_s", "compile_s", "input_peak_mib", "peak_mib", "memory_limit_mib",
    "fallback_reason", "case_wall_s",
)


@dataclasses.dataclass(frozen=True)
class FidelityOptions:
    """How the bench runs.

    Attributes:
      out_dir: where ``<prefix>.csv`` and ``<prefix>.md`` go.
      prefix: file-name prefix.
      passes: the pipeline's passes (``pin`` is added after ``schedule``).
      dump_dir: if set, each case's modules go to ``<dump_dir>/<case>/``.
      via: ``compile_for_target``'s path (``"backend_only"`` or ``"pin"``).
    """

    out_dir: str = "bench/results"
    prefix: str = "fidelity"
    passes: tuple[str, ...] = ("schedule",)
    dump_dir: str | None = None
    via: str = "backend_only"


def run_case(case, options: FidelityOptions, *, export_trace: bool = False) -> dict:
    """Compile one suite case through ``compile_for_target``; returns a row of ``COLUMNS``."""
    import concerto_jax
    from bench.baseline import model_case
    from models.registry import MODELS

    t0 = time.perf_counter()
    row = dict.fromkeys(COLUMNS, "")
    row.update(case=case.name, cluster=case.cluster, mesh="x".join(map(str, case.mesh_shape)))
    if case.model not in MODELS:
        row["status"] = f"skipped: model {case.model!r} not registered in models"
        return row
    mcase, preset, _ = model_case(case)
    opts = concerto_jax.Options(
        passes=options.passes, target=case.cluster, compiler_options=dict(case.xla_options),
        dump_dir=os.path.join(options.dump_dir, case.name) if options.dump_dir else None)
    res = concerto_jax.compile_for_target(mcase.step, mcase.abstract_state, mcase.abstract_batch,
                                          target=case.cluster, options=opts, via=options.via)
    mib = lambda b: round(b / 2**20, 1) if b is not None else ""  # noqa: E731
    row.update(planned_step_us=res.planned_step_us, final_step_us=res.final_step_us,
               stock_step_us=res.stock_step_us, overlap_kept=res.overlap_kept,
               planned_overlap_us=res.planned_overlap_us, final_overlap_us=res.final_overlap_us,
               pins=res.pins, fallback_reason=res.fallback_reason or "",
               gain_vs_stock=round(res.stock_step_us / res.final_step_us, 4) if res.final_step_us else "",
               fidelity_ok=res.final_step_us <= 1.02 * res.planned_step_us,
               overlap_ok=res.overlap_kept >= 0.95, faster_than_stock=res.final_step_us < res.stock_step_us,
               stock_compile_s=res.seconds.get("stock_compile", ""), compile_s=res.seconds.get("compile", ""),
               via=res.via, input_peak_mib=mib(res.input_peak_bytes), peak_mib=mib(res.peak_bytes),
               memory_limit_mib=mib(res.memory_limit_bytes))
    for rec in res.passes:
        if rec.name == "schedule":
            row.update(schedule_pass_program_us=rec.stats.get("program_order_us", ""),
                       schedule_pass_us=rec.stats.get("scheduled_us", ""), schedule_pass_s=round(rec.seconds, 1))
        if rec.name == "pin":
            row["windows"] = rec.stats.get("windows", "")
    row.update(status=f"ok ({preset})" if res.fallback_reason is None else "fallback",
               case_wall_s=round(time.perf_counter() - t0, 1))
    return row


_MD_COLUMNS = ("case", "via", "planned_step_us", "final_step_us", "stock_step_us", "gain_vs_stock", "overlap_kept",
               "pins", "input_peak_mib", "peak_mib", "fidelity_ok", "overlap_ok", "faster_than_stock", "status")


def markdown(rows: Sequence[dict], command: str, elapsed: float) -> str:
    """The results table with its legend."""
    head = ["# Fidelity and gain: XLA's final module of our program vs the plan and vs stock XLA", "",
            f"Command: `{command}` ({elapsed:.0f} s). Simulated us/step (one cost model per target, "
            "overlap slowdown included). via backend_only: planned = the module we handed XLA's backend "
            "(XLA's scheduled module in our order), in its order; via pin: planned = the pinned fused graph "
            "XLA runs with every collective started as soon as its operands allow and waited for right "
            "before its first reader. final: "
            "XLA's final module of our program in XLA's order; stock: XLA's final module of the original "
            "step. Checks: fidelity_ok = final <= 1.02 planned; overlap_ok = overlap_kept >= 0.95; "
            "faster_than_stock = final < stock. input_peak_mib / peak_mib: peak live memory of XLA's / our "
            "order of the entry (scheduler's memory model; the limit is the input's peak, or XLA's own "
            "scheduler limit on the target where that plan judged faster: Options.deviceless.memory_budget).", "",
            "| " + " | ".join(_MD_COLUMNS) + " |", "|" + "---|" * len(_MD_COLUMNS)]
    for r in rows:
        head.append("| " + " | ".join(str(r.get(c, "")) for c in _MD_COLUMNS) + " |")
    ok = [r for r in rows if str(r["status"]).startswith("ok")]
    head += ["", f"{sum(r['fidelity_ok'] is True for r in ok)}/{len(ok)} fidelity_ok, "
             f"{sum(r['overlap_ok'] is True for r in ok)}/{len(ok)} overlap_ok, "
             f"{sum(r['faster_than_stock'] is True for r in ok)}/{len(ok)} faster_than_stock.", ""]
    return "\n".join(head)


def run(cases: Sequence, options: FidelityOptions = FidelityOptions(), command: str = "") -> list[dict]:
    """Run ``cases``; write ``<prefix>.csv`` and ``<prefix>.md``; returns the rows."""
    os.makedirs(options.out_dir, exist_ok=True)
    t0 = time.perf_counter()

    def done(k, case, row):
        log.info("[%d/%d] %s: planned %s final %s stock %s us, kept %s, pins %s [%.0fs] %s", k, len(cases),
                 case.name, row["planned_step_us"], row["final_step_us"], row["stock_step_us"],
                 row["overlap_kept"], row["pins"], time.perf_counter() - t0, row["status"])

    rows = suite.run_each(cases, lambda case, export_trace: run_case(case, options, export_trace=export_trace),
                          COLUMNS, None, done)
    with open(os.path.join(options.out_dir, f"{options.prefix}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(options.out_dir, f"{options.prefix}.md"), "w") as f:
        f.write(markdown(rows, command, time.perf_counter() - t0))
    return rows
