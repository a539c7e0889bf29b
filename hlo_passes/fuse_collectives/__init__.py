"""Pass ``fuse_collectives``: merge compatible collectives into variadic ones, fused sizes chosen
by the cost model (Concerto ASPLOS'25 §4.5, Algorithm 1).

``grouping.py`` decides on the task graph (Algorithm 1: buckets grown while the rescheduled
makespan does not grow); ``rewrite.py`` rewrites the HLO (``fusion_key``: which collectives are
compatible; ``fuse_group``: one variadic collective plus ``get-tuple-element``s, bitwise equal).
The pass function is ``hlo_passes.fuse_collectives.run.fuse_pass``, reached through
``hlo_passes.registry`` (this face does not import it).
"""

from hlo_passes.fuse_collectives.grouping import (
    CostFn,
    FusionResult,
    alpha_beta,
    build_fused_graph,
    fuse_collectives,
)
from hlo_passes.fuse_collectives.rewrite import (
    FUSIBLE_OPCODES,
    cross_replica_variadic_all_reduces,
    fuse_group,
    fusion_key,
    stable_topological_order,
)

__all__ = ["FUSIBLE_OPCODES", "CostFn", "FusionResult", "alpha_beta", "build_fused_graph",
           "cross_replica_variadic_all_reduces", "fuse_collectives", "fuse_group", "fusion_key",
           "stable_topological_order"]
