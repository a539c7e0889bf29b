"""Helpers both loop rewrites share: clones with fresh names and channels, widened loop states."""

from __future__ import annotations

from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.shapes import Shape


def fresh_channel(module) -> int:
    """A channel id no instruction of ``module`` uses."""
    ids = [i.channel_id for i in module.instructions() if i.channel_id is not None]
    return max(ids, default=0) + 1


def clone_with_operands(inst: Instruction, operands, module) -> Instruction:
    """A copy of ``inst`` reading ``operands``, uniquely named in ``module`` (a fresh channel
    where it has one; no control predecessors)."""
    attrs = {k: v for k, v in inst.attrs.items() if k != "control-predecessors"}
    new = Instruction(module.unique_name(inst.name), inst.opcode, inst.shape, operands, attrs,
                      literal=inst.literal)
    if new.channel_id is not None:
        new.channel_id = fresh_channel(module)
    return new


def with_elements(shape: Shape, extra: list[Shape]) -> Shape:
    """The tuple ``shape`` with ``extra`` elements appended (a loop state that carries more)."""
    return Shape.tuple_of(list(shape.elements) + extra)
