"""Where to estimate combine-threshold candidates from: two source modules, one ranking each.

    python -m bench.threshold_proxy [--layout fsdp --layout dp_tp ...] [--layers 1]

The threshold search (docs/DECISIONS.md D35) estimates its candidates on XLA's scheduled
module at the smallest threshold, a compile of its own. XLA also dumps, in every compile, the
module before its first combiner pass (``...before_gpu-all-gather-combiner``), where no
collective is combined yet: estimating there would save that compile (D36). For each held-out
layout this compiles the step twice (the given thresholds, with that dump; the smallest
threshold) and prints the estimate of every uniform size from both modules, and their ranks.
Estimates are our simulator's (µs/step), not measured; the real plans' order is in D35.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

SIZES = (512 << 10, 2 << 20, 8 << 20, 32 << 20, 128 << 20)
PRE_COMBINER = "before_gpu-all-gather-combiner"


def run(layout: str, layers: int) -> list[str]:
    from bench.heldout_target import build
    from concerto_jax.autoccl.knobs import gpu_combine_threshold_options
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.deviceless.compile import SCHEDULED_MARKER, _read_dump, lower_for_target
    from concerto_jax.deviceless.thresholds import COMBINED_KINDS, CombineProxy

    step, params, opt_state, data, cluster = build(layout, layers)
    lowered = lower_for_target(step.trace(params, opt_state, data))
    cost_model = CostModel(get_cluster(cluster))

    def compiled(env: dict) -> tuple[str | None, str | None]:
        with tempfile.TemporaryDirectory() as d:
            lowered.compile(compiler_options={**env, "xla_dump_to": d, "xla_dump_large_constants": True,
                                              "xla_dump_hlo_pass_re": "gpu-all-gather-combiner|apply-xla-transforms"})
            return _read_dump(d, PRE_COMBINER), _read_dump(d, SCHEDULED_MARKER)

    pre_combiner, _ = compiled({})
    _, smallest = compiled(gpu_combine_threshold_options(dict.fromkeys(COMBINED_KINDS, min(SIZES))))
    lines = []
    for name, src in (("pre-combiner dump, given thresholds", pre_combiner),
                      ("scheduled module, smallest threshold", smallest)):
        proxy = CombineProxy(src, cost_model)
        est = {s: proxy.us(dict.fromkeys(COMBINED_KINDS, s)) for s in SIZES}
        rank = " < ".join(f"{s >> 10} KiB" for s in sorted(SIZES, key=lambda s: (round(est[s], 1), s)))
        lines.append(f"| {layout} | {name} | " + " | ".join(f"{est[s]:,.1f}" for s in SIZES) + f" | {rank} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="append")
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    print("| layout | estimated on | " + " | ".join(f"{s >> 10} KiB" for s in SIZES) + " | rank |")
    print("|---|---|" + "---|" * (len(SIZES) + 1))
    for layout in args.layout or ("tp", "dp_tp", "fsdp"):
        for line in run(layout, args.layers):
            print(line, flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s; estimates simulated (µs/step).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
