"""GEMM time by shape and dtype on one GPU: ``python bench/gpu/gemm_sweep.py --out DIR``.

The cost model prices a GEMM at one efficiency of the tensor-core peak of its dtype
(``ComputeOptions.matmul_efficiency``; the plausible models add ``GemmByShape``, an efficiency
rising with the GEMM's FLOPs, whose end points are configured). A split makes GEMMs smaller,
so what a smaller GEMM costs decides whether a split pays. This sweep times single GEMMs, as
XLA compiles them with its autotuning, for bf16 and f32 operands (f32 at default precision:
TF32 tensor cores), over square sizes and the shapes a transformer layer's GEMMs take when
split in two, four and eight: each GEMM's kernels from a profile (``gpu_check.kernel_times``;
five runs), their sum per execution.

Writes ``gemms.csv`` (dtype, m, k, n, GFLOP, measured us per execution, kernels, TFLOP/s,
fraction of the datasheet peak) and ``gemms.md`` under ``DIR``. Measured on hardware; on a
machine without a GPU it runs the same code and measures nothing (a rehearsal).
"""

from __future__ import annotations

import argparse
import csv
import glob
import logging
import os
import tempfile
import time

from concerto_jax.costmodel.specs import H200_SXM

log = logging.getLogger("concerto_jax.gemm_sweep")

SQUARES = (256, 512, 1024, 2048, 4096, 8192)
# (m, k, n) of a transformer layer's GEMMs (tokens 8192, d 2048, ffn 5632), whole and split
LAYER = ((8192, 2048, 6144), (8192, 2048, 5632), (8192, 5632, 2048), (8192, 2048, 2048))
SPLITS = (1, 2, 4, 8)


def shapes() -> list[tuple[int, int, int]]:
    out = [(s, s, s) for s in SQUARES]
    for m, k, n in LAYER:
        for parts in SPLITS:
            out.append((m // parts, k, n))  # a split along the tokens (decompose's usual axis)
    return sorted(set(out), key=lambda s: s[0] * s[1] * s[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--recompute", metavar="WHERE", help="only rewrite DIR's tables from their measured column; "
                    "WHERE: the JAX version and GPU the sweep ran on")
    args = ap.parse_args()
    if args.recompute:
        recompute(os.path.join(args.out, "gemms.csv"), args.recompute)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import jax
    import jax.numpy as jnp

    from concerto_jax.gpu_check.check import kernel_times

    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    t_start = time.perf_counter()
    rows = []
    todo = [(m, k, n, dtype) for m, k, n in shapes() for dtype in ("bfloat16", "float32")]
    for i, (m, k, n, dtype) in enumerate(todo):  # both dtypes of a shape in turn: a budget cuts both alike
        short = "bf16" if dtype == "bfloat16" else "f32"
        if time.perf_counter() - t_start > args.budget_s:
            log.warning("budget spent: %d of %d GEMMs not timed, from %s %dx%dx%d on", len(todo) - i, len(todo),
                        short, m, k, n)
            break
        a = jax.device_put(jnp.ones((m, k), dtype) * 0.01, dev)
        b = jax.device_put(jnp.ones((k, n), dtype) * 0.01, dev)
        f = jax.jit(lambda x, y: x @ y)
        jax.block_until_ready(f(a, b))  # compile (autotuned) and warm up
        jax.block_until_ready(f(a, b))
        with tempfile.TemporaryDirectory(prefix="gemm_") as d:
            with jax.profiler.trace(d):
                for _ in range(args.runs):
                    jax.block_until_ready(f(a, b))
            found = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
            times = kernel_times(d, runs=args.runs) if found else {}
        # the GEMM's instruction (the one with the most time), its kernels summed per execution
        us, launches, executions = max(times.values(), default=(0.0, 0, 1), key=lambda v: v[0])
        rows.append(row(short, m, k, n, us / max(executions, 1), launches))
        log.info("%s %5d x %5d x %5d: %8.2f us, %6.1f TFLOP/s (%s of peak)", short, m, k, n,
                 rows[-1]["measured_us"], rows[-1]["tflops"], rows[-1]["fraction_of_peak"])
    write(rows, args.out, f"{jax.__version__}, {dev.device_kind}")
    return 0


def row(dtype: str, m: int, k: int, n: int, measured_us: float, kernels: int) -> dict:
    """One GEMM's row: its shape, GFLOP, measured time per execution, rate, fraction of peak."""
    gflop = 2.0 * m * k * n / 1e9
    tflops = gflop / measured_us * 1e3 if measured_us else 0.0  # GFLOP per us is PFLOP/s
    return {"dtype": dtype, "m": m, "k": k, "n": n, "gflop": round(gflop, 3), "measured_us": round(measured_us, 2),
            "kernels": kernels, "tflops": round(tflops, 1),
            "fraction_of_peak": round(tflops / dict(H200_SXM.matmul_tflops)[dtype], 3) if measured_us else ""}


def write(rows: list[dict], out: str, where: str) -> None:
    from concerto_jax.gpu_check.check import markdown_table, write_csv  # lazy: imports JAX

    cols = list(rows[0]) if rows else ["dtype"]
    write_csv(os.path.join(out, "gemms.csv"), rows, cols)
    with open(os.path.join(out, "gemms.md"), "w") as f:
        f.write(f"# GEMMs by shape and dtype ({where}; measured)\n\n"
                "Peak: the H200 datasheet's dense tensor-core rate (bf16 989, TF32 494 TFLOP/s).\n\n"
                + markdown_table(rows, cols) + "\n")


def recompute(csv_path: str, where: str) -> None:
    """Rewrite a sweep's tables from its measured column (GFLOP, rate and fraction derived again)."""
    with open(csv_path) as f:
        rows = [row(r["dtype"], int(r["m"]), int(r["k"]), int(r["n"]), float(r["measured_us"]), int(r["kernels"]))
                for r in csv.DictReader(f)]
    write(rows, os.path.dirname(csv_path), where)


if __name__ == "__main__":
    raise SystemExit(main())
