"""Decomposition of critical collectives (Concerto ASPLOS'25 §5), deciding side.

Stages (one module each)::

    critical.py   predecessor / successor / independent-work rule on the task graph
    rules.py      SPMD decomposition rule per HLO opcode (one table, a default rule)
    context.py    BFS of the decomposition context along one axis, both directions
    cost.py       cost of a degree N (paper Eq. 1-3) with measured slowdown / overhead
    choose.py     CP-SAT choice across collectives whose contexts overlap
    search.py     candidates -> choice -> joint revision by scheduling + simulation

The rewrite itself is ``hlo_passes.decompose_rewrite``; the pass that runs it
all is ``concerto_jax.passes.decompose_pass`` (name ``"decompose"``).
"""

from concerto_jax.decompose.choose import Candidate, choose
from concerto_jax.decompose.context import Context, build_context
from concerto_jax.decompose.cost import Calibration, StrategyCost, strategy_cost
from concerto_jax.decompose.critical import Criticality, find_critical
from concerto_jax.decompose.options import DecomposeOptions
from concerto_jax.decompose.rules import DEFAULT_RULE, RULES, axis_map

__all__ = [
    "Calibration", "Candidate", "Context", "Criticality", "DEFAULT_RULE", "DecomposeOptions",
    "RULES", "StrategyCost", "axis_map", "build_context", "choose", "find_critical",
    "strategy_cost",
]
