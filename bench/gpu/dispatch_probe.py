"""Where the GPU route's step time goes, on one GPU: ``python bench/gpu/dispatch_probe.py --out DIR``.

The hardware check timed ``optimize`` 1.06-1.49x slower than plain ``jax.jit`` on item a's small
GPT steps, also where our order changed nothing. This probe separates the causes, per step
(f32, bf16), timed interleaved (median of rounds of blocks of steps, from the same state):

* ``plain``: the user's ``jax.jit`` step;
* ``plain_no_cmdbuf``: the same step compiled with XLA's command buffers (CUDA graphs) off;
* ``stock_compiled``: the route's own stock compile (``jax``'s ``Compiled``, with XLA's dumps);
* ``route_xla_order``: the route with no pass: XLA's scheduled module, backend-only compile,
  deviceless, loaded (isolates the recompile and the load from our order);
* ``route_schedule``: the route with ``schedule`` (our order);
* ``optimize``: ``concerto_jax.optimize`` (the route behind its wrapper: adds the dispatch).

Writes ``times.csv``, ``times.md`` and the final modules of ``plain`` and ``route_xla_order``
(``*.hlo.gz``) under ``DIR``. Measured on hardware; nothing here is simulated.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import logging
import os

log = logging.getLogger("concerto_jax.dispatch_probe")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per", type=int, default=10)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "concerto_jax.scheduler", "concerto_jax.costmodel",
                  "concerto_jax.gpu_route", "hlo_passes", "concerto_jax.deviceless"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import jax

    import concerto_jax
    from concerto_jax import jax_compat
    from concerto_jax.gpu_check.check import gpt_steps, interleaved_step_us
    from concerto_jax.gpu_route import route

    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    backend = route.GpuBackend if jax.default_backend() == "gpu" else route.CpuRehearsal  # a rehearsal
    steps, _ = gpt_steps([dev])
    rows = []
    for name in ("gpt_f32", "gpt_bf16"):
        step, case = steps[name]
        a = (case.init_state(0), case.batch)
        fns = {"plain": step}
        try:
            fns["plain_no_cmdbuf"] = step.lower(*a).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
        except Exception as e:  # noqa: BLE001
            log.warning("%s: no compile without command buffers: %s", name, e)
        finals = [("plain", step.lower(*a).compile())]
        for label, passes in (("route_xla_order", ()), ("route_schedule", ("schedule",))):
            try:
                built = route.build(step, a, {}, concerto_jax.Options(passes=passes), backend())
            except Exception as e:  # noqa: BLE001 - the other variants still run
                log.warning("%s %s: %s", name, label, str(e)[:300])
                continue
            if not passes:
                fns["stock_compiled"] = built.stock.compiled
                finals.append((label, built.compiled))
            fns[label] = built.compiled
        fns["optimize"] = concerto_jax.optimize(step, concerto_jax.Options(passes=("decompose", "schedule")))
        for label, c in finals:
            try:
                text = jax_compat.executable_text(jax_compat.xla_executable(c))
                with gzip.open(os.path.join(args.out, f"{name}.{label}.final.hlo.gz"), "wt") as f:
                    f.write(text)
            except Exception as e:  # noqa: BLE001
                log.warning("%s %s: no module text: %s", name, label, e)
        med = interleaved_step_us(fns, case, rounds=args.rounds, per=args.per)
        rep = fns["optimize"].report()
        log.info("%s optimize: executable %s; first-step check: %s; fallback: %s", name, rep.executable,
                 rep.first_step_check, rep.fallback_reason)
        for k, us in med.items():
            rows.append({"step": name, "variant": k, "median_step_us": round(us, 1),
                         "vs_plain": round(us / med["plain"], 3)})
            log.info("%s %-16s %8.1f us  (x%.3f of plain)", name, k, us, us / med["plain"])
        with open(os.path.join(args.out, "times.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(args.out, "times.md"), "w") as f:
            f.write(f"# dispatch probe ({jax.__version__}, {dev.device_kind}; measured)\n\n"
                    "| step | variant | median step us | vs plain |\n|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['step']} | {r['variant']} | {r['median_step_us']} | {r['vs_plain']} |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
