"""Constant arrays survive the capture: XLA's dumps write constants of more than a few
elements as ``{...}`` unless asked (``xla_dump_large_constants``); a module parsed back
from such a dump held other values (a step multiplying by a
40-element constant came out different on the recompile path, and the partition-offset
tables of every 16-device program were lost, so XLA could not turn its gradient
all-reduce + dynamic-slice back into reduce-scatters)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax import pipeline
from tests._helpers import ALWAYS_RECOMPILE


def test_step_with_a_large_constant_recompiles_bitwise():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    table = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    step = jax.jit(lambda x: (x * jnp.asarray(table)).sum(0),
                   in_shardings=NamedSharding(mesh, P("d", None)), out_shardings=NamedSharding(mesh, P()))
    x = jnp.ones((64, 40))
    opt = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("schedule",), optimize=ALWAYS_RECOMPILE, fallback=False))
    np.testing.assert_array_equal(np.asarray(opt(x)), np.asarray(step(x)))
    report = opt.report()
    assert report.executable == "recompiled" and report.first_step_check.endswith("(bitwise)")
    assert "constant({...})" not in opt.hlo_texts()[0]


_ELIDED = """HloModule m

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %c = f32[16]{0} constant({...})
  ROOT %y = f32[16]{0} add(%x, %c)
}
"""


def test_elided_constant_is_refused_with_what_to_do():
    hlo_passes.parse_module(_ELIDED)  # parses (final modules are read for their structure only)
    with pytest.raises(hlo_passes.HloError, match="xla_dump_large_constants"):
        pipeline.run(_ELIDED, concerto_jax.Options())
