"""Regenerates the HLO round-trip corpus in ``tests/data/hlo/``.

Two families of modules:

* ``cpu_<case>.hlo``: the per-device module after SPMD partitioning of a small
  jitted function on an 8-device CPU mesh (``xla_dump_hlo_pass_re=spmd-partitioning``);
* ``gpu_<case>.{final,before_lhs,after_lhs}.hlo``: XLA's scheduled GPU module
  from a deviceless compile for 8xH100 (``compiled.as_text()``) and the module
  just before/after the latency-hiding scheduler (docs/ARCHITECTURE.md F4).

Usage::

    python bench/make_hlo_corpus.py [--out tests/data/hlo] [--only NAME ...] [--no-gpu]

The GPU family needs ``jax-cuda13-plugin`` (the ``gpu`` extra); no GPU is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable

log = logging.getLogger("make_hlo_corpus")

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGET = REPO / "concerto_jax" / "gpu_configs" / "h100_sxm.txtpb"


@dataclasses.dataclass(frozen=True)
class Case:
    """One corpus module."""

    name: str  # file stem, e.g. "cpu_shard_map_collectives"
    build: Callable  # build(mesh_factory) -> (jitted function, example args)
    mesh_shape: tuple[int, ...]  # mesh shape over the 8 devices
    mesh_axes: tuple[str, ...]  # mesh axis names
    platform: str = "cpu"  # "cpu": post-SPMD dump; "gpu": deviceless H100 compile
    doc: str = ""  # what it covers


# --------------------------------------------------------------------------- cases

def _sharding(mesh, *spec):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*spec))


def _arg(mesh, shape, *spec, dtype=None, abstract=False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = dtype or jnp.float32
    sharding = _sharding(mesh, *spec)
    if abstract:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    rng = np.random.default_rng(sum(shape))
    return jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), sharding)


def build_jit_1d(mesh, abstract=False):
    import jax
    import jax.numpy as jnp

    def f(x, w):
        return jnp.tanh(x @ w).sum(0)

    args = (_arg(mesh, (16, 32), "x", None, abstract=abstract),
            _arg(mesh, (32, 64), None, None, abstract=abstract))
    return jax.jit(f, out_shardings=_sharding(mesh)), args


def build_jit_2d_tuples(mesh, abstract=False):
    import jax
    import jax.numpy as jnp

    def f(x, w1, w2):
        h = jax.nn.relu(x @ w1)
        y = h @ w2
        return {"y": y, "stats": (y.mean(), (h.max(), jnp.argmax(y, axis=-1)))}

    args = (_arg(mesh, (8, 32), "dp", None, abstract=abstract),
            _arg(mesh, (32, 64), None, "tp", abstract=abstract),
            _arg(mesh, (64, 32), "tp", None, abstract=abstract))
    return jax.jit(f, in_shardings=tuple(a.sharding for a in args)), args


def build_shard_map_collectives(mesh, abstract=False):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["x"]

    def body(x):
        s = lax.psum(x, "x")
        g = lax.all_gather(x, "x", tiled=True)
        rs = lax.psum_scatter(g, "x", scatter_dimension=0, tiled=True)
        a2a = lax.all_to_all(x, "x", split_axis=1, concat_axis=0, tiled=True)
        pp = lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)])
        return s + rs + pp, a2a, lax.pmax(x, "x")

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"), P("x")))
    return jax.jit(f), (_arg(mesh, (8 * n, 16), "x", None, abstract=abstract),)


def build_shard_map_2d(mesh, abstract=False):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x, w):
        y = x @ w
        z = lax.psum_scatter(y, ("dp", "tp"), scatter_dimension=1, tiled=True)
        g = lax.all_gather(lax.psum(y, "tp"), "dp", axis=0, tiled=True)
        return z, g

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                      out_specs=(P(None, ("dp", "tp")), P("dp")), check_vma=False)
    return jax.jit(f), (_arg(mesh, (8, 32), "dp", "tp", abstract=abstract),
                        _arg(mesh, (32, 64), "tp", None, abstract=abstract))


def build_scan_while_cond(mesh, abstract=False):
    import jax
    import jax.numpy as jnp
    from jax import lax

    def f(x, w):
        def step(c, wi):
            c = jnp.tanh(c @ wi)
            return c, c.sum()

        c, sums = lax.scan(step, x, w)
        i, c = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, c * 0.5 + s[1]),
                              (0, c))
        out = lax.cond(sums.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, c)
        return out, sums, i

    args = (_arg(mesh, (16, 32), "x", None, abstract=abstract),
            _arg(mesh, (3, 32, 32), None, None, "x", abstract=abstract))
    return jax.jit(f), args


def build_mlp_train_step(mesh, abstract=False):
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adam(1e-2)

    def loss(params, x, y):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = {"w1": _arg(mesh, (32, 64), None, "tp", abstract=abstract),
              "b1": _arg(mesh, (64,), "tp", abstract=abstract),
              "w2": _arg(mesh, (64, 16), "tp", None, abstract=abstract)}
    if abstract:  # optimizer state replicated (the CPU case lets jit choose)
        opt_state = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_sharding(mesh)),
            jax.eval_shape(opt.init, params))
    else:
        opt_state = jax.jit(opt.init)(params)
    x = _arg(mesh, (16, 32), "dp", None, abstract=abstract)
    y = _arg(mesh, (16, 16), "dp", None, abstract=abstract)
    return jax.jit(step, donate_argnums=(0, 1)), (params, opt_state, x, y)


def build_transformer_block(mesh, abstract=False):
    import jax
    import jax.numpy as jnp

    heads, dh = 8, 16
    d = heads * dh

    def block(p, x):
        def ln(v):
            mu = v.mean(-1, keepdims=True)
            return (v - mu) * jax.lax.rsqrt(((v - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

        b, s, _ = x.shape
        qkv = ln(x) @ p["wqkv"]
        q, k, v = jnp.split(qkv.reshape(b, s, 3, heads, dh), 3, axis=2)
        att = jnp.einsum("bsqhd,btqhd->bhst", q, k) / jnp.sqrt(dh)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        o = jnp.einsum("bhst,btqhd->bshd", jax.nn.softmax(att, -1), v).reshape(b, s, d)
        x = x + o @ p["wo"]
        return x + jax.nn.gelu(ln(x) @ p["w1"]) @ p["w2"]

    def loss(p, x):
        return (block(p, x) ** 2).mean()

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)

    p = {"wqkv": _arg(mesh, (d, 3 * d), None, "tp", abstract=abstract),
         "wo": _arg(mesh, (d, d), "tp", None, abstract=abstract),
         "w1": _arg(mesh, (d, 4 * d), None, "tp", abstract=abstract),
         "w2": _arg(mesh, (4 * d, d), "tp", None, abstract=abstract)}
    x = _arg(mesh, (4, 32, d), "dp", None, None, abstract=abstract)
    return jax.jit(step), (p, x)


CASES: tuple[Case, ...] = (
    Case("cpu_jit_1d", build_jit_1d, (8,), ("x",),
         doc="jit on a 1-D mesh, replicated output: all-reduce"),
    Case("cpu_jit_2d_tuples", build_jit_2d_tuples, (2, 4), ("dp", "tp"),
         doc="jit with in_shardings on a 2-D mesh, nested tuple outputs, argmax"),
    Case("cpu_shard_map_collectives", build_shard_map_collectives, (8,), ("x",),
         doc="shard_map: psum, all_gather, psum_scatter, all_to_all, ppermute, pmax"),
    Case("cpu_shard_map_2d", build_shard_map_2d, (2, 4), ("dp", "tp"),
         doc="shard_map on a 2-D mesh: collectives over one axis and over both"),
    Case("cpu_scan_while_cond", build_scan_while_cond, (8,), ("x",),
         doc="lax.scan, lax.while_loop and lax.cond on sharded data"),
    Case("cpu_mlp_train_step", build_mlp_train_step, (2, 4), ("dp", "tp"),
         doc="value_and_grad of an MLP plus an optax Adam update, dp x tp, donation"),
    Case("cpu_transformer_block", build_transformer_block, (2, 4), ("dp", "tp"),
         doc="grad step of a Megatron-style transformer block, dp x tp"),
    Case("gpu_mlp_train_step", build_mlp_train_step, (2, 4), ("dp", "tp"), "gpu",
         doc="deviceless H100x8 compile of the MLP train step"),
    Case("gpu_transformer_block", build_transformer_block, (2, 4), ("dp", "tp"), "gpu",
         doc="deviceless H100x8 compile of the transformer block grad step"),
    Case("gpu_shard_map_collectives", build_shard_map_collectives, (8,), ("x",), "gpu",
         doc="deviceless compile of every collective kind: generic async wrappers"),
)


# ----------------------------------------------------------------------- capture

def _read(pattern: str) -> str:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"XLA wrote no dump matching {pattern}")
    return pathlib.Path(files[0]).read_text()


def capture_cpu(case: Case) -> dict[str, str]:
    """The post-SPMD module of a case on the 8-device CPU mesh."""
    import jax

    mesh = jax.make_mesh(case.mesh_shape, case.mesh_axes,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(case.mesh_shape))
    fn, args = case.build(mesh)
    with tempfile.TemporaryDirectory() as d:
        fn.lower(*args).compile(compiler_options={
            "xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        return {"": _read(os.path.join(d, "*after_spmd-partitioning*.txt"))}


def capture_gpu(case: Case) -> dict[str, str]:
    """Final, before-LHS and after-LHS modules of a deviceless H100x8 compile."""
    from jax.experimental import topologies

    from concerto_jax.deviceless import require_gpu_plugin

    require_gpu_plugin()  # registers the CUDA plugin where it lives (site-packages or private)
    topo = topologies.get_topology_desc(
        platform="cuda", topology_name="h100x8", topology="1x1x8",
        target_config=TARGET.read_text())
    mesh = topologies.make_mesh(topo, case.mesh_shape, case.mesh_axes)
    fn, args = case.build(mesh, abstract=True)
    with tempfile.TemporaryDirectory() as d:
        compiled = fn.trace(*args).lower().compile(compiler_options={
            "xla_dump_to": d, "xla_dump_hlo_pass_re": "latency-hiding-scheduler"})
        return {
            ".final": compiled.as_text(),
            ".before_lhs": _read(os.path.join(d, "*before_latency-hiding-scheduler.txt")),
            ".after_lhs": _read(os.path.join(d, "*after_latency-hiding-scheduler*.txt")),
        }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "hlo"))
    parser.add_argument("--only", nargs="*", help="case names to regenerate")
    parser.add_argument("--no-gpu", action="store_true", help="skip the deviceless GPU cases")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    out = pathlib.Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if opts.only and case.name not in opts.only:
            continue
        if case.platform == "gpu" and opts.no_gpu:
            continue
        texts = capture_cpu(case) if case.platform == "cpu" else capture_gpu(case)
        for suffix, text in texts.items():
            path = out / f"{case.name}{suffix}.hlo"
            path.write_text(text)
            log.info("%-45s %7d bytes  %s", path.name, len(text), case.doc)


if __name__ == "__main__":
    main()
