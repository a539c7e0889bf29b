"""Main job: what concerto_jax does, shown on a CPU machine.

    python -m concerto_jax [--out DIR] [--steps 3] [--no-target] [--quick]

1. A GPT train step on an 8-device CPU mesh (data 2 x model 4) through ``optimize`` with
   the passes ``decompose`` + ``schedule``; a few steps checked against plain ``jax.jit``.
2. A GPT TP=8 train step compiled for 8x H100 SXM without a GPU (``compile_for_target``):
   XLA's final module of the stock step and of ours, simulated by our cost model.
3. A Gantt chart (PNG) of both timelines and a Perfetto trace (JSON) written to ``--out``.

Progress goes to the log (stderr); the results are printed. The first run costs about 170 s of
CPU time (mostly XLA compiling for the GPU target); a second run reuses the plan cache (~40 s).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from importlib import metadata

# ``python -m concerto_jax`` has imported the package, and so JAX, before this module runs;
# importing does not start a backend, ``main`` configures the platform before any does.
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from concerto_jax.api import optimize
from concerto_jax.demo.gpt import GPTConfig, train_step
from concerto_jax.demo.timeline import simulate_module, write_comparison
from concerto_jax.deviceless.compile import target_mesh
from concerto_jax.deviceless.program import compile_for_target
from concerto_jax.options import DevicelessOptions, Options

log = logging.getLogger("concerto_jax.main")

TARGET = "h100_sxm_8"


def _cpu_step(args) -> bool:
    """Part 1; False when the optimised step differs from the original beyond its tolerance."""
    cfg = GPTConfig()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    built = train_step(cfg, mesh)
    print(f"1. optimize: GPT train step on 8 CPU devices, data 2 x model 4 ({cfg.num_layers} layers, "
          f"hidden {cfg.hidden}, fp32, AdamW)")
    options = Options(passes=("decompose", "schedule"))
    print(f"   passes {' + '.join(options.passes)}; {args.steps} steps against plain jax.jit:")
    step = optimize(built.step, options)
    batch = built.example_batch(0)
    ref_state, opt_state = built.init_state(0), built.init_state(0)
    log.info("compiling the plain and the optimised step (capture, passes, XLA compile)")
    worst, bitwise = 0.0, True
    for i in range(args.steps):
        ref_state, ref_m = built.step(ref_state, batch)
        opt_state, opt_m = step(opt_state, batch)
        diff = 0.0
        for a, b in zip(jax.tree.leaves((ref_state, ref_m)), jax.tree.leaves((opt_state, opt_m)),
                        strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if not np.array_equal(a, b):
                bitwise = False
                scale = float(np.max(np.abs(a))) or 1.0
                diff = max(diff, float(np.max(np.abs(a.astype(np.float64) - b))) / scale)
        worst = max(worst, diff)
        print(f"   step {i}: loss {float(ref_m['loss']):.6f} (jit) {float(opt_m['loss']):.6f} (ours); "
              f"largest difference {diff:.1e} (relative)")
    report = step.report()
    tolerance = max((p.tolerance for p in report.passes), default=0.0)
    changed = [p.name for p in report.passes if p.changed]
    cached = "plan_cache" in report.stage_seconds
    print(f"   changed by: {', '.join(changed) or 'no pass'}; plan "
          + ("from the plan cache (a previous run's)" if cached else "made now, stored in the plan cache"))
    if bitwise:
        print(f"   RESULT: bitwise equal to plain jax.jit on all {args.steps} steps")
        return True
    if worst <= tolerance:
        print(f"   RESULT: within the declared tolerance {tolerance:g} of plain jax.jit on all "
              f"{args.steps} steps (not bitwise)")
        return True
    print(f"   RESULT: MISMATCH: {worst:.1e} exceeds the declared tolerance {tolerance:g}")
    return False


def _target_step(args) -> None:
    """Part 2 and 3."""
    if args.quick:
        cfg = GPTConfig(vocab_size=4096, hidden=512, num_layers=1, num_heads=8, seq_len=256,
                        batch_size=8, dtype=jnp.bfloat16)
    else:
        cfg = GPTConfig(vocab_size=32000, hidden=2048, num_layers=args.layers, num_heads=16,
                        seq_len=1024, batch_size=16, dtype=jnp.bfloat16)
    try:
        mesh = target_mesh(TARGET, (1, 8), ("data", "model"))
    except ImportError as e:  # the CUDA plugin is missing: the message says how to install it
        print(f"2. skipped: compiling for a GPU cluster without a GPU needs the CUDA plugin ({e})")
        return
    built = train_step(cfg, mesh)
    print(f"2. compile_for_target: GPT train step, TP=8 ({cfg.num_layers} layers, hidden {cfg.hidden}, "
          f"{cfg.batch_size}x{cfg.seq_len} tokens, bf16)")
    print("   compiled by XLA for 8x H100 SXM on this CPU machine, no GPU")
    # combine_thresholds=(): no search over XLA's combine thresholds (one XLA compile each).
    options = Options(passes=("decompose", "schedule"), deviceless=DevicelessOptions(combine_thresholds=()))
    log.info("compile_for_target(%s): stock compile, decompose, schedule, XLA backend", TARGET)
    t0 = time.perf_counter()
    res = compile_for_target(built.step, *built.abstract_inputs, target=TARGET,
                                          options=options)
    seconds = time.perf_counter() - t0
    cached = "plan_cache" in res.seconds
    log.info("simulating both final modules for the charts")
    stock = simulate_module(res.stock_final_text, TARGET, "stock XLA")
    ours = simulate_module(res.final_text, TARGET, "ours (decompose + schedule)")
    print("   XLA's final modules, timed by our cost model (simulated, not measured on a GPU):")
    print(f"   {'':34}{'stock XLA':>12}{'ours':>12}")
    for name, a, b in (
            ("step time (simulated)", f"{res.stock_step_us:,.0f} us", f"{res.final_step_us:,.0f} us"),
            ("exposed communication (simulated)", f"{stock.result.exposed_comm_us:,.0f} us",
             f"{ours.result.exposed_comm_us:,.0f} us"),
            ("peak memory (simulated)", f"{stock.peak_bytes / 2**20:,.0f} MiB",
             f"{ours.peak_bytes / 2**20:,.0f} MiB")):
        print(f"   {name:34}{a:>12}{b:>12}")
    gain = res.stock_step_us / res.final_step_us
    how = "fallback: " + res.fallback_reason if res.fallback_reason else f"via {res.via}"
    print(f"   gain (simulated): {gain:.3f}x ({how})")
    print(f"   compile_for_target: {seconds:.0f} s, " + (
        "plan cache hit (a previous run's plan and modules)" if cached
        else "plan stored in the plan cache (a second run reuses it)"))
    png, trace = write_comparison(args.out, "gpt_tp8_h100", (stock, ours),
                                  title=f"GPT TP=8 train step on 8x H100 SXM, one device's timeline "
                                        f"(simulated): ours {gain:.2f}x faster than stock XLA")
    print(f"3. Written to {os.path.abspath(args.out)}:")
    if png is None:
        print("   (no Gantt chart: it needs matplotlib, pip install 'concerto_jax[plot]')")
    else:
        print(f"   {os.path.basename(png):26}Gantt chart of both timelines (red: exposed communication)")
    print(f"   {os.path.basename(trace):26}Perfetto trace of both (open in https://ui.perfetto.dev)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m concerto_jax", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="concerto_out", help="folder for the chart and the trace")
    parser.add_argument("--steps", type=int, default=3, help="CPU steps checked against jax.jit")
    parser.add_argument("--no-target", action="store_true",
                        help="skip the compile for 8x H100 (needs the CUDA plugin)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the GPU step (hidden 2048)")
    parser.add_argument("--quick", action="store_true", help="a smaller GPU step (tests)")
    parser.add_argument("-v", "--verbose", action="store_true", help="the library's INFO log too")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # results and log lines in the order they happen

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("concerto_jax").setLevel(logging.INFO if args.verbose else logging.WARNING)
    log.setLevel(logging.INFO)
    # `python -m concerto_jax` imported JAX (through the package) before this line ran, so the
    # environment variable would come too late: set the platform through the config instead,
    # before any backend starts. CPU only: the GPU plugin is used deviceless, for targets.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    jax.config.update("jax_num_cpu_devices", 8)

    print(f"concerto_jax {_version()} on jax {jax.__version__}")
    if not _cpu_step(args):
        return 1
    if not args.no_target:
        _target_step(args)
    return 0


def _version() -> str:
    try:
        return metadata.version("concerto_jax")
    except metadata.PackageNotFoundError:
        return "(from the source tree)"


if __name__ == "__main__":
    sys.exit(main())
