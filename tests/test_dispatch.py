"""optimize's per-call dispatch: JAX's C++ dispatch for a settled signature, our key for the rest.

On a GPU, keying every call in Python cost a sixth of a 0.7 ms step (measured on an H200,
bench/results/gpu/): a settled signature now runs through JAX's own C++ dispatch
(``jax_compat.guarded_cpp_call``), whose cache misses ask our key first. These tests check that
the fast path never runs an executable for arguments our key sends elsewhere (weak types, other
shapes, static values), and the first-step check's judge for originals that do not reproduce
themselves (atomic scatters on GPUs).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import concerto_jax
from concerto_jax import first_step
from concerto_jax.options import OptimizeOptions, Options

RECOMPILED = Options(passes=("schedule",), optimize=OptimizeOptions(always_recompile=True))


def _optimized(fn, options=RECOMPILED):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return concerto_jax.optimize(fn, options)


def test_settled_signature_runs_through_the_guarded_cpp_dispatch():
    f = jax.jit(lambda x, y: (x * 2 + y, jnp.sum(x)))
    o = _optimized(f)
    x, y = jnp.arange(8.0), jnp.ones(8)
    for _ in range(3):
        got = o(x, y)
    entry, _, call = o._fast
    assert call is not None and entry.runner is not None, "the settled signature has no C++ call"
    want = f(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    assert len(o._cache) == 1


def test_weak_types_other_shapes_and_static_values_go_to_their_own_entries():
    g = jax.jit(lambda x, s: x * s)
    o = _optimized(g)
    xb = jnp.ones((4,), jnp.bfloat16)
    strong = o(xb, jnp.float32(2))
    strong = o(xb, jnp.float32(2))  # settled: the C++ call
    assert o._fast is not None and o._fast[2] is not None
    assert strong.dtype == g(xb, jnp.float32(2)).dtype == jnp.float32
    # JAX's executable check accepts a weak-typed scalar for a strong one; our key does not
    weak = o(xb, 2.0)
    assert weak.dtype == g(xb, 2.0).dtype == jnp.bfloat16
    assert o(xb, jnp.asarray(2.0)).dtype == g(xb, jnp.asarray(2.0)).dtype
    other = o(jnp.ones((5,), jnp.bfloat16), jnp.float32(3))
    assert other.shape == (5,) and float(other[0]) == 3.0
    assert len(o._cache) == 4  # strong scalar, Python float, weak array, another shape

    h = jax.jit(lambda x, k: x * k, static_argnums=1)
    oh = _optimized(h)
    x = jnp.arange(4.0)
    for k in (2, 2, 2, 3, 3, 2):
        np.testing.assert_array_equal(oh(x, k), h(x, k))
    assert len(oh._cache) == 2


def test_a_signature_that_runs_the_original_is_keyed_again_when_jit_compiles_anew():
    f = jax.jit(lambda x: x + 1)
    o = _optimized(f, Options())  # no pass on CPU: the original runs
    x = jnp.ones((8,))
    o(x)
    o(x)
    entry, _, call = o._fast
    assert call is None and entry.runner is None
    for _ in range(5):
        o(x)
    assert len(o._cache) == 1
    z = jnp.ones((3,))
    np.testing.assert_array_equal(o(z), f(z))  # new to jit: the original ran, keyed next call
    np.testing.assert_array_equal(o(z), f(z))
    assert len(o._cache) == 2
    assert o.report().num_devices >= 1


def _leaves(*values):
    return [jnp.asarray(v) for v in values]


def test_within_spread_judges_against_the_originals_own_difference():
    ref = _leaves([1.0, 2.0, 3.0], [5, 6])
    again = _leaves([1.0, 2.0 + 1e-6, 3.0], [5, 6])
    close = _leaves([1.0, 2.0 - 2e-6, 3.0], [5, 6])
    ok, bad, words = first_step.within_spread([ref, again], close)
    assert ok and not bad and "differs between 2 runs" in words
    far = _leaves([1.0, 2.0 + 1e-4, 3.0], [5, 6])
    ok, bad, _ = first_step.within_spread([ref, again], far)
    assert not ok and "above 4x" in bad[0]
    # a leaf both runs of the original agree on must agree bitwise
    moved = _leaves([1.0, 2.0, 3.0], [5, 7])
    ok, bad, _ = first_step.within_spread([ref, again], moved)
    assert not ok and "2 runs of the original agree bitwise" in bad[0]
    with pytest.raises(ValueError, match="two or more runs"):
        first_step.within_spread([ref], close)


def test_within_spread_takes_the_largest_difference_between_any_two_runs():
    """With three runs the bar is the widest pair, the reference's or not: 5e-6 from the
    reference is beyond 4x the first repeat's 1e-6, within 4x of the two repeats' 3e-6."""
    ref = _leaves([1.0, 2.0, 3.0])
    again = _leaves([1.0, 2.0 + 1e-6, 3.0])
    third = _leaves([1.0, 2.0 - 2e-6, 3.0])
    got = _leaves([1.0, 2.0 + 5e-6, 3.0])
    assert not first_step.within_spread([ref, again], got)[0]
    ok, bad, words = first_step.within_spread([ref, again, third], got)
    assert ok and not bad and "between 3 runs" in words
    assert not first_step.within_spread([ref, again, third], _leaves([1.0, 2.0 + 2e-5, 3.0]))[0]


def test_may_vary_between_runs_only_for_gpu_scatters_without_the_determinism_flags(monkeypatch):
    text = "ENTRY e {\n  %s = f32[8]{0} scatter(f32[8]{0} %a, s32[2,1]{1,0} %i, f32[2]{0} %u)\n}"
    plain = "ENTRY e {\n  %m = f32[8]{0} multiply(f32[8]{0} %a, f32[8]{0} %a)\n}"
    collective = "ENTRY e {\n  %rs = f32[1]{0} reduce-scatter(f32[8]{0} %a), dimensions={0}\n}"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert first_step.may_vary_between_runs(text, "gpu")
    assert not first_step.may_vary_between_runs(text, "cpu")
    assert not first_step.may_vary_between_runs(plain, "gpu")
    assert not first_step.may_vary_between_runs(collective, "gpu")  # NCCL's: not an atomic scatter
    sas = text.replace("scatter(", "select-and-scatter(")
    assert first_step.may_vary_between_runs(sas, "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_exclude_nondeterministic_ops=true")
    assert not first_step.may_vary_between_runs(text, "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops")
    assert not first_step.may_vary_between_runs(text, "gpu")


def test_the_scatter_pattern_matches_what_jax_lowers():
    f = jax.jit(lambda x, i, u: x.at[i].add(u))
    text = f.lower(jnp.zeros(8), jnp.array([1, 2]), jnp.ones(2)).compile().as_text()
    assert first_step.NONDETERMINISTIC_GPU_OPS.search(text), text[:2000]


def test_the_spread_judge_runs_the_original_again_and_decides_by_its_own_difference(monkeypatch):
    """``_second_reference_inputs`` and ``_judged_by_spread`` on a real step: where the original's
    second run equals the first, the bitwise verdict stands; where it differs (a first run
    perturbed by one ulp here, as an atomic scatter would), ours is judged by that spread."""
    from concerto_jax.first_step_policy import StepEntry

    f = jax.jit(lambda x: (x * 3.0, x + 1))
    o = _optimized(f)
    x = jnp.linspace(1.0, 2.0, 8)
    entry = StepEntry(runner=None, report=None, captured="%s = f32[8]{0} scatter(...)", tolerance=0.0)
    assert o._second_reference_inputs(entry, (x,), {}) is None  # CPU: no atomic scatters
    monkeypatch.setattr(first_step, "may_vary_between_runs", lambda text, platform: True)
    again = o._second_reference_inputs(entry, (x,), {})
    assert again is not None and len(again) == first_step.SPREAD_REPEATS

    exact = f(x)
    ulp = jnp.nextafter(exact[0], jnp.inf)
    bad, words = o._judged_by_spread(exact, again, (ulp, exact[1]), ["first run differs"])
    assert bad == ["first run differs"] and words == ""  # the original reproduced itself

    first = (ulp, exact[1])  # a first run one ulp off, as an atomic scatter's would be
    bad, words = o._judged_by_spread(first, o._second_reference_inputs(entry, (x,), {}), exact, ["x"])
    assert bad == [] and "differs between 2 runs" in words
    far = (exact[0] + 1.0, exact[1])
    bad, _ = o._judged_by_spread(first, o._second_reference_inputs(entry, (x,), {}), far, ["x"])
    assert bad and "above 4x" in bad[0]
    other = (exact[0], exact[1] + 1)  # a leaf both runs agree on
    bad, _ = o._judged_by_spread(first, o._second_reference_inputs(entry, (x,), {}), other, ["x"])
    assert bad and "agree bitwise" in bad[0]


def test_the_spread_judge_runs_the_original_a_third_time_only_where_two_runs_fail(monkeypatch):
    """A repeat that happens to vary little is no bar to fall back on: where ours is beyond 4x
    the first repeat's difference, the original runs once more and the widest pair decides;
    where two runs already pass, no third run is made. The original stands in for a GPU step
    with atomic scatters: its runs here differ by a chosen number of ulps."""
    from concerto_jax.first_step_policy import StepEntry

    f = jax.jit(lambda x: x * 3.0)
    o = _optimized(f)
    x = jnp.linspace(1.0, 2.0, 8)
    exact = f(x)
    entry = StepEntry(runner=None, report=None, captured="%s = f32[8]{0} scatter(...)", tolerance=0.0)
    monkeypatch.setattr(first_step, "may_vary_between_runs", lambda text, platform: True)

    def ulps(n):
        y = exact
        for _ in range(n):
            y = jnp.nextafter(y, jnp.inf)
        return y

    def original_whose_runs_move_by(*offsets):
        calls = []

        def run(v):
            calls.append(v)
            return ulps(offsets[len(calls) - 1])
        return run, calls

    # repeats 1 ulp then 4 ulps from the reference: ours 6 ulps off passes on the third run
    o._fn, calls = original_whose_runs_move_by(1, 4)
    bad, words = o._judged_by_spread(exact, o._second_reference_inputs(entry, (x,), {}), ulps(6), ["x"])
    assert bad == [] and len(calls) == 2 and "between 3 runs" in words
    # ours 3 ulps off passes on the first repeat alone: no third run
    o._fn, calls = original_whose_runs_move_by(1, 4)
    bad, words = o._judged_by_spread(exact, o._second_reference_inputs(entry, (x,), {}), ulps(3), ["x"])
    assert bad == [] and len(calls) == 1 and "between 2 runs" in words
    # an original that reproduces itself: the bitwise verdict stands, no third run
    o._fn, calls = original_whose_runs_move_by(0, 4)
    bad, words = o._judged_by_spread(exact, o._second_reference_inputs(entry, (x,), {}), ulps(1), ["x"])
    assert bad == ["x"] and words == "" and len(calls) == 1
    # beyond 4x the widest pair of three runs: it stands
    o._fn, calls = original_whose_runs_move_by(1, 2)
    bad, _ = o._judged_by_spread(exact, o._second_reference_inputs(entry, (x,), {}), ulps(12), ["x"])
    assert bad and "above 4x" in bad[0] and "between 3 runs" in bad[-1] and len(calls) == 2
