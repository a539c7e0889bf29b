"""What real trainers put into a step, through both entry points with the passes on.

MaxText, Penzai and Hugging Face steps carry constructs our own models do not:
XLA metadata and must-fuse annotations (``jax.experimental.xla_metadata``), meshes
with Explicit axes, ring ``ppermute`` loops inside ``shard_map`` (collective matmul,
ring attention), Pallas kernels, cuDNN attention. Each is run here through
``optimize`` with ``decompose`` and ``schedule`` (results equal the step's within the
tolerance the passes declare, checked here and by the first-step check) and, where
it lowers for a GPU, through ``compile_for_target`` (compiled without a fallback).
Host callbacks, dropout keys, gradient accumulation and library custom calls are in
tests/test_robustness.py and tests/test_robustness_models.py.
"""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import xla_metadata
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
from concerto_jax.deviceless.compile import gpu_plugin_available
from concerto_jax.first_step import differences

NO_THRESHOLD_SEARCH = concerto_jax.DevicelessOptions(combine_thresholds=())
"""compile_for_target without its search over XLA's combine thresholds (one XLA compile each)."""

PASSES = ("decompose", "schedule")
needs_plugin = pytest.mark.skipif(not gpu_plugin_available(), reason="CUDA plugin not installed "
                                  "(python -m concerto_jax.deviceless.cuda_plugin install)")
# compile_for_target without the combine-threshold search: each case compiles the step a few
# times, not a dozen (the search has its own tests)
TARGET_OPTIONS = concerto_jax.Options(passes=PASSES, fallback=False, deviceless=NO_THRESHOLD_SEARCH)


def _mlp_step(mesh, annotate: str | None = None, explicit: bool = False):
    """A DP x TP MLP train step; ``annotate`` wraps its forward in XLA metadata."""
    ws1, ws2 = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None))
    xs, rep = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P())

    def forward(x, w1, w2):
        if explicit:  # Explicit axes: the contraction over the sharded dim says where its sum goes
            h = jax.nn.gelu(jnp.matmul(x, w1, out_sharding=P("dp", "tp")))
            return jnp.matmul(h, w2, out_sharding=P("dp", None))
        return jax.nn.gelu(x @ w1) @ w2

    def loss(params, x):
        if annotate == "context":
            with xla_metadata.set_xla_metadata(trainer_tag="mlp"):
                y = forward(x, *params)
        elif annotate == "must_fuse":
            y = xla_metadata.must_fuse_call(1)(forward)(x, *params)
        else:
            y = forward(x, *params)
        return jnp.mean(y ** 2)

    @partial(jax.jit, in_shardings=((ws1, ws2), xs), out_shardings=((ws1, ws2), rep), donate_argnums=(0,))
    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    def make_args(b=16, d=64, f=32):
        k = jax.random.split(jax.random.key(0), 3)
        return ((jax.device_put(jax.random.normal(k[0], (d, f)), ws1),
                 jax.device_put(jax.random.normal(k[1], (f, d)), ws2)),
                jax.device_put(jax.random.normal(k[2], (b, d)), xs))

    def abstract(b=512, d=1024, f=4096):
        return ((jax.ShapeDtypeStruct((d, f), jnp.float32, sharding=ws1),
                 jax.ShapeDtypeStruct((f, d), jnp.float32, sharding=ws2)),
                jax.ShapeDtypeStruct((b, d), jnp.float32, sharding=xs))

    return step, make_args, abstract


def _check_optimize(step, make_args):
    """``optimize`` with the passes on equals ``step`` within the declared tolerance; returns it."""
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=PASSES, fallback=False))
    got, ref = opt(*make_args()), step(*make_args())
    report = opt.report()
    assert report.optimized and report.executable == "recompiled", report.fallback_reason
    tolerance = max(r.tolerance for r in report.passes)
    assert not differences(ref, got, tolerance), differences(ref, got, tolerance)
    assert report.first_step_check.startswith("ran: outputs equal"), report.first_step_check
    return opt


def _cpu_mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)


@pytest.mark.parametrize(("annotate", "attribute"), [("context", "trainer_tag"), ("must_fuse", "MUST_FUSE")])
def test_xla_metadata_is_kept_on_what_the_passes_write(annotate, attribute):
    # MaxText tags calls with xla_metadata (must_fuse_call among them); the split and reordered
    # module we hand to XLA keeps the attributes on every piece of a split instruction. (A
    # free-form key through xla_metadata_call on a differentiated function does not reach the
    # post-SPMD module: XLA:CPU drops it, JAX's own executable of such a step has none either;
    # MUST_FUSE, the same call, does reach it.)
    step, make_args, _ = _mlp_step(_cpu_mesh(), annotate)
    opt = _check_optimize(step, make_args)
    captured, emitted = opt.hlo_texts()
    assert attribute in captured
    assert any(r.name == "decompose" and r.changed for r in opt.report().passes)
    assert emitted.count(attribute) > captured.count(attribute)  # the split pieces carry it too


def test_explicit_axes_mesh():
    mesh = _cpu_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        step, make_args, _ = _mlp_step(mesh, explicit=True)
        opt = _check_optimize(step, make_args)
    assert any(r.name == "decompose" and r.changed for r in opt.report().passes)


def test_ring_ppermute_collective_matmul():
    # a shard_map collective matmul (MaxText's and Flax's ring pattern): the gathered operand
    # travels around the ring by ppermute inside a fori_loop, one block matmul per hop
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    n = mesh.shape["tp"]

    def ring_matmul(x, w):
        i = jax.lax.axis_index("tp")

        def hop(k, carry):
            acc, block = carry
            acc = jax.lax.dynamic_update_slice_in_dim(acc, block @ w, ((i - k) % n) * block.shape[0], 0)
            return acc, jax.lax.ppermute(block, "tp", [(j, (j + 1) % n) for j in range(n)])

        acc = jnp.zeros((x.shape[0] * n, w.shape[1]), x.dtype)
        return jax.lax.fori_loop(0, n, hop, (acc, x))[0]

    f = jax.shard_map(ring_matmul, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                      out_specs=P(None, "tp"), check_vma=False)
    ws, xs = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None))

    @partial(jax.jit, in_shardings=(ws, xs), out_shardings=(ws, NamedSharding(mesh, P())))
    def step(w, x):
        value, g = jax.value_and_grad(lambda w: jnp.mean(f(x, w) ** 2))(w)
        return w - 0.1 * g, value

    def make_args():
        k = jax.random.split(jax.random.key(1))
        return (jax.device_put(jax.random.normal(k[0], (32, 64)), ws),
                jax.device_put(jax.random.normal(k[1], (16, 32)), xs))

    opt = _check_optimize(step, make_args)
    assert "collective-permute" in opt.hlo_texts()[0]


def _compile(step, abstract):
    return concerto_jax.compile_for_target(step, *abstract, target="h100_sxm_8", options=TARGET_OPTIONS)


@needs_plugin
@pytest.mark.parametrize("case", ["must_fuse", "explicit"])
def test_target_compile_of_annotated_and_explicit_steps(case):
    explicit = case == "explicit"
    mesh = concerto_jax.target_mesh("h100_sxm_8", (2, 4), ("dp", "tp"),
                                    axis_types=(AxisType.Explicit if explicit else AxisType.Auto,) * 2)
    with jax.set_mesh(mesh) if explicit else warnings.catch_warnings():
        step, _, abstract = _mlp_step(mesh, annotate=None if explicit else "must_fuse", explicit=explicit)
        res = _compile(step, abstract())
    assert res.fallback_reason is None and res.via == "backend_only"
    assert res.final_step_us <= res.stock_step_us
    if not explicit:
        assert "MUST_FUSE" in res.final_text  # XLA honoured the annotation on our module


@needs_plugin
def test_target_compile_of_a_pallas_kernel():
    from jax.experimental import pallas as pl

    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("dp",))

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * 2.0

    def pallas_tanh(x):
        block = pl.BlockSpec((64, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // 64,), in_specs=[block], out_specs=block)(x)

    xs, rep = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P())

    @partial(jax.jit, in_shardings=(rep, xs), out_shardings=(rep, rep))
    def step(w, x):
        h = jax.shard_map(pallas_tanh, mesh=mesh, in_specs=P("dp", None), out_specs=P("dp", None),
                          check_vma=False)(x @ w)
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, jnp.mean(h)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # JAX: Pallas' Triton backend
        res = _compile(step, (jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rep),
                              jax.ShapeDtypeStruct((8 * 512, 256), jnp.float32, sharding=xs)))
    assert res.fallback_reason is None and res.via == "backend_only"
    assert "__gpu$xla.gpu.triton" in res.final_text or "triton" in res.final_text.lower()


def _has_cudnn() -> bool:
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
    except Exception:  # noqa: BLE001 - any failure: no usable cuDNN here
        return False
    return True


@needs_plugin
@pytest.mark.skipif(_has_cudnn(), reason="cuDNN is installed here: JAX traces the kernel")
def test_cudnn_attention_without_cudnn_says_what_to_do():
    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("dp",))
    xs = NamedSharding(mesh, P("dp", None, None, None))

    @partial(jax.jit, in_shardings=(xs,), out_shardings=NamedSharding(mesh, P()))
    def step(q):
        return jnp.mean(jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))

    q = jax.ShapeDtypeStruct((8, 128, 4, 64), jnp.bfloat16, sharding=xs)
    with pytest.raises(RuntimeError, match="implementation=None or 'xla'"):
        _compile(step, (q,))


def test_target_mesh_axis_types_must_match_the_shape():
    if not gpu_plugin_available():
        pytest.skip("CUDA plugin not installed")
    with pytest.raises(ValueError, match="one jax.sharding.AxisType per axis"):
        concerto_jax.target_mesh("h100_sxm_8", (2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,))


def test_persistent_compilation_cache_does_not_hide_the_step(tmp_path):
    # MaxText turns JAX's persistent compilation cache on; a cache hit runs no XLA pass, so a
    # capture that read XLA's dumps found none and fell back. The capture compiles bypass it.
    from jax._src import compilation_cache

    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])  # JAX caches no multi-CPU program
    shard = NamedSharding(mesh, P("d"))

    @jax.jit
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    w = jax.device_put(jnp.ones((16, 16)) * 0.01, NamedSharding(mesh, P()))
    x = jax.device_put(jnp.arange(128.0).reshape(8, 16) / 128, shard)
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                  "jax_persistent_cache_min_compile_time_secs",
                                                  "jax_persistent_cache_min_entry_size_bytes")}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        compilation_cache.reset_cache()
        # the first optimize's compiles fill the cache (as a first training run would); the second
        # (a restarted run; no plan cache) compiles the same programs again
        options = concerto_jax.Options(passes=("schedule",), cache_dir=None)
        for _ in range(2):
            opt = concerto_jax.optimize(step, options)
            with warnings.catch_warnings():
                warnings.simplefilter("error", concerto_jax.ConcertoFallbackWarning)
                got = opt(w, x)
            assert opt.report().instructions > 0
            assert (got == step(w, x)).all()
        assert any(tmp_path.iterdir()), "the persistent cache wrote nothing: the case does not apply"
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
