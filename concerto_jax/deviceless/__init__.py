"""Target clusters and deviceless GPU compilation (needs ``pip install -e .[gpu]``).

Pipeline: ``Cluster`` (``concerto_jax.costmodel.cluster``) -> ``topology`` /
``target_mesh`` -> ``compile_lowered`` / ``compile_fn`` -> ``TargetCompile``
(XLA's final scheduled module, and the modules before/after its latency hiding
scheduler), optionally steered by a PGLE profile from our cost model (``pgle``).

``compile_for_target`` (``program``) runs the optimize pipeline on a step, has XLA's
backend compile our order of XLA's own scheduled module through the PJRT C API
(``pjrt_c``, ``native``; or pins the plan with opt-barriers, ``via="pin"``), and measures
planned vs final vs stock step times (``fidelity``).
"""

from concerto_jax.costmodel.cluster import CLUSTERS, Cluster, get_cluster
from concerto_jax.deviceless.compile import (
    CompileOptions,
    GpuPluginMissingError,
    TargetCompile,
    compile_fn,
    compile_lowered,
    gpu_plugin_available,
    require_gpu_plugin,
    target_mesh,
    topology,
)
from concerto_jax.deviceless.pgle import costs_from_graph, profile_text, write_profile
from concerto_jax.deviceless.program import TargetFallbackWarning, TargetResult, compile_for_target

__all__ = [
    "CLUSTERS", "Cluster", "CompileOptions", "GpuPluginMissingError", "TargetCompile",
    "TargetFallbackWarning", "TargetResult",
    "compile_fn", "compile_for_target", "compile_lowered", "costs_from_graph", "get_cluster",
    "gpu_plugin_available", "profile_text", "require_gpu_plugin", "target_mesh", "topology", "write_profile",
]
