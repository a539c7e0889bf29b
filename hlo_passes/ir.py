"""The HLO graph IR: Instruction, Computation and HloModule.

Attributes are kept as an insertion-ordered dict of raw strings so that the
printer reproduces what it parsed; the attributes that name other IR objects
hold objects instead (computations for ``to_apply``/``calls``/...; instructions
for ``control-predecessors``), so renaming or replacing them is safe. Typed
accessors (``channel_id``, ``replica_groups``, ``dimensions``, ...) parse the raw
text on demand and write it back on assignment.

Mutation goes through methods that keep ``operands``/``users`` consistent:
:meth:`Instruction.replace_operand`, :meth:`Computation.add_instruction`,
:meth:`Computation.remove_instruction`, :meth:`Computation.replace_all_uses`,
:meth:`Computation.rename`, :meth:`Computation.set_order`.
"""

from hlo_passes.computation import Computation
from hlo_passes.instruction import Instruction
from hlo_passes.module import HloModule

__all__ = ["Instruction", "Computation", "HloModule"]
