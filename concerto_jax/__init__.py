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
``ConcertoFallbackWarning``.
"""

from concerto_jax.api import ConcertoFallbackWarning, OptimizedStep, optimize
from concerto_jax.options import Options
from concerto_jax.report import Report

__all__ = ["ConcertoFallbackWarning", "OptimizedStep", "Options", "Report", "optimize"]
