"""Worker of tests/test_multiprocess_optimize.py: optimize a DP x TP step in one of 2 processes."""

import argparse
import hashlib
import json
import sys
from functools import partial


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--break-on", type=int, default=-1, help="make this process's passes fail")
    args = ap.parse_args()
    from concerto_jax.launch import init_worker

    init_worker(args.process_id, args.num_processes, args.port, devices_per_process=4)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import concerto_jax
    from hlo_passes.registry import PASSES

    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ws = NamedSharding(mesh, P(None, "tp"))
    xs = NamedSharding(mesh, P("dp", None))

    @partial(jax.jit, in_shardings=(ws, xs), out_shardings=(ws, NamedSharding(mesh, P())))
    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.tanh(x @ w) ** 2)
        v, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, v

    w = jax.make_array_from_callback((16, 32), ws, lambda idx: np.arange(512, dtype=np.float32).reshape(16, 32)[idx] / 512)
    x = jax.make_array_from_callback((8, 16), xs, lambda idx: np.cos(np.arange(128, dtype=np.float32)).reshape(8, 16)[idx])

    if args.break_on == jax.process_index():
        def broken(module, options):
            raise RuntimeError("synthetic failure in this process")
        PASSES["schedule"] = broken

    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",)))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(w, x)
    want = step(w, x)
    equal = all(
        np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True))
    rep = opt.report()
    sched = [p for p in rep.passes if p.name == "schedule"]
    print(json.dumps({
        "process": jax.process_index(),
        "optimized": rep.optimized,
        "fallback_reason": rep.fallback_reason,
        "equal": bool(equal),
        "stats": sched[0].stats if sched else None,
        "warnings": [str(c.message)[:200] for c in caught],
        "plan_digest": hashlib.sha256(json.dumps(sched[0].stats if sched else None,
                                                 sort_keys=True).encode()).hexdigest(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
