"""Cost model: time of every instruction of a per-device program on a target GPU cluster.

Pipeline: ``Cluster`` (GPUs, hosts, links; figures with sources, refined by the
shipped XLA target config) -> per-instruction cost (``compute``: FLOPs and
bytes against peak rates plus launch overhead; ``collectives``: alpha-beta per
algorithm over the replica group's placement) -> overridden by measured times
from a ``ProfileStore`` where present. ``hlo_ops``: the cost model's view of an IR
instruction (``op_info``), ``fused``: fusion-aware costs from XLA's scheduled module.
"""

from concerto_jax.costmodel.cluster import CLUSTERS, Cluster, get_cluster
from concerto_jax.costmodel.collectives import (
    COLLECTIVE_OPS,
    CollectiveCost,
    CollectiveOptions,
    bus_factor,
    collective_cost,
    collective_time_us,
)
from concerto_jax.costmodel.compute import (
    FREE_OPCODES,
    ArrayInfo,
    ComputeOptions,
    OpInfo,
    Work,
    compute_time_us,
    work_of,
    work_time_us,
)
from concerto_jax.costmodel.hlo_ops import array_leaves, is_kernel, op_info
from concerto_jax.costmodel.model import DEFAULT_OVERLAP_SLOWDOWN, CostModel, CostOptions
from concerto_jax.costmodel.profile_store import ProfileStore, signature
from concerto_jax.costmodel.specs import (
    A100_SXM_80,
    A800_SXM_80,
    H100_PCIE,
    H100_SXM,
    GpuSpec,
    LinkSpec,
)

__all__ = [
    "ArrayInfo", "ComputeOptions", "CostModel", "CostOptions", "DEFAULT_OVERLAP_SLOWDOWN", "FREE_OPCODES",
    "OpInfo", "ProfileStore", "Work", "compute_time_us", "signature", "work_of", "work_time_us",
    "A100_SXM_80", "A800_SXM_80", "CLUSTERS", "COLLECTIVE_OPS", "Cluster", "CollectiveCost",
    "CollectiveOptions", "GpuSpec", "H100_PCIE", "H100_SXM", "LinkSpec", "bus_factor",
    "collective_cost", "collective_time_us", "get_cluster", "array_leaves", "is_kernel", "op_info",
]
