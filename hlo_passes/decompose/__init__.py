"""Pass ``decompose``: split the computation around critical collectives (Concerto ASPLOS'25 §5).

One module per stage::

    critical.py   predecessor / successor / independent-work rule on the task graph
    rules.py      SPMD decomposition rule per HLO opcode (one table, a default rule)
    context.py    BFS of the decomposition context along one axis, both directions
    region.py     the region strategy: a collective's whole region as N micro-batches
    cost.py       cost of a degree N (paper Eq. 1-3) with measured slowdown / overhead
    choose.py     CP-SAT choice across collectives whose contexts overlap
    search.py     candidates -> choice -> joint revision by scheduling + simulation
    rewrite.py    the split itself, on the IR (slices, per-chunk ops, concatenates)
    options.py    DecomposeOptions
    run.py        the pass function ``decompose_pass``, reached through
                  ``hlo_passes.registry`` (this face does not import it)

Collectives of replicated operands, shrunk after either strategy, are
``hlo_passes.replicated_reductions``; a rotated loop is ``hlo_passes.pipeline_loops``.
"""

from hlo_passes.decompose.choose import Candidate, choose
from hlo_passes.decompose.context import Context, build_context
from hlo_passes.decompose.cost import Calibration, StrategyCost, strategy_cost
from hlo_passes.decompose.critical import Criticality, find_critical
from hlo_passes.decompose.options import DecomposeOptions
from hlo_passes.decompose.rules import DEFAULT_RULE, RULES, axis_map

__all__ = [
    "Calibration", "Candidate", "Context", "Criticality", "DEFAULT_RULE", "DecomposeOptions",
    "RULES", "StrategyCost", "axis_map", "build_context", "choose", "find_critical",
    "strategy_cost",
]
