"""Buffer aliases of an instruction: the users that only view its result."""

from __future__ import annotations

from hlo_passes.ir.instruction import Instruction

__all__ = ["ALIAS_USERS", "alias_closure"]

ALIAS_USERS = frozenset({"get-tuple-element", "bitcast"})
"""Users that view their operand's buffer (an element of it, or the same bytes)."""


def alias_closure(inst: Instruction) -> set[Instruction]:
    """``inst`` and its users reached through get-tuple-element/bitcast only."""
    out, todo = {inst}, [inst]
    while todo:
        for u in todo.pop().users:
            if u.opcode in ALIAS_USERS and u not in out:
                out.add(u)
                todo.append(u)
    return out
