"""Multi-process CPU job: tune the gradient bucket size of a data-parallel step online (gloo).

``launch()`` spawns ``num_processes`` Python processes (``python -m
concerto_jax.autoccl.dp_job``) on a free local port; each initialises
``jax.distributed`` with gloo CPU collectives and ``devices_per_process``
CPU devices, builds a data-parallel step over all devices with many small
gradients (``dp_step.py``), and then

1. times the untuned step (one all-reduce per gradient, combiner off),
2. runs ``OnlineTuner`` over the bucket size inside the training loop
   (process 0 measures and decides, the choice is broadcast),
3. optionally sweeps every bucket size (the exhaustive reference),
4. checks that the tuned and untuned steps give the same parameters.

Process 0 writes a JSON report; every process exits by itself, and
``launch`` kills the group if the timeout passes.

References:
  AutoCCL NSDI'25 §4.3 (online tuning in the first iterations).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from concerto_jax.autoccl.dp_step import compile_dp_step, count_all_reduces, make_dp_step
from concerto_jax.autoccl.online import OnlineTuner, TunerOptions
from concerto_jax.autoccl.search import SearchOptions
from concerto_jax.autoccl.space import Config, IntGrid, SearchSpace
from concerto_jax.autoccl.store import Signature
from concerto_jax.launch import run_local

__all__ = ["BUCKET_SPACE_GRID", "launch"]

logger = logging.getLogger(__name__)

# 0 = one all-reduce per gradient; then 1 KiB .. 4 MiB by factors of 2.
BUCKET_SPACE_GRID = (0,) + tuple(1024 * 2**i for i in range(13))


def launch(
    out_json: str,
    num_processes: int = 2,
    devices_per_process: int = 4,
    num_grads: int = 48,
    sweep: bool = False,
    timeout_s: float = 240.0,
    extra_args: tuple[str, ...] = (),
) -> dict:
    """Runs the job in ``num_processes`` local processes and returns process 0's report.

    Raises:
      RuntimeError: a process failed or the timeout passed (stderr tails included).
    """
    run_local(
        "concerto_jax.autoccl.dp_job",
        ["--devices", str(devices_per_process), "--num-grads", str(num_grads), "--out", out_json,
         *(["--sweep"] if sweep else []), *extra_args],
        num_processes=num_processes,
        timeout_s=timeout_s,
    )
    with open(out_json) as f:
        report = json.load(f)
    report["per_process"] = []
    for i in range(num_processes):
        with open(f"{out_json}.p{i}") as f:
            report["per_process"].append(json.load(f))
    return report


def _time_step(fn, params, batch, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        params, loss = fn(params, batch)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - t0)
    return times


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--num-grads", type=int, default=48)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-rel-improvement", type=float, default=0.03)
    ap.add_argument("--sweep-repeats", type=int, default=5)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[p{args.process_id}] %(name)s: %(message)s")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    rng = np.random.default_rng(0)  # same on every process
    host_params = [
        rng.standard_normal(int(s)).astype(np.float32) * 0.1
        for s in rng.integers(64, 1024, args.num_grads)
    ]
    host_batch = rng.standard_normal((8 * len(jax.devices()), 16)).astype(np.float32)
    repl, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    params = [
        jax.make_array_from_callback(p.shape, repl, lambda idx, p=p: p[idx]) for p in host_params
    ]
    batch = jax.make_array_from_callback(host_batch.shape, shard, lambda idx: host_batch[idx])
    total_bytes = sum(p.nbytes for p in host_params)

    def loss_fn(ps, b):
        v = jnp.concatenate(ps)
        return jnp.mean(jnp.tanh(b[:, :1] * v[None, :]) ** 2)

    compiled: dict[int, tuple] = {}

    def get(bucket_bytes: int):
        if bucket_bytes not in compiled:
            step, buckets = make_dp_step(loss_fn, mesh, "dp", bucket_bytes, params)
            exe = compile_dp_step(step, params, batch)
            n_ar = count_all_reduces(exe.as_text())
            assert n_ar == len(buckets), (n_ar, len(buckets))
            compiled[bucket_bytes] = (exe, len(buckets))
        return compiled[bucket_bytes]

    report: dict = {
        "num_grads": args.num_grads,
        "total_grad_bytes": int(total_bytes),
        "processes": args.num_processes,
        "devices_per_process": args.devices,
    }
    # 1. untuned baseline: one all-reduce per gradient.
    exe0, n0 = get(0)
    _time_step(exe0, params, batch, 2)
    report["untuned"] = {
        "bucket_bytes": 0,
        "all_reduces": n0,
        "median_s": float(np.median(_time_step(exe0, params, batch, args.sweep_repeats))),
    }
    # 1b. what a user gets by default: XLA:CPU's combiner on (one all-reduce for all gradients).
    step_d, _ = make_dp_step(loss_fn, mesh, "dp", 0, params)
    exe_d = compile_dp_step(step_d, params, batch, disable_combiner=False)
    _time_step(exe_d, params, batch, 2)
    report["xla_default"] = {
        "all_reduces": count_all_reduces(exe_d.as_text()),
        "median_s": float(np.median(_time_step(exe_d, params, batch, args.sweep_repeats))),
    }
    # 2. online tuning inside a training loop.
    space = SearchSpace(resources=(IntGrid("bucket_bytes", BUCKET_SPACE_GRID, default=0),))
    events = []
    tuner = OnlineTuner(
        space,
        Signature(
            "grad-buckets", int(total_bytes), f"{args.num_processes}proc x {args.devices}dev"
        ),
        TunerOptions(
            warmup_steps=1,
            repeats=args.repeats,
            search=SearchOptions(min_rel_improvement=args.min_rel_improvement),
        ),
        progress=lambda e: events.append([e.step, e.phase, e.config["bucket_bytes"], e.time]),
    )
    p, t_start = params, time.perf_counter()
    steps = 0
    while not tuner.frozen and steps < 400:
        cfg = tuner.next_config()
        exe, _ = get(cfg["bucket_bytes"])
        t0 = time.perf_counter()
        p, loss = exe(p, batch)
        jax.block_until_ready((p, loss))
        tuner.report(time.perf_counter() - t0)
        steps += 1
    res = tuner.result
    report["tuning"] = {
        "chosen_bucket_bytes": res.config["bucket_bytes"],
        "chosen_time_s": res.time,
        "start_bucket_bytes": res.start_config["bucket_bytes"],
        "start_time_s": res.start_time,
        "evaluations": res.evaluations,
        "steps": res.steps,
        "wall_s": time.perf_counter() - t_start,
        "all_reduces": get(res.config["bucket_bytes"])[1],
        "events": events,
        "grid_size": len(BUCKET_SPACE_GRID),
    }
    # 3. exhaustive sweep (reference).
    if args.sweep:
        sweep = []
        for b in BUCKET_SPACE_GRID:
            exe, n_ar = get(b)
            _time_step(exe, params, batch, 1)
            sweep.append(
                {
                    "bucket_bytes": b,
                    "all_reduces": n_ar,
                    "median_s": float(
                        np.median(_time_step(exe, params, batch, args.sweep_repeats))
                    ),
                }
            )
        report["sweep"] = sweep
        # the tuned step and the default step again, interleaved (same machine load)
        exe_t = get(res.config["bucket_bytes"])[0]
        pairs = [
            (_time_step(exe_t, params, batch, 1)[0], _time_step(exe_d, params, batch, 1)[0])
            for _ in range(2 * args.sweep_repeats)
        ]
        report["interleaved"] = {
            "tuned_median_s": float(np.median([p[0] for p in pairs])),
            "xla_default_median_s": float(np.median([p[1] for p in pairs])),
        }

    # 4. same results between bucket sizes (3 steps from the same start).
    def run3(exe):
        q = params
        for _ in range(3):
            q, _ = exe(q, batch)
        return [np.asarray(x.addressable_data(0)) for x in q]

    a, b = run3(get(0)[0]), run3(get(res.config["bucket_bytes"])[0])
    report["max_abs_diff"] = float(max(np.max(np.abs(x - y)) for x, y in zip(a, b, strict=True)))
    report["bitwise_equal"] = all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    report["tuned_config"] = dict(Config(res.config))
    with open(f"{args.out}.p{jax.process_index()}", "w") as f:  # what each process ended up running
        json.dump({"tuned_config": report["tuned_config"], "tuning_steps": res.steps}, f)
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _main()
