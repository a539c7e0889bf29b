"""concerto_jax: overlap communication with computation in JAX training steps.

Pipeline (one stage per module)::

    jitted step + example args
      | capture    (capture.py)   post-SPMD per-device HLO, device assignment, calling convention
      | parse      (hlo_passes)   HLO text -> IR, verified
      | passes     (pipeline.py)  registered passes over the IR (identity by default)
      | print      (hlo_passes)   IR -> HLO text, checked by XLA's parser (its scheduled form with
      |                           async start/done pairs: hlo_passes.emit, written by dump_dir)
      | execute    (executor.py)  compiled as a replicated program on the same devices
      v
    OptimizedStep: called like the original step; .report() says what was done

    Target GPU cluster, deviceless (deviceless/program.py: compile_for_target)::

      stock compile for the target -> passes that rewrite the program (post-SPMD module)
      -> XLA's pipeline up to its scheduler -> "schedule" on XLA's scheduled module
      (deviceless/reschedule.py) -> XLA's backend only, through the PJRT C API (deviceless/pjrt_c.py):
      XLA's final module keeps our order

Public API: ``optimize``, ``Options`` (with its option groups ``DecomposeOptions``,
``ScheduleOptions``, ``optimize``'s ``OptimizeOptions`` and ``compile_for_target``'s
``DevicelessOptions``), ``OptimizedStep``, ``Report``,
``ConcertoFallbackWarning``, ``FirstStepMismatch``, ``UnsupportedJaxVersion``; for a target GPU cluster without a GPU:
``target_mesh`` (a mesh of the cluster's deviceless devices) and
``compile_for_target`` (our plan compiled by XLA's GPU compiler for the target,
with planned/final/stock step times; ``TargetResult``).
"""

from concerto_jax.api import ConcertoFallbackWarning, OptimizedStep, optimize
from concerto_jax.deviceless.compile import target_mesh
from concerto_jax.deviceless.program import TargetFallbackWarning, TargetResult, compile_for_target
from concerto_jax.first_step_policy import FirstStepMismatch
from concerto_jax.jax_compat import UnsupportedJaxVersion
from concerto_jax.options import (
           DecomposeOptions,
           DevicelessOptions,
           OptimizeOptions,
           Options,
           ScheduleOptions,
)
from concerto_jax.report import Report

__all__ = ["ConcertoFallbackWarning", "DecomposeOptions", "DevicelessOptions", "FirstStepMismatch",
           "OptimizeOptions", "OptimizedStep", "Options",
           "Report", "ScheduleOptions", "TargetFallbackWarning", "TargetResult", "UnsupportedJaxVersion", "compile_for_target",
           "optimize", "target_mesh"]
