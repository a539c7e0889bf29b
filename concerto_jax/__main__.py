"""Main job: optimise a tiny GPT train step on an 8-device CPU mesh and print what was done.

    python -m concerto_jax [--model gpt] [--layout dp_tp] [--steps 3]

Runs the original and the optimised step side by side for a few steps,
checks the results are bitwise equal, and prints the report. If the
deviceless GPU compiler is installed (``pip install -e .[gpu]``) it also
prints, for one bench case compiled for 8xH100 without a GPU, the simulated
baseline (``bench.cli baseline``) and Concerto(S) against stock XLA on the same
fused graph (``bench.cli concerto``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m concerto_jax", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--layout", default="dp_tp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip the simulated GPU baseline")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import jax

    # `python -m concerto_jax` imported JAX (through the package) before this line ran, so the
    # environment variable would come too late: set the platform through the config instead,
    # before any backend starts. CPU only: the GPU plugin is used deviceless, for targets.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 8)
    import concerto_jax
    import models

    case = models.make_case(args.model, args.layout, "tiny")
    print(f"case {case.name}: mesh {dict(case.mesh.shape)}")
    step = concerto_jax.optimize(case.step)
    ref_state, opt_state = case.init_state(0), case.init_state(0)
    for i in range(args.steps):
        ref_state, ref_metrics = case.step(ref_state, case.batch)
        opt_state, opt_metrics = step(opt_state, case.batch)
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves((ref_state, ref_metrics)), jax.tree.leaves((opt_state, opt_metrics)),
            strict=True))
        loss = float(np.asarray(opt_metrics["loss"])) if "loss" in opt_metrics else float("nan")
        print(f"step {i}: loss {loss:.6f}  bitwise equal to the original: {same}")
        if not same:
            print("MISMATCH: the optimised step differs from the original", file=sys.stderr)
            return 1
    print(step.report())

    if not args.no_baseline:
        try:
            from bench import cli as bench_cli
        except ImportError as e:  # bench is part of the repo; say why if it cannot load
            print(f"(baseline skipped: {e})")
            return 0
        status = bench_cli.main(["baseline", "--quick"])
        return status or bench_cli.main(["concerto", "--quick"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
