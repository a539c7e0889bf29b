"""Opcode tables: collectives, async start/update/done families, called-computation attributes."""

from __future__ import annotations

__all__ = [
    "ALIAS_OPCODES", "CALLED_COMPUTATION_ATTRS", "COLLECTIVE_KINDS", "async_parts",
    "collective_kind_of_opcode", "done_opcode",
]

ALIAS_OPCODES = frozenset({"bitcast", "get-tuple-element", "tuple", "opt-barrier"})
"""Opcodes that only alias their operands' buffers."""

CALLED_COMPUTATION_ATTRS = frozenset({
    "to_apply", "calls", "condition", "body", "branch_computations",
    "true_computation", "false_computation", "called_computations", "select",
    "scatter",
})
"""Attribute names whose values name computations (``%c`` or ``{%a, %b}``)."""

COLLECTIVE_KINDS = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
    "collective-permute", "collective-broadcast", "send", "recv",
})
"""Normalised collective kinds (the synchronous opcode names)."""

_ROLE_SUFFIXES = (("-start", "start"), ("-update", "update"), ("-done", "done"))


def async_parts(opcode: str) -> tuple[str, str] | None:
    """``(base, role)`` for a member of an async family, else None.

    ``role`` is ``'start'``, ``'update'`` or ``'done'``; ``base`` is ``'async'`` for the
    generic ``async-start/update/done`` (the wrapped op is in ``calls=``), else the
    wrapped opcode: XLA prints a single-op async wrapper in sugared form
    (``all-reduce-start``, ``reduce-scatter-start``, ``all-to-all-done``, ...), and
    ``send``/``recv`` start pairs closed by ``send-done``/``recv-done``;
    ``copy-start``/``copy-done`` are the copy family.
    """
    if opcode in ("send", "recv"):
        return opcode, "start"
    for suffix, role in _ROLE_SUFFIXES:
        if opcode.endswith(suffix) and len(opcode) > len(suffix):
            return opcode[: -len(suffix)], role
    return None


def done_opcode(start_opcode: str) -> str:
    """The opcode that closes an async start: ``all-reduce-start`` -> ``all-reduce-done``."""
    base, _ = async_parts(start_opcode)
    return base + "-done"


def collective_kind_of_opcode(opcode: str) -> str | None:
    """The normalised collective kind of an opcode (sync or sugared async), or None."""
    if opcode in COLLECTIVE_KINDS:
        return opcode
    parts = async_parts(opcode)
    if parts is not None and parts[0] in COLLECTIVE_KINDS:
        return parts[0]
    return None
