"""concerto_jax: overlap communication with computation in JAX training steps.

Pipeline (one stage per module)::

    jitted step + example args
      | capture    (capture.py)   post-SPMD per-device HLO, device assignment, calling convention
      | parse      (hlo_passes)   HLO text -> IR, verified
      | passes     (pipeline.py)  registered passes over the IR (identity by default)
      | emit       (hlo_passes)   IR -> HLO text, checked by XLA's parser
      | execute    (executor.py)  compiled as a replicated program on the same devices
      v
    OptimizedStep: called like the original step; .report() says what was done

Public API: ``optimize``, ``Options``, ``OptimizedStep``, ``Report``,
``ConcertoFallbackWarning``, ``FirstStepMismatch``; for a target GPU cluster without a GPU:
``target_mesh`` (a mesh of the cluster's deviceless devices) and
``compile_for_target`` (the pipeline's module compiled by XLA's GPU compiler
for the target, with planned/final/stock step times; ``TargetResult``).
"""

from concerto_jax.api import ConcertoFallbackWarning, FirstStepMismatch, OptimizedStep, optimize
from concerto_jax.options import Options
from concerto_jax.report import Report
from concerto_jax.target.compile import target_mesh
from concerto_jax.target.program import TargetFallbackWarning, TargetResult, compile_for_target

__all__ = ["ConcertoFallbackWarning", "FirstStepMismatch", "OptimizedStep", "Options", "Report",
           "TargetFallbackWarning", "TargetResult", "compile_for_target", "optimize", "target_mesh"]
