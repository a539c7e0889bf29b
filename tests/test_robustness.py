"""Never a crash, never a different number: host callbacks, custom calls, typed PRNG keys, first-step check.

Every test runs both paths of ``optimize``: the identity pipeline (default
options: JAX's own executable runs) and the recompiled post-SPMD module
(``always_recompile=True``, the path every changing pass takes).
"""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax import capture as capture_lib
from concerto_jax import first_step
from concerto_jax.custom_calls import UnsupportedCustomCall, check_carryable, custom_calls
from hlo_passes.registry import PASSES, PassOutcome
from tests._helpers import (
    ALWAYS_RECOMPILE,
    ALWAYS_RECOMPILE_CHECKED,
    ALWAYS_RECOMPILE_UNCHECKED,
    assert_tree_bitwise,
)

IDENTITY = concerto_jax.Options(fallback=False)
RECOMPILE = concerto_jax.Options(fallback=False,
                                 optimize=ALWAYS_RECOMPILE_UNCHECKED)
PATHS = {"identity": IDENTITY, "recompile": RECOMPILE}


def _mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


# -- host callbacks ------------------------------------------------------------------
def _callback_step(mesh, kind, log):
    """A DP x TP train step of an MLP that calls back to the host in one of several ways."""
    xs = NamedSharding(mesh, P("dp", None))
    ws = NamedSharding(mesh, P(None, "tp"))
    rep = NamedSharding(mesh, P())

    def record(tag):
        def cb(*vals):
            log.append((tag, *(np.asarray(v).tolist() for v in vals)))
        return cb

    def loss(w, x):
        h = jnp.tanh(x @ w)
        value = jnp.mean(h ** 2)
        s = jax.lax.stop_gradient(value)
        if kind == "debug_print":
            jax.debug.print("loss {l}", l=s)
        elif kind == "debug_callback":
            jax.debug.callback(record("dbg"), s)
        elif kind == "debug_callback_partitioned":  # runs on every device (partitioned FFI target)
            jax.debug.callback(record("part"), s, partitioned=True)
        elif kind == "pure_callback":
            extra = jax.pure_callback(lambda v: (np.float32(0.5) * v).astype(np.float32),
                                      jax.ShapeDtypeStruct((), jnp.float32), s)
            value = value + jax.lax.stop_gradient(extra)
        elif kind == "io_callback":
            jax.experimental.io_callback(record("io"), None, s, ordered=False)
        elif kind == "io_callback_ordered":
            jax.experimental.io_callback(record("io1"), None, s, ordered=True)
            jax.experimental.io_callback(record("io2"), None, s + 1, ordered=True)
        return value

    @partial(jax.jit, in_shardings=(ws, xs), out_shardings=(ws, rep), donate_argnums=(0,))
    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, value

    def make_args(seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return (jax.device_put(jax.random.normal(k1, (16, 32)), ws),
                jax.device_put(jax.random.normal(k2, (8, 16)), xs))

    return step, make_args


# (Ordered jax.debug effects are refused by JAX itself on more than one device.)
CALLBACK_KINDS = ["debug_print", "debug_callback", "debug_callback_partitioned", "pure_callback",
                  "io_callback", "io_callback_ordered"]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kind", CALLBACK_KINDS)
def test_host_callbacks_fire_in_order_with_same_values(kind, path, capfd):
    # Before the fix the recompiled module called host callback #0 of an empty list: SIGSEGV.
    mesh = _mesh()
    log_ref, log_opt = [], []
    ref_step, make_args = _callback_step(mesh, kind, log_ref)
    opt_src, _ = _callback_step(mesh, kind, log_opt)
    opt = concerto_jax.optimize(opt_src, PATHS[path])
    w_ref, x = make_args(0)
    w_opt, _ = make_args(0)
    for _ in range(3):
        w_ref, v_ref = ref_step(w_ref, x)
        jax.effects_barrier()
        printed_ref = capfd.readouterr().out
        w_opt, v_opt = opt(w_opt, x)
        jax.effects_barrier()
        printed_opt = capfd.readouterr().out
        assert_tree_bitwise((w_opt, v_opt), (w_ref, v_ref))
        assert printed_opt == printed_ref
    assert sorted(log_opt) == sorted(log_ref)
    if kind != "debug_callback_partitioned":  # one device per call: order is defined
        assert log_opt == log_ref
    if kind in ("debug_print",):
        assert printed_ref.startswith("loss ")
    elif kind != "pure_callback":
        assert len(log_ref) >= 3, log_ref
    rep = opt.report()
    assert rep.optimized and rep.executable == ("original" if path == "identity" else "recompiled")


def test_lost_host_callbacks_fall_back_instead_of_crashing(monkeypatch):
    # A module whose callback custom call indexes past the callbacks handed to XLA must be
    # refused before compiling (it would be a segmentation fault at run time).
    monkeypatch.setattr(capture_lib.Capture, "host_callbacks", property(lambda self: ()))
    mesh = _mesh()
    log = []
    step, make_args = _callback_step(mesh, "io_callback", log)
    opt = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE))
    with pytest.warns(concerto_jax.ConcertoFallbackWarning, match="UnsupportedCustomCall"):
        w, v = opt(*make_args(0))
    jax.effects_barrier()
    assert not opt.report().optimized and len(log) == 1
    strict = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE, fallback=False))
    with pytest.raises(UnsupportedCustomCall, match="callback #0"):
        strict(*make_args(0))


_CUSTOM_CALL_MODULE = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %cc = f32[4]{0} custom-call(%p), custom_call_target="%s", api_version=API_VERSION_TYPED_FFI, backend_config={index = 3 : ui64}
}
"""


def test_custom_call_rules():
    def module(target):
        return hlo_passes.parse_module(_CUSTOM_CALL_MODULE.replace("%s", target))

    (info,) = custom_calls(module("xla_ffi_python_cpu_callback"))
    assert info.target == "xla_ffi_python_cpu_callback" and info.callback_index == 3
    assert check_carryable(module("xla_ffi_python_cpu_callback"), n_callbacks=4, platform="cpu") == 1
    with pytest.raises(UnsupportedCustomCall, match="callback #3"):
        check_carryable(module("xla_ffi_python_cpu_callback"), n_callbacks=3, platform="cpu")
    with pytest.raises(UnsupportedCustomCall, match="host pointer"):
        check_carryable(module("xla_python_cpu_callback"), n_callbacks=9, platform="cpu")
    with pytest.raises(UnsupportedCustomCall, match="not registered"):
        check_carryable(module("my_unregistered_kernel"), n_callbacks=0, platform="cpu")
    jnp.linalg.cholesky(jnp.eye(2))  # registers JAX's LAPACK kernels
    assert check_carryable(module("lapack_spotrf_ffi"), n_callbacks=0, platform="cpu") == 1


@pytest.mark.parametrize("path", sorted(PATHS))
def test_library_custom_calls_are_carried(path):
    # LAPACK custom calls (Cholesky, eigh) inside a sharded step: registered targets compile again.
    mesh = _mesh()
    xs = NamedSharding(mesh, P("dp", None))

    @partial(jax.jit, in_shardings=(xs,), out_shardings=NamedSharding(mesh, P()))
    def step(x):
        g = x.T @ x + 16 * jnp.eye(16)
        return jnp.linalg.cholesky(g).sum() + jnp.linalg.eigh(g)[0].sum()

    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 16)), xs)
    opt = concerto_jax.optimize(step, PATHS[path])
    assert_tree_bitwise(opt(x), step(x))
    captured, _ = opt.hlo_texts()
    targets = {c.target for c in custom_calls(hlo_passes.parse_module(captured))}
    assert any(t.startswith("lapack_") for t in targets), targets


# -- typed PRNG keys -----------------------------------------------------------------
def _dropout_step(mesh, impl):
    xs = NamedSharding(mesh, P("dp", None))
    ws = NamedSharding(mesh, P(None, "tp"))
    rep = NamedSharding(mesh, P())

    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.mean(jnp.where(keep, h / 0.8, 0.0) ** 2)

    @partial(jax.jit, in_shardings=(ws, xs, rep), out_shardings=(ws, rep, rep),
             donate_argnums=(0, 2))
    def step(w, x, key):
        key, sub = jax.random.split(key)
        value, g = jax.value_and_grad(loss)(w, x, sub)
        return w - 0.1 * g, value, key

    def make_args():
        return (jax.device_put(jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), ws),
                jax.device_put(jnp.ones((8, 16)), xs),
                jax.device_put(jax.random.key(0, impl=impl), rep))

    return step, make_args


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_key_arguments_results_and_donation(impl, path):
    # Before the fix: AttributeError 'PRNGKeyArray' has no attribute 'weak_type' (even with fallback).
    mesh = _mesh()
    step, make_args = _dropout_step(mesh, impl)
    opt = concerto_jax.optimize(step, PATHS[path])
    ref, got = make_args(), make_args()
    for i in range(3):
        ref_donated, donated = ref[2], got[2]
        ref = step(*ref)
        got = opt(*got)
        # jaxlib 0.11 keeps a CPU buffer read back to the host (assert_tree_bitwise below),
        # for plain jit as well: the same consumption as the original's is the contract
        assert donated.is_deleted() == ref_donated.is_deleted(), \
            "the donated key must be consumed like the original's"
        assert i > 0 or donated.is_deleted(), "a fresh donated key must be consumed"
        assert_tree_bitwise(got, ref)
        assert got[2].dtype == ref[2].dtype
        assert str(jax.random.key_impl(got[2])) == str(jax.random.key_impl(ref[2])) == impl
        ref = (ref[0], make_args()[1], ref[2])
        got = (got[0], make_args()[1], got[2])
    assert opt.report().optimized and len(opt.reports()) == 1


def test_default_prng_impl_config_keys():
    mesh = _mesh()
    with jax.default_prng_impl("rbg"):
        step, make_args = _dropout_step(mesh, None)
        args = make_args()
    assert "rbg" in str(args[2].dtype)
    opt = concerto_jax.optimize(step, RECOMPILE)
    assert_tree_bitwise(opt(*make_args_like(args)), step(*make_args_like(args)))


def make_args_like(args):
    return tuple(first_step.copy_arrays(args))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flax_nnx_model_with_rng_state(path):
    from flax import nnx

    mesh = _mesh()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    graphdef, state = nnx.split(Net(nnx.Rngs(params=0, dropout=1)))
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(state))
    xs = NamedSharding(mesh, P("dp", None))
    rep = NamedSharding(mesh, P())

    @partial(jax.jit, in_shardings=(rep, xs), out_shardings=(rep, rep), donate_argnums=(0,))
    def step(state, x):
        model = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return nnx.state(model), value

    x = jax.device_put(jnp.ones((8, 16)), xs)
    # A new module per state: device_put copies of one nnx.State shared buffers here, and
    # donating one of them made plain jit abort on the other (JAX/Flax, not concerto_jax).
    fresh = lambda: jax.device_put(nnx.split(Net(nnx.Rngs(params=0, dropout=1)))[1], rep)  # noqa: E731
    opt = concerto_jax.optimize(step, PATHS[path])
    ref, got = fresh(), fresh()
    for _ in range(2):
        ref, v_ref = step(ref, x)
        got, v_got = opt(got, x)
        assert_tree_bitwise((got, v_got), (ref, v_ref))
    assert opt.report().optimized


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flax_linen_model_with_dropout_key(path):
    import flax.linen as nn

    mesh = _mesh()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.relu(nn.Dense(32)(x))
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(4)(x)

    net = Net()
    xs = NamedSharding(mesh, P("dp", None))
    rep = NamedSharding(mesh, P())

    @partial(jax.jit, in_shardings=(rep, xs, rep), out_shardings=(rep, rep, rep),
             donate_argnums=(0, 2))
    def step(params, x, key):
        key, sub = jax.random.split(key)

        def loss(p):
            return jnp.mean(net.apply({"params": p}, x, True, rngs={"dropout": sub}) ** 2)

        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), value, key

    x = jax.device_put(jnp.ones((8, 16)), xs)
    # Fresh params per run: donating a device_put copy of single-device params consumed the
    # source's device-0 buffer too (plain jit aborts then; JAX, not concerto_jax).
    fresh = lambda: (jax.device_put(net.init(jax.random.key(0), jnp.ones((8, 16)), False)["params"],  # noqa: E731
                                    rep), x, jax.device_put(jax.random.key(3), rep))
    opt = concerto_jax.optimize(step, PATHS[path])
    ref, got = fresh(), fresh()
    for _ in range(2):
        ref = step(*ref)
        got = opt(*got)
        assert_tree_bitwise(got, ref)
        ref, got = (ref[0], x, ref[2]), (got[0], x, got[2])


# -- identity runs JAX's own executable ----------------------------------------------------
def test_identity_runs_the_original_executable_and_captures_lazily(monkeypatch):
    mesh = _mesh()
    step, make_args = _dropout_step(mesh, "threefry2x32")
    calls = []
    real = capture_lib.capture
    monkeypatch.setattr(capture_lib, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    opt = concerto_jax.optimize(step)
    assert_tree_bitwise(opt(*make_args()), step(*make_args()))
    assert calls == [], "the identity pipeline must not capture (compile) before report()"
    rep = opt.report()
    assert calls == [1] and rep.optimized and rep.executable == "original"
    assert rep.instructions > 0 and rep.collectives.get("all-reduce", 0) >= 1
    assert "JAX's own executable" in str(rep) and "not needed" in rep.first_step_check
    captured, emitted = opt.hlo_texts()
    assert "all-reduce" in captured and "replica-id" in emitted or "all-reduce" in emitted
    opt.report()
    assert calls == [1], "the description is made once per signature"


# -- first-step check ----------------------------------------------------------------------
def _perturb_pass(module, options):
    """A wrong pass: adds 1 to the first f32 parameter's first use (a numeric change)."""
    for inst in module.entry.instructions:
        if inst.opcode == "tanh":
            inst.opcode = "exponential"
            return PassOutcome(changed=True)
    raise AssertionError("no tanh in the module")


def _mlp_step(mesh):
    xs = NamedSharding(mesh, P("dp", None))
    ws = NamedSharding(mesh, P(None, "tp"))

    @partial(jax.jit, in_shardings=(ws, xs), out_shardings=(ws, NamedSharding(mesh, P())),
             donate_argnums=(0,))
    def step(w, x):
        value, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, value

    def make_args():
        return (jax.device_put(jnp.linspace(-1, 1, 16 * 32).reshape(16, 32), ws),
                jax.device_put(jnp.ones((8, 16)) * 0.1, xs))

    return step, make_args


def test_first_step_check_catches_a_difference_and_falls_back(monkeypatch):
    monkeypatch.setitem(PASSES, "schedule", _perturb_pass)
    mesh = _mesh()
    step, make_args = _mlp_step(mesh)
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",)))
    args = make_args()
    with pytest.warns(concerto_jax.ConcertoFallbackWarning, match="differs from the original"):
        got = opt(*args)
    assert args[0].is_deleted(), "the user's donated buffer is consumed once, like the original's"
    want = step(*make_args())
    assert_tree_bitwise(got, want)  # the original's result, not ours
    rep = opt.report()
    assert not rep.optimized and rep.executable == "original"
    assert rep.first_step_check.startswith("ran: DIFFERED")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_tree_bitwise(opt(*make_args()), step(*make_args()))  # original from now on, no new warning

    strict = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("schedule",), fallback=False, optimize=concerto_jax.OptimizeOptions(check_first_step=True)))
    with pytest.raises(concerto_jax.FirstStepMismatch, match="differs"):
        strict(*make_args())

    # Without the check, the wrong pass goes through: the check is what caught it.
    unchecked = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("schedule",), optimize=concerto_jax.OptimizeOptions(check_first_step=False)))
    got = unchecked(*make_args())
    assert not np.array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _our_executable_fails(monkeypatch, step) -> list:
    """Every build of ``optimize`` hands back an executable that raises at launch; the returned
    list grows by one per launch."""
    cls = type(concerto_jax.optimize(step))
    real = cls._build
    calls: list = []

    def build(self, *a, **k):
        entry = real(self, *a, **k)
        if entry.runner is not None:
            def fails(*args, **kwargs):
                calls.append(1)
                raise RuntimeError("UNIMPLEMENTED: simulated failure of our executable")
            entry.runner = fails
        return entry

    monkeypatch.setattr(cls, "_build", build)
    return calls


def test_an_optimised_step_that_fails_to_run_falls_back(monkeypatch):
    # XLA:CPU compiled our module but refused to run it (a Hugging Face bf16 step with decompose:
    # "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"): the first-step check
    # returns the original's outputs and falls back, never the error
    mesh = _mesh()
    step, make_args = _mlp_step(mesh)
    _our_executable_fails(monkeypatch, step)
    opt = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE_CHECKED))
    with pytest.warns(concerto_jax.ConcertoFallbackWarning, match="failed to run .*simulated failure"):
        got = opt(*make_args())
    assert_tree_bitwise(got, step(*make_args()))  # the original's outputs
    rep = opt.report()
    assert not rep.optimized and rep.executable == "original"
    assert rep.first_step_check.startswith("ran: FAILED TO RUN")
    assert_tree_bitwise(opt(*make_args()), step(*make_args()))  # the original from now on
    strict = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE_CHECKED,
                                                              fallback=False))
    with pytest.raises(RuntimeError, match="simulated failure"):
        strict(*make_args())


def test_first_step_check_passes_and_reports(monkeypatch):
    mesh = _mesh()
    step, make_args = _mlp_step(mesh)
    opt = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE))
    assert opt.options.optimize.check_first_step == "auto"
    args = make_args()
    got = opt(*args)
    assert args[0].is_deleted()
    assert_tree_bitwise(got, step(*make_args()))
    rep = opt.report()
    assert rep.optimized and rep.executable == "recompiled"
    assert rep.first_step_check == "ran: outputs equal the original's (bitwise)"
    assert_tree_bitwise(opt(*make_args()), step(*make_args()))

    # "auto" skips the check when the copies would not fit in half of the free memory.
    monkeypatch.setattr(first_step, "_host_available_bytes", lambda: 1000)
    tight = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE))
    assert_tree_bitwise(tight(*make_args()), step(*make_args()))
    assert tight.report().first_step_check.startswith("skipped (auto)")
    forced = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE_CHECKED))
    forced(*make_args())
    assert forced.report().first_step_check.startswith("ran:")


def test_first_step_check_tolerance_and_differences():
    x = jnp.array([1.0, 2.0, 4.0])
    y = x.at[2].add(4e-6)
    assert first_step.differences(x, x) == []
    assert first_step.differences(x, y)  # bitwise: differs
    assert first_step.differences(x, y, tolerance=1e-5) == []
    assert first_step.differences({"a": x}, {"a": x.astype(jnp.bfloat16)})
    nan = jnp.array([jnp.nan, -0.0])
    assert first_step.differences(nan, nan) == []
    assert first_step.differences(nan, jnp.array([jnp.nan, 0.0]))  # the sign of zero counts
    k = jax.random.key(0)
    assert first_step.differences(k, k) == [] and first_step.differences(k, jax.random.key(1))
    # an inf in the reference sets no scale: other values are still held to the tolerance
    inf = jnp.array([jnp.inf, 1.0])
    assert first_step.differences(inf, inf, tolerance=1e-3) == []
    assert first_step.differences(inf, jnp.array([jnp.inf, 5.0]), tolerance=1e-3)
    assert first_step.differences(inf, jnp.array([-jnp.inf, 1.0]), tolerance=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-NaN output (a metric NaN by design) warns nothing
        all_nan = jnp.full((3,), jnp.nan)
        assert first_step.differences(all_nan, all_nan, tolerance=1e-3) == []
        assert first_step.differences(all_nan, jnp.zeros(3), tolerance=1e-3)


def test_an_unchecked_step_that_fails_to_run_falls_back(monkeypatch):
    # with the first-step check off, a launch failure of our executable used to reach the user:
    # the original runs instead, with one warning, and from then on
    mesh = _mesh()
    step, make_args = _mlp_step(mesh)
    calls = _our_executable_fails(monkeypatch, step)
    opt = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE_UNCHECKED))
    with pytest.warns(concerto_jax.ConcertoFallbackWarning, match="failed to run .*simulated failure"):
        got = opt(*make_args())
    assert calls == [1]
    assert_tree_bitwise(got, step(*make_args()))
    rep = opt.report()
    assert not rep.optimized and rep.executable == "original" and "simulated failure" in rep.fallback_reason
    assert_tree_bitwise(opt(*make_args()), step(*make_args()))
    assert calls == [1], "the failed executable must not run again"
    strict = concerto_jax.optimize(step, concerto_jax.Options(optimize=ALWAYS_RECOMPILE_UNCHECKED,
                                                              fallback=False))
    with pytest.raises(RuntimeError, match="simulated failure"):
        strict(*make_args())
