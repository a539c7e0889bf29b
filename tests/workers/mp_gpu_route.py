"""Worker of tests/test_gpu_route.py's multi-process tests: the GPU route rehearsed on CPU
devices (2 processes x 4), one stage optionally broken in one process."""

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
    ap.add_argument("--break-stage", default="", help="make this stage fail ...")
    ap.add_argument("--break-on", type=int, default=-1, help="... in this process")
    ap.add_argument("--cache-dir", default=None, help="the plan cache (default: off)")
    args = ap.parse_args()
    from concerto_jax.launch import init_worker

    init_worker(args.process_id, args.num_processes, args.port, devices_per_process=4)
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import concerto_jax
    from concerto_jax.gpu_route import route

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
        def boom(*a, **k):
            raise RuntimeError(f"synthetic failure at {args.break_stage} in this process")
        attr = {"plan": "plan", "backend_compile": "compile", "target_config": "target"}[args.break_stage]
        setattr(route.CpuRehearsal, attr, boom)

    with route.rehearse():
        opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), cache_dir=args.cache_dir))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = opt(w, x)
    want = step(w, x)
    equal = all(
        np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True))
    rep = opt.report()
    _, handed = opt.hlo_texts()
    print(json.dumps({
        "process": jax.process_index(), "optimized": rep.optimized, "executable": rep.executable,
        "fallback_reason": rep.fallback_reason, "equal": bool(equal),
        "warnings": [str(c.message)[:300] for c in caught],
        "handed_digest": hashlib.sha256((handed or "").encode()).hexdigest(),
        "stages": sorted(rep.stage_seconds or {}),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
