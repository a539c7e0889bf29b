"""Model x layout cases (tiny config): optimize(step) with the schedule pass, through the recompiled
module, equals step bitwise over 3 training steps, and the captured post-SPMD module survives our
parse -> print round trip (XLA's canonical text of ours equals XLA's canonical text of the original).

The default run covers every model and the layout styles the other tests do not already run through
the recompile (SP, 2-D DAP, ZeRO-2/3 on convolutions, shard_map); every model x layout (22 cases,
~8 min on 2 cores) runs with ``CONCERTO_FULL_SWEEP=1``. The round trip of every case's post-SPMD
module is checked in the default run by tests/test_models.py (from the dump it already makes).

Both sides are compiled with the same fast XLA options (LLVM -O0) to keep the suite quick; the
default options are covered by tests/test_optimize.py.
"""

import pytest

import concerto_jax
import hlo_passes
import models
from tests._helpers import FAST, FULL_SWEEP, run_bitwise_steps

SUBSET = [("gpt", "tp_sp"), ("vit", "zero2"), ("evoformer", "dp_dap"), ("wideresnet", "zero3"),
          ("gpt", "shard_map_dp")]
CASES = models.list_cases() if FULL_SWEEP else SUBSET


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_optimized_step_is_bitwise_equal(model, layout):
    case = models.make_case(model, layout, "tiny")
    reference = case.step.lower(case.state, case.batch).compile(compiler_options=FAST)
    step = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=("schedule",), compiler_options=FAST, fallback=False,
        always_recompile=True, check_first_step=False))
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
    """The default subset names real cases and covers every model."""
    cases = set(models.list_cases())
    assert set(SUBSET) <= cases
    assert {m for m, _ in SUBSET} == {m for m, _ in cases}
