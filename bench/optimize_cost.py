"""First-call and later-call cost of optimize() modes against plain jit, one process per mode.

    python -m bench.optimize_cost [--case gpt/dp_tp] [--repeats 2]

Modes: ``jit`` (the user's step), ``identity`` (default Options: JAX's own
executable, ``report()`` captures lazily), ``recompile`` (``always_recompile``,
check off: the path of a changing pass), ``recompile+check`` (with
``check_first_step=True``). Each mode runs in a fresh process so no mode
profits from another's compile cache. Prints one line per mode and run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

MODES = ("jit", "identity", "recompile", "recompile+check")


def _one(mode: str, case_spec: str) -> str:
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import concerto_jax
    import models

    model, layout = case_spec.split("/")
    case = models.make_case(model, layout, "tiny")
    options = {
        "jit": None,
        "identity": concerto_jax.Options(),
        "recompile": concerto_jax.Options(optimize=concerto_jax.OptimizeOptions(
            always_recompile=True, check_first_step=False)),
        "recompile+check": concerto_jax.Options(optimize=concerto_jax.OptimizeOptions(
            always_recompile=True, check_first_step=True)),
    }[mode]
    step = case.step if options is None else concerto_jax.optimize(case.step, options)
    state = case.init_state(0)
    t = time.perf_counter()
    state, metrics = step(state, case.batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(5):
        state, metrics = step(state, case.batch)
    jax.block_until_ready(metrics)
    later = (time.perf_counter() - t) / 5
    extra = ""
    if options is not None:
        t = time.perf_counter()
        report = step.report()
        extra = f", report() {time.perf_counter() - t:.2f} s, check: {report.first_step_check}"
    return f"{mode}: first call {first:.2f} s, later calls {later * 1e3:.1f} ms{extra}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="gpt/dp_tp")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        print(_one(args.mode, args.case), flush=True)
        return
    for _ in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, "-m", "bench.optimize_cost", "--case", args.case,
                                  "--mode", mode], capture_output=True, text=True, check=False)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith(mode + ":")]
            print(line[-1] if line else f"{mode}: failed ({out.stderr.strip().splitlines()[-1:]})",
                  flush=True)


if __name__ == "__main__":
    main()
