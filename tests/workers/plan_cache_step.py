"""Worker of tests/test_plan_cache.py: optimize a small DP x TP step with a given plan cache, in
one process (``--cache-dir``) or in each of several (``launch.run_local``: ``--cache-dir`` gets
``/p<process>`` appended, so that what each process reads and writes can be seen).

Prints one JSON line: whether the step was optimised, whether its outputs equal the original's
(bitwise, every shard), the stage times (``plan_cache`` on a hit), the plan's digest, warnings."""

import argparse
import hashlib
import json
import os
import sys
import warnings
from functools import partial


def make_step(rows: int = 16, devices=None, **jit_kwargs):
    """The step and its arguments on a 2 x 4 DP x TP mesh (``devices``: its devices, in order;
    default the first 8); ``rows`` of the weight; ``jit_kwargs`` go to ``jax.jit``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)
    ws = NamedSharding(mesh, P(None, "tp"))
    xs = NamedSharding(mesh, P("dp", None))

    @partial(jax.jit, in_shardings=(ws, xs), out_shardings=(ws, NamedSharding(mesh, P())),
             **jit_kwargs)
    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.tanh(x @ w) ** 2)
        v, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, v

    w = jax.make_array_from_callback(
        (rows, 32), ws, lambda idx: np.arange(rows * 32, dtype=np.float32).reshape(rows, 32)[idx] / 512)
    x = jax.make_array_from_callback(
        (8, rows), xs, lambda idx: np.cos(np.arange(8 * rows, dtype=np.float32)).reshape(8, rows)[idx])
    return step, (w, x)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--process-id", type=int, default=-1)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    cache_dir = args.cache_dir
    if args.process_id >= 0:
        from concerto_jax.launch import init_worker

        init_worker(args.process_id, args.num_processes, args.port, devices_per_process=4)
        cache_dir = os.path.join(cache_dir, f"p{args.process_id}")
    else:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
    import jax
    import numpy as np

    import concerto_jax

    step, operands = make_step()
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), cache_dir=cache_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(*operands)
    want = step(*operands)
    equal = all(
        np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True))
    rep = opt.report()
    print(json.dumps({
        "process": jax.process_index(), "optimized": rep.optimized,
        "fallback_reason": rep.fallback_reason, "equal": bool(equal),
        "stage_seconds": sorted(rep.stage_seconds),
        "plan_digest": hashlib.sha256(opt.hlo_texts()[1].encode()).hexdigest(),
        "warnings": [f"{c.category.__name__}: {str(c.message)[:300]}" for c in caught]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
