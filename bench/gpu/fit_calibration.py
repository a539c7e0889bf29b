"""Fit the cost model's kernel rates to the kernels a GPU check measured.

    python -m bench.gpu.fit_calibration RUN_DIR [RUN_DIR ...] [--out DIR]

Reads ``kernels.csv`` and ``calibration.csv`` of one or more ``python -m concerto_jax.gpu_check``
runs on one GPU type (their tuned modules: XLA's autotuned kernels, collectives stood in) and
fits, per kernel class, the two numbers of the roofline the model uses
(``costmodel.compute.work_time_us``): an achieved fraction of the peak rate (tensor-core peak
for kernels with matrix work, HBM bandwidth for the rest) and a fixed time per kernel. Half of
the suite cases fit (alternate cases by name), the other half is held back.

The unit is one execution of an HLO instruction, as the model prices it: its measured time is
the sum of every kernel it launched (a cuBLAS GEMM launches a memset beside it), divided by its
executions per run (``executions``: 1 outside loops; runs from before that column have no
loops in their modules and count 1).

Per class it reports the error before (the shipped defaults) and after, on both halves: the
error of the class's summed time and the median per-kernel relative error. Per case it reports
the step's time outside its kernels (gaps: launches, synchronisation), per kernel launched.

Whole steps, two ways of charging the time outside kernels (D52): all of it per kernel
(``--per-kernel-only-us``, the H200 figure before D52: 5.7 us), or a marginal cost per kernel
(``--launch-us``, 2.5 us: the figure at which the model with this time per step reproduces the
compute a split adds, measured through two compiles each, ``split-model-2/``) and a time per step, fitted here: the
median, over the programs timed with XLA's defaults, of the measured step less the model's
price of its kernels at the marginal cost (``step_overhead_us``).

Writes ``fit.csv``, ``fit_steps.csv`` and ``fit.md`` beside the input. Everything it reads was
measured on the GPU named in the run's ``checks.md``; the fit itself is arithmetic here.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import statistics

import numpy as np

from concerto_jax.costmodel import calibration

log = logging.getLogger("concerto_jax.fit_calibration")

CLASSES = ("matmul", "convolution", "reduction", "transpose", "loop_fusion", "other")
MATRIX_CLASSES = ("matmul", "convolution")


def kernel_group(row: dict) -> str:
    """The fit's class of a kernel row: matrix work first (a convolution where the kernel is a
    cuDNN call or a convolution); an input fusion (``reduction_fusion`` in the run's classes,
    XLA's ``kInput``) by the hero its name carries (XLA names a fusion after its ops:
    ``input_reduce_fusion``, ``input_transpose_fusion``, ``input_scatter_fusion``): reduction,
    transpose, or other; loop fusions; other."""
    if float(row["mm_peak_us"] or 0) > 0:
        return "convolution" if row["class"] in ("custom_call", "conv") else "matmul"
    if row["class"] in ("reduction_fusion", "transpose_fusion"):
        name = row["instruction"]
        if "reduce" in name:
            return "reduction"
        return "transpose" if "transpose" in name else "other"
    return "loop_fusion" if row["class"] == "loop_fusion" else "other"


def load(run_dirs) -> tuple[list[dict], list[dict]]:
    """Kernel and step rows of every run in ``run_dirs`` (a path or several)."""
    kernels, steps = [], []
    for run_dir in [run_dirs] if isinstance(run_dirs, str) else run_dirs:
        with open(os.path.join(run_dir, "kernels.csv")) as f:
            kernels += [r for r in csv.DictReader(f) if r.get("modules", "tuned") == "tuned"
                        and r.get("mm_peak_us") not in (None, "") and r["predicted_us"] not in ("", "nan")]
        with open(os.path.join(run_dir, "calibration.csv")) as f:
            steps += [r for r in csv.DictReader(f) if r.get("modules", "tuned") == "tuned"]
    for r in kernels:
        for k in ("predicted_us", "measured_us", "mm_peak_us", "vector_us", "mem_peak_us"):
            r[k] = float(r[k])
        r["launches"] = max(int(r["launches"]), 1)
        r["executions"] = max(int(r.get("executions") or 1), 1)
        r["model_kernels"] = int(r["model_kernels"])
        r["group"] = kernel_group(r)
    return kernels, steps


def model_us(r: dict, efficiency: float, fixed_us: float) -> float:
    """One execution of the instruction of row ``r`` under ``(efficiency, fixed_us)``: the
    roofline's busy time plus ``fixed_us`` per kernel the model counts."""
    if r["group"] in MATRIX_CLASSES:
        busy = max(r["mm_peak_us"] / efficiency + r["vector_us"], r["mem_peak_us"] / 0.8)
    else:
        busy = max(r["vector_us"], r["mem_peak_us"] / efficiency)
    return busy + fixed_us * max(r["model_kernels"], 1)


def fit_group(rows: list[dict]) -> tuple[float, float]:
    """``(efficiency, fixed_us)`` minimising ``sum((pred - measured)^2 / measured)`` over the
    measured executions: the long kernels, which make a step's time, weigh most, and the short
    ones still count."""
    rows = [r for r in rows if r["measured_us"] > 0]
    if not rows:
        return math.nan, math.nan
    measured = np.array([r["measured_us"] / r["executions"] for r in rows])
    col = {k: np.array([float(r[k]) for r in rows]) for k in ("mm_peak_us", "vector_us", "mem_peak_us")}
    kernels = np.array([max(r["model_kernels"], 1) for r in rows], dtype=float)
    matrix = np.array([r["group"] in MATRIX_CLASSES for r in rows])
    fixed = np.linspace(0.0, 8.0, 81)[:, None]  # every fixed time at once: model_us, vectorised
    best, arg = math.inf, (math.nan, math.nan)
    for eff in np.linspace(0.05, 1.5, 146):
        busy = np.where(matrix, np.maximum(col["mm_peak_us"] / eff + col["vector_us"], col["mem_peak_us"] / 0.8),
                        np.maximum(col["vector_us"], col["mem_peak_us"] / eff))
        err = np.sum((busy + fixed * kernels - measured) ** 2 / measured, axis=1)
        i = int(np.argmin(err))
        if err[i] < best:
            best, arg = float(err[i]), (float(eff), float(fixed[i, 0]))
    return arg


def errors(rows: list[dict], predict) -> tuple[float, float]:
    """(summed-time relative error, median per-kernel relative error) of ``predict(row)``."""
    if not rows:
        return math.nan, math.nan
    pred = [predict(r) * r["executions"] for r in rows]
    meas = [r["measured_us"] for r in rows]
    total = (sum(pred) - sum(meas)) / sum(meas)
    return total, statistics.median(abs(p - m) / m for p, m in zip(pred, meas, strict=True) if m > 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="gpu_check output directories (kernels.csv, calibration.csv)")
    ap.add_argument("--out", help="where fit.csv, fit_steps.csv and fit.md go (default: the first run)")
    ap.add_argument("--launch-us", type=float, default=2.5,
                    help="marginal cost per kernel of the two-term step model (the split probe's figure)")
    ap.add_argument("--per-kernel-only-us", type=float, default=5.7,
                    help="cost per kernel of the model that charges all outside time per kernel")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    kernels, steps = load(args.run_dirs)
    cases = sorted({r["case"] for r in kernels})
    fit_cases, held_cases = set(cases[0::2]), set(cases[1::2])
    out_rows = []
    for group in CLASSES:
        rows = [r for r in kernels if r["group"] == group]
        fit_rows = [r for r in rows if r["case"] in fit_cases]
        held_rows = [r for r in rows if r["case"] in held_cases]
        eff, fixed = fit_group(fit_rows)
        for half, subset in (("fit", fit_rows), ("held_out", held_rows)):
            before = errors(subset, lambda r: r["predicted_us"])
            after = errors(subset, lambda r, e=eff, c=fixed: model_us(r, e, c))
            out_rows.append({"class": group, "half": half, "kernels": len(subset),
                             "fitted_efficiency": round(eff, 3), "fitted_fixed_us": round(fixed, 2),
                             "sum_error_before": round(before[0], 3), "sum_error_after": round(after[0], 3),
                             "median_abs_error_before": round(before[1], 3),
                             "median_abs_error_after": round(after[1], 3)})
            log.info("%-16s %-8s %4d kernels: eff %.3f fixed %.2f us; sum error %+.3f -> %+.3f; "
                     "median |error| %.3f -> %.3f", group, half, len(subset), eff, fixed, *before[:1],
                     after[0], before[1], after[1])
    shipped = calibration.H200.compute
    shipped_eff = {"matmul": shipped.matmul_efficiency, "convolution": shipped.convolution_efficiency,
                   "reduction": shipped.reduction_efficiency}

    def priced(ks, launch_us: float) -> float:
        """The measured kernels of one program priced at the shipped efficiencies and
        ``launch_us`` per kernel the model counts, every execution."""
        return sum((model_us(r, shipped_eff.get(r["group"]) or shipped.memory_efficiency, 0.0)
                    + launch_us * max(r["model_kernels"], 1)) * r["executions"] for r in ks)

    programs = []
    for s in steps:
        ks = [r for r in kernels if r["case"] == s["case"] and r["program"] == s["program"]]
        cmdbuf = float(s["measured_step_cmdbuf_us"]) if s.get("measured_step_cmdbuf_us") else None
        programs.append((s, ks, cmdbuf))
    with_cmdbuf = [(ks, c) for _, ks, c in programs if c is not None]
    step_term = statistics.median(c - priced(ks, args.launch_us) for ks, c in with_cmdbuf) if with_cmdbuf else math.nan
    log.info("two-term step model: %.1f us per kernel and %.1f us per step", args.launch_us, step_term)

    def error(pred: float, cmdbuf: float | None):
        return round((pred - cmdbuf) / cmdbuf, 3) if cmdbuf else ""

    step_rows = []
    for s, ks, cmdbuf in programs:
        launched = sum(r["launches"] for r in ks)
        busy = sum(r["measured_us"] for r in ks)
        step = float(s["measured_step_us"])
        step_rows.append({"case": s["case"], "program": s["program"], "measured_step_us": step,
                          "kernel_sum_us": round(busy, 1), "kernels": launched,
                          "outside_kernels_us": round(step - busy, 1),
                          "outside_per_kernel_us": round((step - busy) / launched, 2) if launched else "",
                          # XLA's defaults (command buffers on), where the run timed them
                          "measured_step_cmdbuf_us": cmdbuf if cmdbuf is not None else "",
                          "outside_per_kernel_cmdbuf_us": (round((cmdbuf - busy) / launched, 2)
                                                           if cmdbuf is not None and launched else ""),
                          "datasheet_error": error(float(s["predicted_step_us"]), cmdbuf),
                          # all outside time per kernel (the H200 figures before D52)
                          "per_kernel_only_error": error(priced(ks, args.per_kernel_only_us), cmdbuf),
                          # marginal per kernel + this fit's time per step
                          "two_term_error": error(priced(ks, args.launch_us) + step_term, cmdbuf),
                          # the shipped H200 figures (costmodel.calibration.H200)
                          "shipped_h200_error": error(priced(ks, shipped.launch_overhead_us)
                                                      + shipped.step_overhead_us, cmdbuf)})
    d = args.out or args.run_dirs[0]
    os.makedirs(d, exist_ok=True)
    cols = list(out_rows[0])
    with open(os.path.join(d, "fit.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(out_rows)
    with open(os.path.join(d, "fit_steps.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(step_rows[0]))
        w.writeheader()
        w.writerows(step_rows)
    per_kernel = [r["outside_per_kernel_us"] for r in step_rows if r["outside_per_kernel_us"] != ""]
    with open(os.path.join(d, "fit.md"), "w") as f:
        f.write("# Kernel-rate fit (measured kernels; fit on " + ", ".join(sorted(fit_cases))
                + "; held out " + ", ".join(sorted(held_cases)) + ")\n\n")
        f.write("`python -m bench.gpu.fit_calibration " + " ".join(args.run_dirs)
                + (f" --out {args.out}" if args.out else "") + "`\n\n")
        f.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for r in out_rows:
            f.write("| " + " | ".join(str(r[c]) for c in cols) + " |\n")
        f.write("\n## Whole steps: time outside kernels; the model's error before and with the shipped H200 "
                "figures\n\nKernels timed with XLA's command buffers off; the step also with them on "
                "(`measured_step_cmdbuf_us`, XLA's default), against which every error is taken: "
                "`datasheet_error` the run's own prediction; the measured kernels re-priced at the H200 "
                f"efficiencies with `per_kernel_only_error` {args.per_kernel_only_us:g} us per kernel, "
                f"`two_term_error` {args.launch_us:g} us per kernel and {step_term:.1f} us per step "
                "(this fit), `shipped_h200_error` the figures of `costmodel.calibration.H200`.\n\n")
        sc = list(step_rows[0])
        f.write("| " + " | ".join(sc) + " |\n|" + "---|" * len(sc) + "\n")
        for r in step_rows:
            f.write("| " + " | ".join(str(r[c]) for c in sc) + " |\n")
        f.write(f"\nMedian time outside kernels per kernel launched: {statistics.median(per_kernel):.2f} us\n")
        per_kernel_cmdbuf = [r["outside_per_kernel_cmdbuf_us"] for r in step_rows
                             if r["outside_per_kernel_cmdbuf_us"] != ""]
        if per_kernel_cmdbuf:
            f.write(f"With XLA's command buffers on (its default): {statistics.median(per_kernel_cmdbuf):.2f} us\n")
            f.write(f"\nTwo-term step model: {args.launch_us:g} us per kernel and **{step_term:.1f} us per step** "
                    "(the median of the measured steps less their kernels' price at that marginal cost). "
                    "Median |error| over the programs: "
                    + ", ".join(f"{k} {statistics.median(abs(r[k]) for r in step_rows if r[k] != ''):.3f}"
                                for k in ("datasheet_error", "per_kernel_only_error", "two_term_error",
                                          "shipped_h200_error")) + "\n")
    log.info("wrote %s", os.path.join(d, "fit.md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
