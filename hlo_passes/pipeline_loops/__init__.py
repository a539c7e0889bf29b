"""Pass ``pipeline_loops``: loops whose collectives finish in the next iteration.

``prefetch.py``: the next iteration's FSDP all-gathers issued during this one (a prologue
gathers iteration 0); ``rotation.py``: a loop's last collective finished during the next
iteration (used by ``decompose`` after a split); ``loop_state.py``: what both rewrites share;
``decide.py``: whether each pays, judged on the loop body scheduled both ways. The pass
function is ``hlo_passes.pipeline_loops.run.pipeline_loops_pass``, reached through
``hlo_passes.registry`` (this face does not import it).
"""

from hlo_passes.pipeline_loops.decide import (
    ROTATION_CANDIDATES,
    ROTATION_MARGIN,
    ROTATION_MAX_CARRIED,
    decide_loop,
    decide_rotation,
)
from hlo_passes.pipeline_loops.prefetch import (
    PrefetchCandidate,
    loop_shape_problem,
    pipeline_prefetch,
    prefetch_candidates,
)
from hlo_passes.pipeline_loops.rotation import (
    RECOMPUTE_EXPANSION,
    Rotation,
    rotate_loop,
    rotation_candidates,
    rotation_of,
)

__all__ = [
    "RECOMPUTE_EXPANSION", "ROTATION_CANDIDATES", "ROTATION_MARGIN", "ROTATION_MAX_CARRIED",
    "PrefetchCandidate", "Rotation", "decide_loop", "decide_rotation", "loop_shape_problem",
    "pipeline_prefetch", "prefetch_candidates", "rotate_loop", "rotation_candidates", "rotation_of",
]
