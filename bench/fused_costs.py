"""Fusion-aware costs of the post-SPMD graph (``concerto_jax.costmodel.fused``) against XLA's fused module.

For every suite case: one deviceless stock compile (``deviceless.compile.compile_lowered`` with
the post-SPMD and scheduled-module dumps), then, with one cost model:

* the post-SPMD task graph (``build_taskgraph``) with the cost model's unfused per-op costs
  and with ``fused_costs`` (``durations_us``): total compute (also with ``unmapped="zero"``:
  ``fused_zero_compute_us``), the step simulated in program
  order and scheduled by the decompose pass's judge settings (the schedule pass's scheduler,
  whole-graph CP-SAT off, one odd-even round);
* the total collective time of both graphs (XLA combines collectives: fewer, larger messages);
* XLA's scheduled (fused) module of the same step: total kernel time, the step simulated in
  XLA's order (stock) and scheduled by the same judge.

Columns also give the mapping's coverage (post-SPMD compute instructions mapped to a kernel
or found removed by XLA), the time of kernels no instruction maps to, and the time of
instructions that keep their unfused estimate. Command line::

    python -m bench.fused_costs [--case NAME ...] [--from-dump DIR | --dump-dir DIR]
                                [--rule anchor|proportional] [--scanned]

``--scanned``: per-computation totals (loop bodies, entry) of a scanned GPT instead.

``--from-dump DIR`` reads ``DIR/<case>/captured.hlo`` and ``DIR/<case>/xla_scheduled.hlo``
(what ``bench.cli fidelity --dump-dir DIR`` and ``--dump-dir DIR`` here write) instead of
compiling.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import time

from bench import suite

log = logging.getLogger(__name__)

COLUMNS = (
    "case", "instructions", "coverage", "eliminated", "unmapped", "unmapped_us", "unattributed_us",
    "unfused_compute_us", "fused_compute_us", "fused_zero_compute_us", "xla_compute_us", "comm_us", "xla_comm_us",
    "unfused_program_us", "fused_program_us", "xla_stock_us",
    "unfused_scheduled_us", "fused_scheduled_us", "xla_scheduled_us", "map_s", "case_wall_s",
)


def _texts(case, from_dump: str | None, dump_dir: str | None = None) -> tuple[str, str]:
    if from_dump:
        d = os.path.join(from_dump, case.name)
        with open(os.path.join(d, "captured.hlo")) as f:
            pre = f.read()
        with open(os.path.join(d, "xla_scheduled.hlo")) as f:
            xla = f.read()
        return pre, xla
    from bench.baseline import model_case
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless.compile import CompileOptions, compile_lowered

    mcase, _, _ = model_case(case)
    lowered = mcase.lower()
    tc = compile_lowered(lowered, get_cluster(case.cluster), CompileOptions(
        dump_lhs=True, dump_spmd=True, dump_scheduled=True, extra=tuple(case.xla_options)))
    pre, xla = tc.post_spmd_text, tc.scheduled_text or tc.after_lhs_text
    if dump_dir:
        d = os.path.join(dump_dir, case.name)
        os.makedirs(d, exist_ok=True)
        for name, text in (("captured.hlo", pre), ("xla_scheduled.hlo", xla)):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
    return pre, xla


def _judge(graph, events, slowdown: float) -> tuple[float, float]:
    """(program-order step, judge-scheduled step) simulated, µs."""
    import dataclasses

    from concerto_jax import scheduler
    from concerto_jax.simulator import SimOptions, simulate

    opts = SimOptions(overlap_slowdown=slowdown, memory=False)
    program = simulate(graph, events, opts).step_time_us
    base = scheduler.ScheduleOptions()
    oe = dataclasses.replace(base.odd_even or scheduler.OddEvenOptions(), rounds=1, progress=False)
    res = scheduler.schedule(graph, dataclasses.replace(base, full_model_max_tasks=0, odd_even=oe,
                                                        progress=False), initial=events)
    return program, simulate(graph, list(res.events), opts).step_time_us


def run_case(case, from_dump: str | None = None, rule: str = "anchor", dump_dir: str | None = None) -> dict:
    """One row of ``COLUMNS`` for ``case``."""
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.costmodel.fused import fused_costs
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from hlo_passes.ir.parser import parse_module

    t0 = time.perf_counter()
    pre_text, xla_text = _texts(case, from_dump, dump_dir)
    cm = CostModel(get_cluster(case.cluster))
    slowdown = cm.options.overlap_slowdown
    pre, xla = parse_module(pre_text), parse_module(xla_text)
    t1 = time.perf_counter()
    fc = fused_costs(pre, xla, cm, rule=rule)
    map_s = time.perf_counter() - t1
    row = {"case": case.name, "map_s": round(map_s, 1)}
    s = fc.summary()
    row.update(instructions=s["instructions"], coverage=s["coverage"], eliminated=s["eliminated"],
               unmapped=s["unmapped"], unmapped_us=s["unmapped_us"], unattributed_us=s["unattributed_us"])

    def compute(graph) -> float:
        return round(sum(t.duration_us for t in graph.tasks if not t.is_collective), 1)

    unf = build_taskgraph(pre, cm)
    fus = build_taskgraph(pre, cm, durations_us=fc.us)
    xg = build_taskgraph(xla, cm)
    def comm(graph) -> float:
        return round(sum(t.duration_us for t in graph.tasks if t.is_collective), 1)

    zero = build_taskgraph(pre, cm, durations_us=fused_costs(pre, xla, cm, rule=rule, unmapped="zero").us)
    row.update(unfused_compute_us=compute(unf.graph), fused_compute_us=compute(fus.graph),
               fused_zero_compute_us=compute(zero.graph),
               xla_compute_us=compute(xg.graph), comm_us=comm(unf.graph), xla_comm_us=comm(xg.graph))
    for key, hg, prog_col in (("unfused", unf, "unfused_program_us"), ("fused", fus, "fused_program_us"),
                              ("xla", xg, "xla_stock_us")):
        p, sch = _judge(hg.graph, hg.events, slowdown)
        row[prog_col] = round(p, 1)
        row[f"{key}_scheduled_us"] = round(sch, 1)
    row["case_wall_s"] = round(time.perf_counter() - t0, 1)
    log.info("%s", row)
    return row


SCANNED_CASE = "gpt_tp8_scan"
"""``--scanned``: GPT TP=8 on 8x H100, 4 layers under ``nn.scan`` with remat, compiled with
``bench.scanned``'s collective-pipeliner options."""


def scanned_case():
    """The ``--scanned`` case as a ``BenchCase``."""
    from bench.scanned import PIPELINER

    return suite.BenchCase(name=SCANNED_CASE, model="gpt", layout="tp", cluster="h100_sxm_8", mesh_shape=(8,),
                           config="gpt_0_9b", dtype="bfloat16", xla_options=PIPELINER,
                           overrides=(("num_layers", 4), ("scan_layers", True), ("remat", True)))


def per_computation(case, from_dump: str | None = None, dump_dir: str | None = None) -> list[dict]:
    """Fused post-SPMD compute vs XLA's kernels per schedulable computation (one run of each;
    computation names survive XLA's pipeline)."""
    from concerto_jax.costmodel import CostModel, get_cluster, is_kernel, op_info
    from concerto_jax.costmodel.fused import fused_costs
    from hlo_passes.ir.loops import schedulable_computations
    from hlo_passes.ir.parser import parse_module

    pre_text, xla_text = _texts(case, from_dump, dump_dir)
    pre, xla = parse_module(pre_text), parse_module(xla_text)
    cm = CostModel(get_cluster(case.cluster))
    fc = fused_costs(pre, xla, cm)
    names = {c.name for c in xla.computations}
    rows = []
    for comp in schedulable_computations(pre):
        fused = sum(fc.us.get(i.name, 0.0) for i in comp.instructions)
        unfused = sum(fc.unfused_us.get(i.name, 0.0) for i in comp.instructions)
        xla_us = (sum(cm.compute_us(op_info(i)) for i in xla.computation(comp.name).instructions if is_kernel(i))
                  if comp.name in names else "")
        rows.append({"case": case.name, "computation": comp.name, "unfused_us": round(unfused, 1),
                     "fused_us": round(fused, 1), "xla_us": round(xla_us, 1) if xla_us != "" else "",
                     "coverage": round(fc.coverage, 4)})
    return rows


def markdown(rows, command: str) -> str:
    """The table as Markdown."""
    lines = [f"`{command}`", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="suite case (repeatable; default: all)")
    ap.add_argument("--from-dump", default=None)
    ap.add_argument("--dump-dir", default=None, help="write each compiled case's two modules here")
    ap.add_argument("--rule", default="anchor", choices=("anchor", "proportional"))
    ap.add_argument("--out", default="bench/results/fused_costs")
    ap.add_argument("--scanned", action="store_true",
                    help=f"per-computation totals of {SCANNED_CASE} (loops) instead of the suite table")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.scanned:
        rows = per_computation(scanned_case(), args.from_dump, args.dump_dir)
        cols = list(rows[0])
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        print("\n".join("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows))
        return 0
    cases = suite.select_cases(args.case)
    rows = [run_case(c, args.from_dump, args.rule, args.dump_dir) for c in cases]
    command = "python -m bench.fused_costs " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
