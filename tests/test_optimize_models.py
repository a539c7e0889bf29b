"""Model x layout cases (tiny config): optimize(step) with the schedule pass, through the recompiled
module, equals step bitwise over 3 training steps, and the captured post-SPMD module survives our
parse -> print round trip (XLA's canonical text of ours equals XLA's canonical text of the original).

The default run covers layout styles the other tests do not already run through the recompile (SP,
ZeRO-2, 2-D DAP); every model x layout (22 cases, ~10 min on 2 cores) runs with
``CONCERTO_FULL_SWEEP=1``. The round trip of the post-SPMD module of the cases
tests/test_models.py trains is checked there too (from the dump it already makes).

Both sides are compiled with the same fast XLA options (LLVM -O0) to keep the suite quick; the
default options are covered by tests/test_optimize.py.
"""

import pytest

import concerto_jax
import hlo_passes
import models
from tests._helpers import ALWAYS_RECOMPILE_UNCHECKED, FAST, FULL_SWEEP, run_bitwise_steps

# SP on GPT, ZeRO-2 on ViT, 2-D DAP on Evoformer; WideResNet (convolutions) and shard_map go
# through the recompile in tests/test_robustness_models.py, DP x TP in tests/test_fuse_pass.py.
SUBSET = [("gpt", "tp_sp"), ("vit", "zero2"), ("evoformer", "dp_dap")]
CASES = models.list_cases() if FULL_SWEEP else SUBSET


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_optimized_step_is_bitwise_equal(model, layout):
    case = models.make_case(model, layout, "tiny")
    reference = case.step.lower(case.state, case.batch).compile(compiler_options=FAST)
    step = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=("schedule",), compiler_options=FAST, fallback=False,
        optimize=ALWAYS_RECOMPILE_UNCHECKED))
    run_bitwise_steps(reference, step, case, 3)
    report = step.report()
    assert report.optimized, report.fallback_reason
    assert report.executable == "recompiled"
    assert report.num_devices == 8
    assert sum(report.collectives.values()) > 0, "a sharded train step must communicate"
    assert len(step.reports()) == 1
    (sched,) = report.passes
    assert sched.stats["scheduled_us"] <= sched.stats["program_order_us"] + 1e-6

    captured, _ = step.hlo_texts()
    printed = hlo_passes.module_to_text(hlo_passes.parse_module(captured))
    assert hlo_passes.xla_canonical(printed) == hlo_passes.xla_canonical(captured)


def test_default_subset_is_registered():
    """The default subset names real cases (a renamed layout must not silently drop one)."""
    assert set(SUBSET) <= set(models.list_cases())
