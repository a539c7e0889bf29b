"""AutoCCL: online tuning of collective-communication settings during the first training steps.

Pipeline::

  SearchSpace (strategy choices x resource grids)      space.py
    | coordinate_descent / minimize                    search.py      (AutoCCL §4.2, Alg. 2)
    | OnlineTuner: next_config() / report(seconds)     online.py      (§4.3, warm-up + robust median)
    |   leader decides, broadcast to every process     coordination.py
    |   results kept per Signature                     store.py
    v
  tuned config -> applied for real
    bucket sizes: plan_buckets + bucketed DP step      buckets.py, dp_step.py
    XLA options / XLA_FLAGS, NCCL env                  knobs.py
    per-collective NCCL tuner plugin (C, v3/v4 API)    plugin.py, nccl_tuner/   (live table)
  GPU online loop: combine thresholds, then per-key   nccl_online.py, collectives.py
    (algorithm, protocol) x channels in the live table; OnlineNccl wraps a jitted step
                                                      gpu_step.py
    modelled DP step on the NCCL model (tests, bench) step_model.py

Public API (see each docstring):

* ``SearchSpace``, ``Choice``, ``IntGrid``, ``Config``, ``linear_grid``, ``geometric_grid``
* ``SearchOptions``, ``SearchResult``, ``minimize``, ``coordinate_descent``
* ``OnlineTuner``, ``TunerOptions``, ``TuningEvent``, ``TuningResult``
* ``Signature``, ``TuningStore``
* ``plan_buckets``, ``Bucket``, ``make_dp_step``, ``compile_dp_step``, ``count_all_reduces``
* ``gpu_combine_threshold_options``, ``cpu_compiler_options``, ``xla_flags``, ``nccl_env``
* ``OnlineNccl``, ``enable_plugin``, ``NcclTuningLoop``, ``NcclLoopOptions``, ``Candidate``,
  ``collective_sites``, ``assign_keys``, ``CollectiveKey``, ``CollectiveSite``,
  ``command_buffer_options``, ``step_model`` (module)
* ``plugin`` (module): ``build``, ``ensure_built``, ``TableRow``, ``write_table``,
  ``rows_from_configs``, ``plugin_env``
* ``nccl_model`` (module): the synthetic NCCL performance model used by benches/tests.

References:
  G. Xu et al., "AutoCCL: Automated Collective Communication Tuning for
  Accelerating Distributed and Parallel DNN Training", NSDI 2025.
"""

from concerto_jax.autoccl import nccl_model, plugin, step_model
from concerto_jax.autoccl.buckets import Bucket, plan_buckets
from concerto_jax.autoccl.collectives import (
    CollectiveKey,
    CollectiveSite,
    assign_keys,
    collective_sites,
)
from concerto_jax.autoccl.dp_step import compile_dp_step, count_all_reduces, make_dp_step
from concerto_jax.autoccl.gpu_step import OnlineNccl, enable_plugin
from concerto_jax.autoccl.knobs import (
    command_buffer_options,
    cpu_compiler_options,
    gpu_combine_threshold_options,
    nccl_env,
    xla_flags,
)
from concerto_jax.autoccl.nccl_online import Candidate, NcclLoopOptions, NcclTuningLoop
from concerto_jax.autoccl.online import OnlineTuner, TunerOptions, TuningEvent, TuningResult
from concerto_jax.autoccl.search import SearchOptions, SearchResult, coordinate_descent, minimize
from concerto_jax.autoccl.space import (
    Choice,
    Config,
    IntGrid,
    SearchSpace,
    geometric_grid,
    linear_grid,
)
from concerto_jax.autoccl.store import Signature, TuningStore

__all__ = [
    "Bucket",
    "Candidate",
    "CollectiveKey",
    "CollectiveSite",
    "NcclLoopOptions",
    "NcclTuningLoop",
    "OnlineNccl",
    "assign_keys",
    "collective_sites",
    "command_buffer_options",
    "enable_plugin",
    "step_model",
    "Choice",
    "Config",
    "IntGrid",
    "OnlineTuner",
    "SearchOptions",
    "SearchResult",
    "SearchSpace",
    "Signature",
    "TunerOptions",
    "TuningEvent",
    "TuningResult",
    "TuningStore",
    "compile_dp_step",
    "coordinate_descent",
    "count_all_reduces",
    "cpu_compiler_options",
    "geometric_grid",
    "gpu_combine_threshold_options",
    "linear_grid",
    "make_dp_step",
    "minimize",
    "nccl_env",
    "nccl_model",
    "plan_buckets",
    "plugin",
    "xla_flags",
]
