"""Opcode tables: collectives, async start/update/done families, called-computation attributes."""

from __future__ import annotations

__all__ = [
    "CALLED_COMPUTATION_ATTRS", "COLLECTIVE_OPCODES", "ASYNC_START", "ASYNC_DONE",
    "ASYNC_UPDATE", "collective_kind_of_opcode",
]

CALLED_COMPUTATION_ATTRS = frozenset({
    "to_apply", "calls", "condition", "body", "branch_computations",
    "true_computation", "false_computation", "called_computations", "select",
    "scatter",
})
"""Attribute names whose values name computations (``%c`` or ``{%a, %b}``)."""

COLLECTIVE_OPCODES: dict[str, str] = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-reduce-done": "all-reduce",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-gather-done": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-permute-done": "collective-permute",
    "collective-broadcast": "collective-broadcast",
    "send": "send",
    "send-done": "send",
    "recv": "recv",
    "recv-done": "recv",
}
"""Opcode -> normalised collective kind, for the opcodes that are collectives
themselves (the generic ``async-*`` family is resolved through its wrapped
computation, see :attr:`Instruction.collective_kind`)."""

ASYNC_START: dict[str, str] = {
    "all-reduce-start": "all-reduce-done",
    "all-gather-start": "all-gather-done",
    "collective-permute-start": "collective-permute-done",
    "copy-start": "copy-done",
    "async-start": "async-done",
    "send": "send-done",
    "recv": "recv-done",
}
"""Start opcode -> the done opcode that must consume it."""

ASYNC_DONE: dict[str, str] = {done: start for start, done in ASYNC_START.items()}
"""Done opcode -> the start opcode it consumes."""

ASYNC_UPDATE = "async-update"
"""The generic async family's optional middle op (start -> update* -> done)."""


def collective_kind_of_opcode(opcode: str) -> str | None:
    """The normalised collective kind of an opcode, or None."""
    return COLLECTIVE_OPCODES.get(opcode)
