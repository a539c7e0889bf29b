"""Helpers shared by several test modules (import as ``from tests._helpers import ...``).

* ``FULL_SWEEP`` (``CONCERTO_FULL_SWEEP=1``): run every model x layout (and other long
  parametrisations) instead of the default subsets; implies ``FULL_SCAN_MATRIX``.
* ``FULL_SCAN_MATRIX`` (``CONCERTO_FULL_SCAN_MATRIX=1``): every scanned model x layout in
  tests/test_loops_optimize.py.
* ``FAST``: XLA options that compile tiny train steps quickly (LLVM -O0; the HLO passes,
  SPMD partitioning included, are unchanged). Both sides of a bitwise comparison must
  use the same options.
* ``NO_COMBINER``: XLA:CPU's own all-reduce combiner off.
* ``tree_diff`` / ``assert_tree_bitwise``: bitwise comparison of two pytrees of arrays
  (tree structure, dtype, shape, sharding, values; typed PRNG keys compared through their
  key data: raw bytes by default, or values with NaNs equal where both are NaN with ``exact=False``).
* ``dp_mlp_step``: a data-parallel MLP train step on the 8-device CPU mesh with one
  gradient all-reduce per layer.
* ``run_bitwise_steps``: run a compiled reference and an optimised step side by side.
* ``collective_issues``: the collectives an XLA module issues, whatever form it prints them
  in (XLA >= 0.11 prints small all-reduces as Triton collective kernel fusions).
"""

from __future__ import annotations

import json
import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from concerto_jax.options import OptimizeOptions

FULL_SWEEP = os.environ.get("CONCERTO_FULL_SWEEP") == "1"
FULL_SCAN_MATRIX = FULL_SWEEP or os.environ.get("CONCERTO_FULL_SCAN_MATRIX") == "1"
FAST = {"xla_backend_optimization_level": 0}
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
ALWAYS_RECOMPILE = OptimizeOptions(always_recompile=True)
"""``optimize`` recompiles even an unchanged module (our recompile path under test)."""
ALWAYS_RECOMPILE_CHECKED = OptimizeOptions(always_recompile=True, check_first_step=True)
ALWAYS_RECOMPILE_UNCHECKED = OptimizeOptions(always_recompile=True, check_first_step=False)


def bits(x) -> np.ndarray:
    """The array's values as numpy (typed PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def tree_diff(a, b, *, sharding: bool = True, exact: bool = True) -> list[str]:
    """What differs between two pytrees: structure, dtype, shape, sharding (optional), bits.

    Args:
      a: A pytree of arrays (jax or numpy; numpy leaves need ``sharding=False``).
      b: A pytree of arrays.
      sharding: Also compare each leaf's ``.sharding``.
      exact: Compare the raw bytes (the default: "bitwise" means it), so that -0.0 != 0.0 and
        NaN payloads count; ``exact=False`` compares values (``np.array_equal(...,
        equal_nan=True)``).

    Returns:
      One line per differing leaf (empty when the trees are bitwise equal).
    """
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return [f"tree structure differs: {ta} vs {tb}"]
    bad = []
    for (path, x), y in zip(la, lb, strict=True):
        where = jax.tree_util.keystr(path)
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(f"{where}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif sharding and x.sharding != y.sharding:
            bad.append(f"{where}: sharding {x.sharding} vs {y.sharding}")
        elif exact and bits(x).tobytes() != bits(y).tobytes():
            bad.append(f"{where}: values differ (bytes)")
        elif not exact and not np.array_equal(bits(x), bits(y), equal_nan=True):
            bad.append(f"{where}: values differ")
    return bad


def assert_tree_bitwise(a, b, *, sharding: bool = True, exact: bool = True,
                        what: str = "") -> None:
    """Fail with the first differing leaves unless ``a`` and ``b`` are bitwise equal
    (arguments as :func:`tree_diff`; ``what`` prefixes the message)."""
    bad = tree_diff(a, b, sharding=sharding, exact=exact)
    assert not bad, f"{what}{': ' if what else ''}{len(bad)} leaves differ: {bad[:5]}"


def run_bitwise_steps(reference, step, case, steps: int, *, sharding: bool = True,
                      tolerance: float = 0.0) -> None:
    """``steps`` train steps of a models.Case through ``reference`` and ``step`` from the same
    initial state; the states and metrics must be bitwise equal after every step, or, with
    ``tolerance`` > 0, equal within it as the first-step check compares (relative to each
    leaf's largest magnitude: ``concerto_jax.first_step.differences``)."""
    from concerto_jax.first_step import differences

    ref, opt = case.init_state(0), case.init_state(0)
    for i in range(steps):
        ref, ref_metrics = reference(ref, case.batch)
        opt, opt_metrics = step(opt, case.batch)
        if tolerance > 0:
            bad = differences((ref, ref_metrics), (opt, opt_metrics), tolerance)
            assert not bad, f"step {i}: {bad}"
        else:
            assert_tree_bitwise((opt, opt_metrics), (ref, ref_metrics), sharding=sharding,
                                what=f"step {i}")


def dp_mlp_step(layers: int = 4, batch: int = 32):
    """A data-parallel tanh MLP train step on 8 CPU devices: one gradient all-reduce per layer.

    Returns:
      ``(step, ws, x)``: the jitted step, replicated weights (64 x 64 each), the sharded batch.
    """
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    @partial(jax.jit, in_shardings=(rep, dat), out_shardings=(rep, rep))
    def step(ws, x):
        v, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g, strict=True)], v

    ks = jax.random.split(jax.random.key(0), layers + 1)
    ws = [jax.device_put(jax.random.normal(k, (64, 64)) * 0.1, rep) for k in ks[:layers]]
    x = jax.device_put(jax.random.normal(ks[-1], (batch, 64)), dat)
    return step, ws, x


def collective_issues(text: str, kind: str | None = None, computation: str | None = None) -> list[tuple]:
    """``(instruction, collective op, is_async)`` for every collective the module ``text``
    issues (of ``kind`` if given; in ``computation`` if given, else in every computation that
    runs as a sequence of ops: ``hlo_passes.ir.loops.schedulable_computations``): a synchronous collective, the start of an async
    pair (sugared ``all-reduce-start`` or generic ``async-start``), or a collective kernel
    fusion (XLA >= 0.11 makes small all-reduces Triton kernels: a ``fusion`` whose root is the
    all-reduce, run synchronously, as ``fusion-start``/``fusion-done``, or wrapped in an
    ``async-start``). The collective op carries the replica groups and the payload's shape."""
    import hlo_passes
    from hlo_passes.ir.loops import schedulable_computations

    module = hlo_passes.parse_module(text)
    # not the computations a wrapper runs (async bodies, fused computations): their ops are
    # counted through the wrapper
    comps = [module.computation(computation)] if computation else schedulable_computations(module)
    out = []
    for comp in comps:
        for inst in comp.instructions:
            k = inst.collective_kind
            if k is None or inst.async_role in ("done", "update") or (kind is not None and k != kind):
                continue
            out.append((inst, inst.collective_op, inst.async_role == "start"))
    return out


def scanned_target_step(target: str = "h100_sxm_8"):
    """``(step, abstract args)``: a 3-layer scanned bf16 MLP, tensor-parallel over 8 devices of
    ``concerto_jax.target_mesh(target, ...)`` (a loop body with collectives, for the deviceless
    compile)."""
    import concerto_jax  # lazy: like the other helpers here, the package is imported where used

    mesh = concerto_jax.target_mesh(target, (8,), ("m",))
    col, row = NamedSharding(mesh, P(None, None, "m")), NamedSharding(mesh, P(None, "m", None))

    def loss(params, x):
        def layer(h, w):
            return h + jnp.tanh(h @ w[0]) @ w[1], None

        return jnp.mean(jax.lax.scan(layer, x, params)[0].astype(jnp.float32) ** 2)

    @partial(jax.jit, out_shardings=((col, row), NamedSharding(mesh, P())))
    def step(params, x):
        v, g = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, q: p - 0.1 * q, params, g), v

    def sd(shape, sh):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)

    return step, [(sd((3, 512, 2048), col), sd((3, 2048, 512), row)), sd((1024, 512), NamedSharding(mesh, P()))]


_DEFAULT_EMITTER_CONFIG = {"operation_queue_id": "0", "force_earliest_schedule": False, "reification_cost": [],
                           "device_type": "DEVICE_TYPE_INVALID",
                           "native_emitter_backend_config": {"type": "NATIVE_EMITTER_TYPE_INVALID", "unroll_factor": 0}}


def without_default_emitter_configs(text: str) -> str:
    """``text`` without what XLA's generic-fusion autotuner writes on a deviceless target and
    nothing else reads: each ``backend_config`` loses the fields at their default values (the
    default emitter config, ``NATIVE_EMITTER_TYPE_INVALID`` with unroll 0, and the defaults
    written beside it; an emptied one goes), and the module's ``fingerprint_before_lhs`` (a
    hash of the text) goes. Two compiles that differ only in running that autotuner give the
    same result (``concerto_jax.jax_compat.deviceless_own_compile_options``)."""
    out = []
    for line in text.splitlines():
        line = re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', "", line)
        start = line.find(", backend_config={")
        if start >= 0:
            i = start + len(", backend_config=")
            depth, j = 0, i
            for j in range(i, len(line)):  # the JSON object's end (strings hold no braces here)
                depth += {"{": 1, "}": -1}.get(line[j], 0)
                if depth == 0:
                    break
            config = {k: v for k, v in json.loads(line[i:j + 1]).items()
                      if _DEFAULT_EMITTER_CONFIG.get(k, object()) != v}
            kept = f", backend_config={json.dumps(config, sort_keys=True, separators=(',', ':'))}" if config else ""
            line = line[:start] + kept + line[j + 1:]
        out.append(line)
    return "\n".join(out)
