"""Expert parallelism: the MoE model's dispatch and combine all-to-alls, split by decompose.

``models.moe`` routes each token to one expert (GShard-style one-hot dispatch); under the
``ep`` layout XLA's SPMD partitioner moves the dispatched tokens to their experts' devices
and back with all-to-alls. The decomposition's SPMD rule for an all-to-all splits it along
any dimension but its own (a chunk of the capacity slots, or of the model dimension, is an
all-to-all of its own); here that rule meets the all-to-alls a real expert-parallel step
has, through ``optimize`` on 8 CPU devices, and the results are checked against plain
``jax.jit``.
"""

import jax
import numpy as np

import concerto_jax
import models
from tests._helpers import FAST


def test_decompose_splits_the_expert_all_to_alls_and_matches_jit():
    case = models.make_case("moe", "ep")
    # force_degree: every collective is a candidate, critical or not (at the tiny width
    # nothing is exposed on the target's cost model); contexts, not regions
    options = concerto_jax.Options(
        passes=("decompose", "schedule"), fallback=False, compiler_options=FAST,
        decompose=concerto_jax.DecomposeOptions(force_degree=2, region_degree=None))
    step = concerto_jax.optimize(case.step, options)
    ref_state, got_state = case.init_state(0), case.init_state(0)
    batch = case.make_batch(0)
    reference = case.step.lower(ref_state, batch).compile(compiler_options=FAST)
    for _ in range(2):
        ref_state, ref_metrics = reference(ref_state, batch)
        got_state, got_metrics = step(got_state, batch)
    report = step.report()
    assert report.optimized and report.collectives.get("all-to-all") == 8, report
    (dec,) = [p for p in report.passes if p.name == "decompose"]
    split = [d for d in dec.stats["decomposed"] if d["collective"].startswith("all-to-all")]
    assert len(split) == 8 and {d["n"] for d in split} == {2}, dec.stats["decomposed"]
    # each all-to-all is 5-D [expert, group, 1, capacity, embed] with dimensions={0} (or {1});
    # the split takes another axis
    assert all(d["axis"] not in (0, 1) for d in split), split
    assert report.first_step_check.startswith("ran: outputs equal the original's"), report.first_step_check
    tol = dec.tolerance
    assert tol > 0  # the split contexts hold the expert GEMMs: a declared tolerance
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(got_state),
                          jax.tree.leaves(got_state), jax.tree.leaves(ref_state), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        assert float(np.max(np.abs(a - b), initial=0.0)) <= tol * scale, jax.tree_util.keystr(path[0])
    np.testing.assert_allclose(float(got_metrics["loss"]), float(ref_metrics["loss"]), rtol=tol)
