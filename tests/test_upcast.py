"""The wider-precision twin of a module (hlo_passes.upcast) and the first-step judge built on it.

The twin runs in place of the captured step (same arguments, same output types): checked here
against the same function written in the wider type, and on what it must refuse.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax import capture as capture_lib
from concerto_jax import executor, first_step, pipeline
from hlo_passes.registry import PASSES, PassOutcome
from hlo_passes.upcast import UpcastError, upcast_floats, widening_of


def _wider_step(fn, args):
    """``fn``'s captured module widened, compiled and callable like ``fn``."""
    cap = capture_lib.capture(fn, args, {})
    text, mapping = pipeline.wider_text(cap.hlo_text)
    loaded, _ = executor.compile_replicated(text, cap.device_list)
    return executor.swap_executable(cap.compiled, loaded), mapping, text


def test_bf16_step_widened_computes_in_f32_and_returns_bf16():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    dat, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def f(x, w):  # bf16 in, bf16 out, a dot and an all-reduce (the batch sum) on the way
        h = jnp.tanh(x @ w)
        return h, jnp.sum(h, axis=0)

    body = jax.jit(f, in_shardings=(dat, rep), out_shardings=(dat, rep))
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.device_put(jax.random.normal(k1, (64, 96), jnp.bfloat16), dat)
    w = jax.device_put(jax.random.normal(k2, (96, 32), jnp.bfloat16), rep)
    wide, mapping, text = _wider_step(body, (x, w))
    assert mapping == {"bf16": "f32", "f16": "f32"}
    got = wide(x, w)
    low = body(x, w)
    f32 = jax.jit(f, in_shardings=(dat, rep))(x.astype(jnp.float32), w.astype(jnp.float32))
    for g, lo, hi in zip(got, low, f32, strict=True):
        assert g.dtype == lo.dtype == jnp.bfloat16 and g.shape == lo.shape
        assert g.sharding.is_equivalent_to(lo.sharding, g.ndim)
        # the twin is the f32 function rounded once at the output
        np.testing.assert_array_equal(np.asarray(g), np.asarray(hi.astype(jnp.bfloat16)))
    # and differs from the bf16 program (it rounds every intermediate)
    assert not np.array_equal(np.asarray(got[1]), np.asarray(low[1]))
    assert "bf16[" in text.split("ENTRY", 1)[1].split("\n", 2)[1]  # entry parameters keep bf16


def test_f32_step_widens_to_f64_and_keeps_random_bits_at_f32():
    """jax.random.uniform makes f32 from u32 bits (bitcast-convert): that op stays at f32, its
    result is converted up, so the twin draws the same numbers."""

    def f(key, x):
        return x * jax.random.uniform(key, x.shape) + jnp.cumsum(x, axis=1)

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    body = jax.jit(f, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))))
    key = jax.random.key(3)
    x = jax.random.normal(jax.random.key(4), (16, 257))
    wide, mapping, text = _wider_step(body, (key, x))
    assert mapping == {"f32": "f64", "c64": "c128"}
    assert "bitcast-convert" in text and "f64[" in text
    got = np.asarray(wide(key, x))
    u = np.asarray(jax.random.uniform(key, x.shape), np.float64)  # the same f32 draws
    want = np.asarray(x, np.float64) * u + np.cumsum(np.asarray(x, np.float64), axis=1)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert not np.array_equal(got, np.asarray(body(key, x)))  # the f32 cumsum rounds differently


_HALF_MODULE = """HloModule m

ENTRY %main (x: bf16[4], y: u16[4]) -> (bf16[4], u16[4], f32[4]) {
  %x = bf16[4]{0} parameter(0)
  %y = u16[4]{0} parameter(1)
  %b = bf16[4]{0} bitcast-convert(%y)
  %s = bf16[4]{0} add(%x, %b)
  %u = u16[4]{0} bitcast-convert(%s)
  %f = f32[4]{0} convert(%s)
  ROOT %t = (bf16[4]{0}, u16[4]{0}, f32[4]{0}) tuple(%s, %u, %f)
}
"""


def test_type_bound_ops_keep_their_types_and_the_entry_its_signature():
    module = hlo_passes.parse_module(_HALF_MODULE)
    assert upcast_floats(module) == {"bf16": "f32", "f16": "f32"}
    hlo_passes.verify(module)
    entry = module.entry
    by = {i.name: i for i in entry.instructions}
    assert by["x"].shape.dtype == "bf16" and by["s"].shape.dtype == "f32"
    assert by["b"].shape.dtype == "bf16" and by["u"].shape.dtype == "u16"
    assert by["u"].operands[0].opcode == "convert" and by["u"].operands[0].shape.dtype == "bf16"
    assert str(entry.root.shape) == str(hlo_passes.parse_module(_HALF_MODULE).entry.root.shape)
    executor.parse_with_xla(hlo_passes.module_to_text(module))


@pytest.mark.parametrize("body,why", [
    ("%x = f8e4m3fn[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} convert(%x)", "f8e4m3fn"),
    ("%x = s32[4]{0} parameter(0)\n  ROOT %n = s32[4]{0} negate(%x)", "no bf16, f16 or f32"),
])
def test_modules_without_a_meaningful_twin_are_refused(body, why):
    module = hlo_passes.parse_module(f"HloModule m\n\nENTRY %main () -> f32[4] {{\n  {body}\n}}\n")
    with pytest.raises(UpcastError, match=why):
        widening_of(module)


# -- the first-step judge --------------------------------------------------------------------


def _bf16_adam_step(fp8_input: bool = False):
    """A bf16-compute data-parallel MLP with AdamW on 8 CPU devices (f32 master weights);
    ``fp8_input``: the batch goes through float8_e4m3fn first (a module with no wider twin)."""
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    opt = optax.adamw(1e-3)

    def loss(ws, x):
        if fp8_input:
            x = x.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)
        for w in ws:
            x = jnp.tanh(x @ w.astype(jnp.bfloat16))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    @partial(jax.jit, in_shardings=(rep, rep, dat), out_shardings=(rep, rep, rep))
    def step(ws, state, x):
        v, g = jax.value_and_grad(loss)(ws, x)
        updates, state = opt.update(g, state, ws)
        return optax.apply_updates(ws, updates), state, v

    ks = jax.random.split(jax.random.key(0), 4)
    ws = [jax.device_put(jax.random.normal(k, (64, 64)) * 0.1, rep) for k in ks[:3]]
    x = jax.device_put(jax.random.normal(ks[-1], (64, 64), jnp.bfloat16), dat)
    return step, ws, opt.init(ws), x


def _corrupt_gradients(module, options):
    """A wrong rewrite that declares a tolerance: every float all-reduce's result x 1.5 (the
    loss and the data-parallel gradient reductions): Adam's parameters barely show the
    gradients' error (its first update is +-lr whatever the scale), its moments do."""
    entry = module.entry
    n = 0
    for ar in [i for i in entry.instructions if i.opcode == "all-reduce"
               and i.shape.dtype in ("f32", "bf16")]:
        c = entry.add_instruction(hlo_passes.Instruction(
            module.unique_name("c"), "constant", hlo_passes.Shape(ar.shape.dtype, ()),
            literal="1.5"), after=ar)
        b = entry.add_instruction(hlo_passes.Instruction(
            module.unique_name("b"), "broadcast", ar.shape, [c], {"dimensions": "{}"}), after=c)
        users = list(ar.users)
        m = entry.add_instruction(hlo_passes.Instruction(
            module.unique_name("m"), "multiply", ar.shape, [ar, b]), after=b)
        for u in users:
            u.replace_operand(ar, m)
        if entry.root is ar:
            entry.root = m
        n += 1
    return PassOutcome(changed=n > 0, stats={"corrupted": n}, tolerance=1e-3)


def _corrupted_first_call(monkeypatch, fp8_input: bool = False):
    """The first call of ``_bf16_adam_step`` through the corrupting pass under "wider":
    ``(the original's outputs, ours, the optimised step, our warnings)``."""
    monkeypatch.setitem(PASSES, "corrupt", _corrupt_gradients)
    step, ws, state, x = _bf16_adam_step(fp8_input)
    want = step(ws, state, x)
    opt = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("corrupt", "schedule"), optimize=concerto_jax.OptimizeOptions(first_step_reference="wider")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(ws, state, x)
    return want, got, opt, [str(w.message) for w in caught if "concerto_jax" in str(w.message)]


def test_wider_judge_rejects_a_wrong_rewrite_that_declared_a_tolerance(monkeypatch):
    want, got, opt, ours = _corrupted_first_call(monkeypatch)
    assert not first_step.differences(want, got)  # the original's outputs came back
    report = opt.report()
    assert not report.optimized and report.first_step_check.startswith("ran: DIFFERED")
    assert "less accurate than the original against the step in wider precision" in \
        report.first_step_check, report.first_step_check
    assert len(ours) == 1 and "['corrupt'] that reassociate sums are left out" in ours[0]


def test_a_step_without_a_wider_twin_keeps_the_plain_verdict(monkeypatch):
    """fp8 values in the module: no twin (UpcastError), so the plain check's verdict stands:
    the original's outputs, the pass left out, the reason in the one warning."""
    want, got, _, ours = _corrupted_first_call(monkeypatch, fp8_input=True)
    assert not first_step.differences(want, got)
    assert len(ours) == 1 and "could not run in wider precision (UpcastError" in ours[0], ours
    assert "['corrupt'] that reassociate sums are left out" in ours[0]


def test_wider_judge_keeps_an_exact_split_of_a_bf16_adam_step():
    """The region split of the bf16 GPT step with AdamW and dropout differs from the original
    past the declared 1e-3 (Adam's +-lr on sign flips of near-zero bias gradients:
    test_decompose_region drops it); judged against the step in f32 it is as accurate as the
    original, so it is kept, with no warning."""
    from models import variants

    v = variants.make_variant("gpt", "dp_tp", ("bf16", "dropout"))
    want = v.step(*v.make_args(0))
    opt = concerto_jax.optimize(v.step, concerto_jax.Options(
        passes=("decompose", "schedule"),
        optimize=concerto_jax.OptimizeOptions(first_step_reference="wider")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(*v.make_args(0))
        again = opt(*v.make_args(0))
    assert not [str(w.message) for w in caught if "concerto_jax" in str(w.message)]
    report = opt.report()
    assert report.optimized and report.executable == "recompiled"
    assert {p.name for p in report.passes if p.changed} == {"decompose", "schedule"}
    assert report.first_step_check.startswith(
        "ran: outputs differ from the original's beyond relative tolerance 0.001"), report.first_step_check
    assert "as close to the step run in wider precision (bf16 -> f32, f16 -> f32)" in \
        report.first_step_check
    assert first_step.differences(want, got, 1e-3)  # past the tolerance: the judge decided
    assert not first_step.differences(got, again)  # the kept executable runs from then on
    np.testing.assert_allclose(float(got[1]["loss"]), float(want[1]["loss"]), rtol=1e-3)


def test_less_accurate_allows_a_few_more_worst_case_errors_not_more_error():
    """The judge's rule on plain arrays: errors against the wider run, normalised per leaf."""
    wide = {"w": jnp.linspace(-1.0, 1.0, 1000), "b": jnp.full((8,), 0.5), "n": jnp.arange(4)}
    flip = jnp.zeros(1000).at[10].set(0.2)  # one large error (an Adam flip) in the original
    ref = {"w": wide["w"] + flip, "b": wide["b"], "n": wide["n"]}
    two_flips = {"w": wide["w"] + jnp.zeros(1000).at[20].set(0.2).at[30].set(0.2),
                 "b": wide["b"].at[0].add(0.1), "n": wide["n"]}  # and one in a leaf with none
    assert not first_step.less_accurate(ref, two_flips, wide, 1e-3)
    many = {**ref, "w": wide["w"] + jnp.where(jnp.arange(1000) % 10 == 0, 0.2, 0.0)}
    assert any("'w'" in b and "RMS" in b for b in first_step.less_accurate(ref, many, wide, 1e-3))
    bigger = {**ref, "b": wide["b"].at[3].add(0.25)}  # 2.5x the original's worst (0.5 of 0.5)
    assert any("'b'" in b and "largest anywhere" in b for b in first_step.less_accurate(ref, bigger, wide, 1e-3))
    nan = {**ref, "w": ref["w"].at[0].set(jnp.nan)}
    assert any("non-finite" in b for b in first_step.less_accurate(ref, nan, wide, 1e-3))
    ints = {**ref, "n": wide["n"] + 1}
    assert any("'n'" in b for b in first_step.less_accurate(ref, ints, wide, 1e-3))
