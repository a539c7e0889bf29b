"""Collectives of replicated operands: move ``1/h`` of the bytes over the group, gather the
rest over the orthogonal one (a step of pass ``decompose``, ``DecomposeOptions.replicated_reductions``).

``decide.py``: which collectives qualify (the operand proven equal over an orthogonal group)
and where the cost model says it pays; ``rewrite.py``: the rewrite on the IR.
"""

from hlo_passes.replicated_reductions.decide import plan_replicated_reductions
from hlo_passes.replicated_reductions.rewrite import split_replicated_collective

__all__ = ["plan_replicated_reductions", "split_replicated_collective"]
