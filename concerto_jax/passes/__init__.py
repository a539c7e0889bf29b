"""Passes of the ``optimize`` pipeline, listed by name in ``concerto_jax.pipeline.PASS_TABLE``.

* ``decompose``: split the computation around critical collectives (Concerto §5).
* ``schedule``: order the entry computation by the RCPSP scheduler (Concerto §4).
* ``fuse_collectives``: merge compatible collectives into variadic ones, fused sizes
  chosen by the cost model (Concerto §4.5, Algorithm 1).
* ``pin``: opt-barriers around each collective's planned window, so XLA keeps the overlap.

The pipeline imports a pass's module when the pass first runs.
"""
