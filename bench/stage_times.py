"""Wall time of each stage of optimize() for a model case: capture, parse, verify, passes, print,
XLA validate, compile, run.

    python -m bench.stage_times --case gpt/dp_tp/tiny --case gpt/tp/gpt_0_9b:8 [--run-big]

A case is ``model/layout/config[:mesh]`` (mesh as ``8`` or ``2x4``). Big presets are
captured from abstract arguments (nothing allocated); ``run`` is measured for
materialised cases only. Writes ``bench/results/stage_times.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import time


def _measure(spec: str, passes: tuple[str, ...], run_big: bool) -> dict:
    import jax
    import numpy as np

    import concerto_jax
    import hlo_passes
    import models
    from concerto_jax import executor, pipeline
    from concerto_jax.capture import capture

    name, _, mesh = spec.partition(":")
    model, layout, config = name.split("/")
    mesh_shape = tuple(int(x) for x in mesh.split("x")) if mesh else None
    tiny = config == "tiny"
    materialize = tiny or run_big
    case = models.make_case(model, layout, config, mesh_shape, materialize=tiny)
    args = (case.state, case.batch) if tiny else (case.abstract_state, case.abstract_batch)
    row: dict = {"case": spec, "passes": "+".join(passes) or "identity"}
    cap = capture(case.step, args)
    row["capture_s"] = cap.seconds
    row["hlo_lines"] = cap.hlo_text.count("\n")
    t = time.perf_counter()
    module = hlo_passes.parse_module(cap.hlo_text)
    row["parse_s"] = time.perf_counter() - t
    row["instructions"] = sum(1 for _ in module.instructions())
    t = time.perf_counter()
    hlo_passes.verify(module)
    row["verify_s"] = time.perf_counter() - t
    t = time.perf_counter()
    hlo_passes.module_to_text(module)
    row["print_s"] = time.perf_counter() - t
    result = pipeline.run(cap.hlo_text, concerto_jax.Options(passes=passes))
    row["passes_s"] = result.stage_seconds.get("passes", 0.0)
    row["validate_s"] = result.stage_seconds.get("validate", 0.0)
    loaded, row["compile_s"] = executor.compile_replicated(result.text, cap.device_list)
    row["run_s"] = ""
    if materialize:
        # Big presets are initialised sharded (no host copy of the state).
        def fresh_state():
            return case.init_state(0) if tiny else case.train_step.init(jax.random.key(0))

        batch = case.batch if tiny else case.make_batch(0)
        compiled = executor.swap_executable(cap.compiled, loaded)
        state, _ = compiled(fresh_state(), batch)  # first run (allocations); state donated
        jax.block_until_ready(state)
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        row["run_s"] = time.perf_counter() - t
        del state, metrics
    np.asarray(0)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="model/layout/config[:mesh] (repeatable)")
    ap.add_argument("--passes", default="", help="comma-separated passes (default: identity)")
    ap.add_argument("--run-big", action="store_true", help="also allocate and run big presets")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    cases = args.case or ["gpt/dp_tp/tiny", "gpt/tp/gpt_0_9b:8"]
    passes = tuple(p for p in args.passes.split(",") if p)
    rows = []
    for i, spec in enumerate(cases):
        logging.info("[%d/%d] %s", i + 1, len(cases), spec)
        rows.append(_measure(spec, passes, args.run_big))
    os.makedirs(args.out, exist_ok=True)
    cols = list(rows[0])
    with open(os.path.join(args.out, "stage_times.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["# optimize() stage wall times (seconds)", "",
             f"Command: `python -m bench.stage_times {' '.join(argv or sys.argv[1:])}` (CPU, 8 emulated devices)", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "stage_times.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
