"""Passes of the ``optimize`` pipeline, listed by name in ``hlo_passes.registry.PASS_TABLE``.

* ``schedule``: order every computation (entry, loop bodies, branches) by the RCPSP
  scheduler (Concerto §4); it lives in its own folder, ``hlo_passes/schedule/``.
* ``pipeline_loops``: prefetch next iteration's FSDP all-gathers in scanned-layer
  loops where the schedule says it pays and the memory limit allows (run before
  ``schedule``; ``hlo_passes/pipeline_loops/``).
* ``decompose``: split the computation around critical collectives (Concerto §5).
* ``fuse_collectives``: merge compatible collectives into variadic ones, fused sizes
  chosen by the cost model (Concerto §4.5, Algorithm 1; ``hlo_passes/fuse_collectives/``).
* ``pin``: opt-barriers around each collective's planned window, so XLA keeps the overlap
  (``hlo_passes/pin/``).

The pipeline imports a pass's module when the pass first runs.
"""
