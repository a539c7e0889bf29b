"""Every model x layout as a real training step would be written: bitwise through the recompile.

Each case is a ``models.variants`` step (typed dropout key argument, donated)
with bf16 compute / float32 params and one more feature in rotation: host callbacks (debug.print and an ordered
io_callback), DropConnect masks from the key, gradient accumulation over
micro-batches in a ``lax.scan``, scanned layers with remat; three cases run all of them at once. Each runs through
``optimize`` with the recompiled module (``always_recompile``: the path a
changing pass takes) and must equal the step bitwise over two steps, with the
same callback values. (The identity pipeline runs JAX's own executable.)

Both sides use LLVM -O0 (as tests/test_optimize_models.py) to keep the suite fast.
"""

import jax
import numpy as np
import pytest

import concerto_jax
import models
from models import variants

FAST = {"xla_backend_optimization_level": 0}
SCANNED = {"gpt", "vit", "evoformer"}
CASES = models.list_cases()
ROTATION = ("callbacks", "dropout", "grad_accum", "scan_remat")


def _one_feature(i, model):
    """Features of the i-th case: bf16 compute everywhere, plus one more feature in rotation."""
    feature = ROTATION[i % len(ROTATION)]
    return ("bf16", "dropout" if feature == "scan_remat" and model not in SCANNED else feature)


ONE = [(m, lay, _one_feature(i, m)) for i, (m, lay) in enumerate(CASES)]
# Everything at once, on the layouts where a difference was reported (FSDP, FSDP x TP-like 2-D).
ALL = [("gpt", "zero3"), ("gpt", "dp_tp"), ("vit", "zero3")]
EVERYTHING = ("callbacks", "dropout", "grad_accum", "bf16", "scan_remat")


def _bits(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _diff(a, b) -> list[str]:
    bad = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or x.sharding != y.sharding:
            bad.append(f"{jax.tree_util.keystr(path)}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif not np.array_equal(_bits(x), _bits(y)):
            bad.append(f"{jax.tree_util.keystr(path)}: values differ")
    return bad


def _check(model, layout, features):
    v = variants.make_variant(model, layout, features)
    args = v.make_args(0)
    reference = v.step.lower(*args).compile(compiler_options=FAST)
    opt = concerto_jax.optimize(v.step, concerto_jax.Options(
        always_recompile=True, compiler_options=FAST, check_first_step=False, fallback=False))
    ref, got = v.make_args(0), v.make_args(0)
    for i in range(2):
        ref = reference(*ref)
        jax.effects_barrier()
        got = opt(*got)
        jax.effects_barrier()
        bad = _diff(got, ref)
        assert not bad, f"{v.name} step {i}: {bad[:5]}"
        ref = (ref[0], args[1], ref[2])
        got = (got[0], args[1], got[2])
    if "callbacks" in features:
        assert len(v.log) == 4 and v.log[0] == v.log[1] and v.log[2] == v.log[3], v.log
    report = opt.report()
    assert report.optimized and report.executable == "recompiled", report.fallback_reason
    assert sum(report.collectives.values()) > 0


@pytest.mark.parametrize(("model", "layout", "features"), ONE,
                         ids=[f"{m}-{lay}-{'+'.join(f)}" for m, lay, f in ONE])
def test_every_case_with_a_real_step_feature(model, layout, features):
    _check(model, layout, features)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), ALL, ids=[f"{m}-{lay}" for m, lay in ALL])
def test_all_features_at_once(model, layout):
    _check(model, layout, EVERYTHING)


def test_variant_features_are_what_they_say():
    v = variants.make_variant("gpt", "dp_tp", ("dropout", "grad_accum", "bf16", "scan_remat"))
    text = v.step.lower(*v.make_args(0)).as_text()
    assert "bf16" in text and "stablehlo.while" in text  # bf16 compute; scan loops
    assert "threefry" in text or "rng_bit_generator" in text  # dropout masks from the key
    assert v.case.config.dtype == jax.numpy.bfloat16 and v.case.config.scan_layers
    with pytest.raises(ValueError, match="unknown variant feature"):
        variants.make_variant("gpt", "dp", ("teleport",))
