"""Scanned (+remat) variant of every model x layout: optimize(step) with the schedule pass, which
now reorders the while bodies of the layer loops, equals plain jit bitwise over 2 training steps.

Both sides are compiled with the same fast XLA options (LLVM -O0). The whole matrix (18 cases)
takes ~9 min on the 2-core dev machine, too long for the default suite: by default a subset
covering FSDP and 2-D DP x TP layouts runs; ``CONCERTO_FULL_SCAN_MATRIX=1`` (or ``CONCERTO_FULL_SWEEP=1``)
runs all.

evoformer x dap (scanned) was not bitwise at first, even with the identity pipeline: its
tiny config has one block (a trip-count-1 while), which XLA inlines in the jitted (SPMD) program but
kept in the replicated recompile, because there the body's all-reduces still had channel ids and a
collective with a channel id counts as side-effecting outside SPMD mode. ``spmd_to_replicated`` now
writes them in cross-replica form (tests/test_replicated_bitwise.py has the small regression case).
"""

import pytest

import concerto_jax
import models
from tests._helpers import FAST, FULL_SCAN_MATRIX, run_bitwise_steps

SCAN_MODELS = ("gpt", "vit", "evoformer")
ALL = [(m, lay) for m, lay in models.list_cases() if m in SCAN_MODELS]
# FSDP all-gathers, 2-D DP x TP (TP all-reduces in the loops); 1-D TP and the other models
# (Evoformer compiles take ~1 min each) in the full matrix.
SUBSET = {("gpt", "zero3"), ("gpt", "dp_tp")}
CASES = ALL if FULL_SCAN_MATRIX else [c for c in ALL if c in SUBSET]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_scanned_step_is_bitwise_equal(model, layout):
    case = models.make_case(model, layout, "tiny", scan_layers=True, remat=True)
    reference = case.step.lower(case.state, case.batch).compile(compiler_options=FAST)
    step = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=("schedule",), compiler_options=FAST, fallback=False))
    run_bitwise_steps(reference, step, case, 2)
    report = step.report()
    assert report.optimized, report.fallback_reason
    (sched,) = report.passes
    stats = sched.stats
    assert stats["loops"], "the layer loops must be scheduled"
    assert stats["computations"] >= 3, stats  # entry + forward and backward layer loops
    for loop in stats["loops"]:
        assert loop["trips"] == case.config.num_layers if model != "evoformer" else case.config.num_blocks
    if layout not in ("dp", "shard_map_dp"):
        # Layer collectives (TP all-reduces, FSDP all-gathers, DAP all-to-alls) live in the loops.
        assert stats["collectives_in_loops"] > 0, stats
    assert stats["scheduled_us"] <= stats["program_order_us"] + 1e-6
    if any(loop["changed"] for loop in stats["loops"]):
        assert sched.changed
