"""Smoke subset: what every supported JAX must run (CI runs ``-m smoke`` on the oldest one).

Capture, the IR round trip against XLA's parser, ``optimize`` with each pass (bitwise, or
within the tolerance the pass declares), and one ``compile_for_target`` with ``decompose``.
"""

import pytest

import concerto_jax
import hlo_passes
import models
from concerto_jax.capture import capture
from concerto_jax.deviceless import gpu_plugin_available
from hlo_passes.registry import PASS_TABLE
from tests._helpers import FAST, NO_COMBINER, run_bitwise_steps

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def gpt_tp():
    return models.make_case("gpt", "dp_tp", "tiny")


def test_capture_and_ir_round_trip(gpt_tp):
    cap = capture(gpt_tp.step, (gpt_tp.state, gpt_tp.batch))
    assert cap.num_partitions == 8 and "all-reduce" in cap.hlo_text
    module = hlo_passes.verify(hlo_passes.parse_module(cap.hlo_text))
    printed = hlo_passes.module_to_text(module)
    assert hlo_passes.xla_canonical(printed) == hlo_passes.xla_canonical(cap.hlo_text)


# "pin" puts opt-barriers around planned windows, which moves XLA:CPU's fusion boundaries; its
# YNNPACK dot fusions round differently from the separate ops (bitwise again with them off, as
# below). Where a first step differs, optimize's first-step check runs the original instead.
ROW_STABLE_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_multi_thread_eigen": False}


@pytest.mark.parametrize("name", sorted(PASS_TABLE))
def test_optimize_with_each_pass(gpt_tp, name):
    xla = {**FAST, **NO_COMBINER, **(ROW_STABLE_DOTS if name == "pin" else {})}
    reference = gpt_tp.step.lower(gpt_tp.state, gpt_tp.batch).compile(compiler_options=xla)
    step = concerto_jax.optimize(gpt_tp.step, concerto_jax.Options(
        passes=(name,), compiler_options=xla, fallback=False))
    step(gpt_tp.init_state(0), gpt_tp.batch)
    report = step.report()
    assert report.optimized, report.fallback_reason
    assert [p.name for p in report.passes] == [name]
    if report.executable == "original":  # the pass left the module as it was: JAX's own step runs
        assert not report.passes[0].changed
        reference = gpt_tp.step
    run_bitwise_steps(reference, step, gpt_tp, 2, tolerance=report.passes[0].tolerance)


@pytest.mark.skipif(not gpu_plugin_available(), reason="CUDA PJRT plugin missing: pip install -e .[gpu]")
def test_compile_for_target_with_decompose():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = concerto_jax.target_mesh("h100_sxm_8", (1, 8), ("dp", "tp"))

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    args = [jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp"))),
            jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", None))),
            jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp", None)))]
    res = concerto_jax.compile_for_target(
        jax.jit(jax.grad(loss, argnums=(0, 1))), *args, target="h100_sxm_8",
        options=concerto_jax.Options(passes=("decompose", "schedule"), fallback=False))
    assert [p.name for p in res.passes][:1] == ["decompose"]
    assert "is_scheduled=true" in res.final_text
    assert 0 < res.final_step_us <= res.stock_step_us
