"""The plan cache on ``optimize``'s GPU route, across a restart, on one GPU:
``python bench/gpu/route_cache_probe.py --out DIR``.

Runs ``optimize`` on item a's small GPT steps (f32, bf16) in two fresh processes over one cache
directory. Each process times the first call of the plain ``jax.jit`` step (its compile) and of
``optimize`` (plan, compile, load and first-step check, or from the cache: load and check),
compares the two steps' results bitwise over a few steps, and logs ``report()``'s account.
Writes ``cache.csv`` and ``cache.md`` under ``DIR``. Wall times measured on the machine it runs on.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import subprocess
import sys
import time

log = logging.getLogger("concerto_jax.route_cache_probe")


def one_process(cache_dir: str, label: str) -> list[dict]:
    import jax
    import numpy as np

    import concerto_jax
    from concerto_jax.gpu_check.check import gpt_steps

    steps, _ = gpt_steps(jax.devices()[:1] if jax.default_backend() == "gpu" else jax.devices())
    rows = []
    for name in ("gpt_f32", "gpt_bf16"):
        step, case = steps[name]
        t0 = time.perf_counter()
        ref = jax.block_until_ready(step(case.init_state(0), case.batch))
        plain_s = time.perf_counter() - t0
        opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("decompose", "schedule"),
                                                               cache_dir=cache_dir))
        t0 = time.perf_counter()
        got = jax.block_until_ready(opt(case.init_state(0), case.batch))
        first_s = time.perf_counter() - t0
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True))
        s_ref, s_got = case.init_state(0), case.init_state(0)
        for _ in range(3):
            s_ref, m_ref = step(s_ref, case.batch)
            s_got, m_got = opt(s_got, case.batch)
        same = same and all(np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b in zip(jax.tree.leaves((s_ref, m_ref)), jax.tree.leaves((s_got, m_got)),
                                            strict=True))
        rep = opt.report()
        rows.append({"process": label, "step": name, "backend": jax.default_backend(),
                     "plain_first_call_s": round(plain_s, 3), "optimize_first_call_s": round(first_s, 3),
                     "ratio": round(first_s / plain_s, 2), "bitwise_4_steps": same,
                     "executable": rep.executable, "stages": ",".join(f"{k}={v:.2f}" for k, v in rep.stage_seconds.items()),
                     "first_step_check": rep.first_step_check, "fallback": rep.fallback_reason})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "concerto_jax.scheduler", "concerto_jax.costmodel", "hlo_passes",
                  "concerto_jax.deviceless"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.child:
        rows = one_process(args.cache_dir, args.child)
        with open(os.path.join(args.out, f"{args.child}.json"), "w") as f:
            json.dump(rows, f, default=str)
        return 0
    os.makedirs(args.out, exist_ok=True)
    cache_dir = os.path.join(args.out, "cache")
    rows = []
    for label in ("first", "restart"):
        rc = subprocess.call([sys.executable, __file__, "--out", args.out, "--child", label,
                              "--cache-dir", cache_dir])
        if rc:
            log.error("process %s exited %d", label, rc)
            return rc
        with open(os.path.join(args.out, f"{label}.json")) as f:
            rows += json.load(f)
    for r in rows:
        log.info("%s", r)
    cols = list(rows[0])
    with open(os.path.join(args.out, "cache.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "cache.md"), "w") as f:
        f.write("# optimize's plan cache across a restart (wall times measured)\n\n| "
                + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r[c]) for c in cols) + " |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
