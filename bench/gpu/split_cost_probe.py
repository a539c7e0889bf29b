"""What a split costs in compute, seen through compile-to-compile noise, on one GPU:
``python bench/gpu/split_cost_probe.py --out DIR [--cases A,B] [--compiles 2]``.

The calibration (``gpu_check`` item c) compiles each suite case's stock and rewritten programs
once, collectives stood in, and times them; where decompose rewrote nothing the two are one
module compiled twice, and their steps differed by up to 10 % with XLA's command buffers on.
So one compile per program cannot tell a split's compute cost (a few percent) from that noise.
Here each program (``<case>.stock_post`` and ``<case>.ours_post`` of ``--prepared``) goes
through XLA's pipeline on this GPU ``--compiles`` times (autotuning each time), each
executable is loaded behind a stand-in step of its layout, and all are timed in interleaved
rounds (median of ``--iters`` steps per round) with XLA's defaults (command buffers on).

Writes ``split_cost.csv`` (one row per compile: median, min and max over the rounds) and
``split_cost.md`` (per case: each program's spread over its compiles, ours / stock). Measured on
hardware; without a GPU it stops with a message (XLA's GPU pipeline needs one).
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import statistics
import sys
import time

log = logging.getLogger("concerto_jax.split_cost_probe")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prepared", default=".gpu_prepared")
    ap.add_argument("--cases", default="evoformer_dap8,gpt_tp8_nvlink")
    ap.add_argument("--compiles", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop compiling after this many seconds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "concerto_jax.deviceless", "concerto_jax.gpu_route"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import jax

    from concerto_jax import jax_compat
    from concerto_jax.gpu_check import check
    from concerto_jax.gpu_route import route

    os.makedirs(args.out, exist_ok=True)
    if jax.default_backend() != "gpu":
        log.error("no GPU here (backend %s): XLA's GPU pipeline needs one", jax.default_backend())
        return 2
    device = jax.devices()[0]
    target = route.device_target([device])
    t0 = time.perf_counter()
    entries = []
    # the two programs' compiles alternate, case by case
    jobs = [(case, k, program) for case in args.cases.split(",") if case
            for k in range(args.compiles) for program in ("stock", "ours")]
    for i, (case, k, program) in enumerate(jobs):
        if time.perf_counter() - t0 > args.budget_s:
            log.warning("budget spent: %d of %d compiles left out, from %s %s compile %d", len(jobs) - i,
                        len(jobs), case, program, k)
            break
        with gzip.open(os.path.join(args.prepared, f"{case}.{program}_post.hlo.gz"), "rt") as f:
            post, _ = check.standin_collectives(f.read())
        c0 = time.perf_counter()
        text = route._require_scheduled(check.compile_replicated_for_target(
            post, [device], {"xla_gpu_exclude_nondeterministic_ops": False}, after_lhs=True)[3])
        payload = route.compile_payload(text, target, 1, replicated=False, env={})
        layout = jax_compat.entry_layout_of_text(payload.final_text)
        dummy, make_inputs = check._dummy_step(layout, device)
        run, inputs, first_us = check._timed_step(dummy, payload, make_inputs, {}, args.iters)
        entries.append({"case": case, "program": program, "compile": k, "run": run, "inputs": inputs,
                        "times": [first_us], "compile_s": round(time.perf_counter() - c0, 1),
                        "kernels": payload.final_text.count(" fusion(") + payload.final_text.count(" custom-call(")})
        log.info("%s %s compile %d: %.1f us (%.1f s to compile)", case, program, k, first_us, entries[-1]["compile_s"])
    for _ in range(args.rounds - 1):  # interleaved: every executable once per round
        for e in entries:
            times = []
            for _ in range(args.iters):
                s0 = time.perf_counter()
                jax.block_until_ready(e["run"](*e["inputs"]))
                times.append((time.perf_counter() - s0) * 1e6)
            e["times"].append(statistics.median(times))
    rows = [{"case": e["case"], "program": e["program"], "compile": e["compile"], "kernels": e["kernels"],
             "median_us": round(statistics.median(e["times"]), 1), "min_us": round(min(e["times"]), 1),
             "max_us": round(max(e["times"]), 1), "rounds": len(e["times"]), "compile_s": e["compile_s"]}
            for e in entries]
    cols = list(rows[0]) if rows else ["case"]
    check.write_csv(os.path.join(args.out, "split_cost.csv"), rows, cols)
    lines = [f"# A split's compute cost against compile-to-compile noise ({jax.__version__}, {device.device_kind}; "
             "measured, XLA's defaults)\n", check.markdown_table(rows, cols)]
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {p: [r["median_us"] for r in rows if r["case"] == case and r["program"] == p] for p in ("stock", "ours")}
        if by["stock"] and by["ours"]:
            lines.append(f"- {case}: stock {min(by['stock'])}-{max(by['stock'])} us over {len(by['stock'])} "
                         f"compiles, ours {min(by['ours'])}-{max(by['ours'])} us; ours / stock (medians of "
                         f"the compiles) {statistics.median(by['ours']) / statistics.median(by['stock']):.3f}")
    with open(os.path.join(args.out, "split_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
