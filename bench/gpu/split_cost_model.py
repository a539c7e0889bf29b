"""The cost model against a split's measured compute cost: ``python -m bench.gpu.split_cost_model
RUN_DIR [RUN_DIR ...] --out DIR`` (here, on a CPU machine; RUN_DIRs hold ``split_cost.csv`` from
``bench/gpu/split_cost_probe.py``).

For each case measured there, compiles the same two programs (``.gpu_prepared/<case>.stock_post``
and ``.ours_post``, collectives stood in) through XLA's GPU pipeline deviceless for the H200,
judges both final modules with the H200 calibration's kernel rates at several per-kernel figures
(``--launch-us``), and writes ``split_cost_model.csv`` / ``.md``: measured ours / stock next to
the model's at each figure, and the figure at which the model matches the measurement (linear
between the two nearest). Needs the CUDA plugin (deviceless compiles); no GPU.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import logging
import os
import re
import statistics

log = logging.getLogger("concerto_jax.split_cost_model")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prepared", default=".gpu_prepared")
    ap.add_argument("--launch-us", default="1.5,2.5,3.0,4.0,5.7",
                    help="per-kernel figures (us) besides the H200 calibration's own, which is always judged")
    ap.add_argument("--step-us", type=float, default=None,
                    help="time per step outside kernels (default: the H200 calibration's, "
                         "ComputeOptions.step_overhead_us); 0: none, as before D52")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from concerto_jax.costmodel import CostModel, CostOptions, calibration, get_cluster
    from concerto_jax.deviceless import pjrt_c
    from concerto_jax.gpu_check.check import markdown_table, standin_collectives, write_csv
    from concerto_jax.judge import judge_module

    measured: dict = {}
    for run in args.runs:
        with open(os.path.join(run, "split_cost.csv")) as f:
            for r in csv.DictReader(f):
                measured.setdefault(r["case"], {}).setdefault(r["program"], []).append(
                    (float(r["median_us"]), int(r["kernels"])))
    cluster = get_cluster("h200_sxm_8")
    calibrated = calibration.H200.compute.launch_overhead_us  # the H200 nominal model's figure
    figures = sorted({float(x) for x in args.launch_us.split(",")} | {calibrated})
    # every figure given: none replaced by the calibration's (calibrated=False)
    step_us = calibration.H200.compute.step_overhead_us if args.step_us is None else args.step_us
    models = {L: CostModel(cluster, CostOptions(compute=dataclasses.replace(
        calibration.H200.compute, launch_overhead_us=L, step_overhead_us=step_us), calibrated=False))
              for L in figures}
    rows = []
    for case, by in measured.items():
        if not (by.get("stock") and by.get("ours")):
            continue
        judged, kernels = {}, {}
        for program in ("stock", "ours"):
            with gzip.open(os.path.join(args.prepared, f"{case}.{program}_post.hlo.gz"), "rt") as f:
                text, _ = standin_collectives(f.read())
            text = re.sub(r"is_scheduled=true,?\s*", "", text)  # XLA's whole pipeline, as on the GPU
            final = pjrt_c.compile_hlo(text, cluster, pjrt_c.spmd_compile_options(1), backend_only=False)
            kernels[program] = final.count(" fusion(") + final.count(" custom-call(")
            judged[program] = {L: judge_module(final, m).us for L, m in models.items()}
        stock_us = statistics.median(t for t, _ in by["stock"])
        ours_us = statistics.median(t for t, _ in by["ours"])
        ratio = ours_us / stock_us
        model = {L: judged["ours"][L] / judged["stock"][L] for L in figures}
        match = None  # the per-kernel figure at which the model's ratio equals the measured one
        for lo, hi in zip(figures, figures[1:], strict=False):
            a, b = model[lo], model[hi]
            if b != a and min(a, b) <= ratio <= max(a, b):
                match = round(lo + (ratio - a) / (b - a) * (hi - lo), 2)
                break
        row = {"case": case, "kernels_measured": f"{by['stock'][0][1]}->{by['ours'][0][1]}",
               "kernels_model": f"{kernels['stock']}->{kernels['ours']}", "stock_us": round(stock_us, 1),
               "stock_model_us": round(judged["stock"][calibrated], 1),
               "measured_ratio": round(ratio, 3)}
        row.update({f"model_{L:g}us": round(model[L], 3) for L in figures})
        row["matching_us_per_kernel"] = match if match is not None else ("below" if ratio < min(model.values())
                                                                         else "above")
        rows.append(row)
        log.info("%s", row)
    os.makedirs(args.out, exist_ok=True)
    cols = list(rows[0])
    write_csv(os.path.join(args.out, "split_cost_model.csv"), rows, cols)
    with open(os.path.join(args.out, "split_cost_model.md"), "w") as f:
        f.write("# A split's compute cost: measured on an H200 against the cost model "
                f"(H200 kernel rates, per-kernel figure varied, {step_us:g} us per step)\n\n"
                + markdown_table(rows, cols) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
