"""Every model x layout (tiny config): optimize(step) with the schedule pass equals step bitwise
over 3 training steps, and the captured post-SPMD module survives our parse -> print round trip
(XLA's canonical text of ours equals XLA's canonical text of the original).

Both sides are compiled with the same fast XLA options (LLVM -O0) to keep the suite quick; the
default options are covered by tests/test_optimize.py.
"""

import jax
import numpy as np
import pytest

import concerto_jax
import hlo_passes
import models

CASES = models.list_cases()
FAST = {"xla_backend_optimization_level": 0}


def _bitwise_diff(a, b) -> list[str]:
    bad = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or x.sharding != y.sharding:
            bad.append(f"{jax.tree_util.keystr(path)}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True):
            bad.append(f"{jax.tree_util.keystr(path)}: values differ")
    return bad


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_optimized_step_is_bitwise_equal(model, layout):
    case = models.make_case(model, layout, "tiny")
    reference = case.step.lower(case.state, case.batch).compile(compiler_options=FAST)
    step = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=("schedule",), compiler_options=FAST, fallback=False,
        always_recompile=True, check_first_step=False))
    ref, opt = case.init_state(0), case.init_state(0)
    for i in range(3):
        ref, ref_metrics = reference(ref, case.batch)
        opt, opt_metrics = step(opt, case.batch)
        bad = _bitwise_diff((opt, opt_metrics), (ref, ref_metrics))
        assert not bad, f"step {i}: {bad[:5]}"
    report = step.report()
    assert report.optimized, report.fallback_reason
    assert report.num_devices == 8
    assert sum(report.collectives.values()) > 0, "a sharded train step must communicate"
    assert len(step.reports()) == 1
    (sched,) = report.passes
    assert sched.stats["scheduled_us"] <= sched.stats["program_order_us"] + 1e-6

    captured, _ = step.hlo_texts()
    printed = hlo_passes.module_to_text(hlo_passes.parse_module(captured))
    assert hlo_passes.xla_canonical(printed) == hlo_passes.xla_canonical(captured)
