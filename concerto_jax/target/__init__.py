"""Target clusters and deviceless GPU compilation (needs ``pip install -e .[gpu]``).

Pipeline: ``Cluster`` (``concerto_jax.costmodel.cluster``) -> ``topology`` /
``target_mesh`` -> ``compile_lowered`` / ``compile_for_target`` -> ``TargetCompile``
(XLA's final scheduled module, and the modules before/after its latency hiding
scheduler), optionally steered by a PGLE profile from our cost model (``pgle``).
"""

from concerto_jax.costmodel.cluster import CLUSTERS, Cluster, get_cluster
from concerto_jax.target.compile import (
    CompileOptions,
    GpuPluginMissingError,
    TargetCompile,
    compile_for_target,
    compile_lowered,
    gpu_plugin_available,
    require_gpu_plugin,
    target_mesh,
    topology,
)
from concerto_jax.target.pgle import costs_from_graph, profile_text, write_profile

__all__ = [
    "CLUSTERS", "Cluster", "CompileOptions", "GpuPluginMissingError", "TargetCompile",
    "compile_for_target", "compile_lowered", "costs_from_graph", "get_cluster", "gpu_plugin_available",
    "profile_text", "require_gpu_plugin", "target_mesh", "topology", "write_profile",
]
