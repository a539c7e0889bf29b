"""HLO instructions: operands/users edges, raw attributes with typed accessors, async and collective views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hlo_passes.ir import attributes as _attrs
from hlo_passes.ir import opcodes as _ops
from hlo_passes.ir import replica_groups as _rg
from hlo_passes.ir.shapes import Shape

if TYPE_CHECKING:
    from hlo_passes.ir.computation import Computation

__all__ = ["Instruction"]


class Instruction:
    """One HLO instruction.

    Attributes:
      name: unique name (without ``%``).
      opcode: e.g. ``"add"``, ``"all-reduce-start"``, ``"fusion"``.
      shape: result :class:`Shape`.
      operands: list of operand Instructions (mutate via :meth:`replace_operand`).
      users: list of distinct Instructions using this one as an operand.
      attrs: ordered ``{name: value}``; value is the raw text, a Computation, a list of
        Computations (``branch_computations``...) or a list of Instructions
        (``control-predecessors``).
      parent: the Computation holding the instruction, or None.
      literal: raw literal text of a ``constant`` (what is between its parentheses).
      parameter_number: the number of a ``parameter``.
    """

    __slots__ = ("name", "opcode", "shape", "operands", "users", "attrs", "parent",
                 "literal", "parameter_number")

    def __init__(self, name: str, opcode: str, shape: Shape,
                 operands: Sequence[Instruction] = (), attrs: dict | None = None, *,
                 literal: str | None = None, parameter_number: int | None = None):
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self.operands = list(operands)
        self.users: list[Instruction] = []
        self.attrs = {} if attrs is None else attrs
        self.parent: Computation | None = None
        self.literal = literal
        self.parameter_number = parameter_number
        for op in self.operands:
            if self not in op.users:
                op.users.append(self)

    def __repr__(self) -> str:
        from hlo_passes.ir.printer import instruction_to_text  # lazy: the IR's cycle (printer)
        return instruction_to_text(self)

    # -- generic attribute access -----------------------------------------------
    def attr(self, key: str, default=None):
        """The value of attribute ``key`` (raw text or IR objects), or ``default``."""
        return self.attrs.get(key, default)

    def set_attr(self, key: str, value) -> None:
        """Sets attribute ``key`` (appended if new); ``None`` removes it."""
        if value is None:
            self.attrs.pop(key, None)
        else:
            self.attrs[key] = value

    def _raw(self, key):
        return self.attrs.get(key)

    # -- graph edits ---------------------------------------------------------------
    def replace_operand(self, old: Instruction | int, new: Instruction) -> None:
        """Replaces operand ``old`` (an Instruction: every occurrence; or an index)."""
        if isinstance(old, int):
            indices, old_inst = [old], self.operands[old]
        else:
            indices, old_inst = [i for i, o in enumerate(self.operands) if o is old], old
            if not indices:
                raise ValueError(f"%{old.name} is not an operand of %{self.name}")
        for i in indices:
            self.operands[i] = new
        if old_inst is not new and not any(o is old_inst for o in self.operands):
            old_inst.users.remove(self)
        if self not in new.users:
            new.users.append(self)

    def set_operands(self, operands: Sequence[Instruction]) -> None:
        """Replaces the whole operand list, keeping users consistent."""
        for op in self.operands:
            if self in op.users:
                op.users.remove(self)
        self.operands = list(operands)
        for op in self.operands:
            if self not in op.users:
                op.users.append(self)

    @property
    def control_predecessors(self) -> list[Instruction]:
        """Instructions that must run before this one (no data edge)."""
        return self.attrs.get("control-predecessors", [])

    def add_control_predecessor(self, pred: Instruction) -> None:
        preds = self.attrs.setdefault("control-predecessors", [])
        if pred not in preds:
            preds.append(pred)

    def remove_control_predecessor(self, pred: Instruction) -> None:
        preds = self.attrs.get("control-predecessors", [])
        if pred in preds:
            preds.remove(pred)
        if not preds:
            self.attrs.pop("control-predecessors", None)

    # -- raw well-known attributes -------------------------------------------------
    metadata = property(lambda self: self.attrs.get("metadata"),
                        lambda self, v: self.set_attr("metadata", v),
                        doc="Raw ``metadata={...}`` text, or None.")
    sharding = property(lambda self: self.attrs.get("sharding"),
                        lambda self, v: self.set_attr("sharding", v),
                        doc="Raw ``sharding={...}`` text, or None.")
    backend_config = property(lambda self: self.attrs.get("backend_config"),
                              lambda self, v: self.set_attr("backend_config", v),
                              doc="Raw ``backend_config`` text (JSON in braces or a string).")
    frontend_attributes = property(lambda self: self.attrs.get("frontend_attributes"),
                                   lambda self, v: self.set_attr("frontend_attributes", v),
                                   doc="Raw ``frontend_attributes={...}`` text, or None.")

    # -- typed accessors -------------------------------------------------------------
    @property
    def called_computations(self) -> list[Computation]:
        """Computations named by this instruction's attributes, in attribute order."""
        out = []
        for key, value in self.attrs.items():
            if key in _ops.CALLED_COMPUTATION_ATTRS:
                out.extend(value if isinstance(value, list) else [value])
        return out

    @property
    def to_apply(self) -> Computation | None:
        return self.attrs.get("to_apply")

    @to_apply.setter
    def to_apply(self, comp: Computation | None) -> None:
        self.set_attr("to_apply", comp)

    @property
    def channel_id(self) -> int | None:
        raw = self._raw("channel_id")
        return None if raw is None else _attrs.parse_int(raw)

    @channel_id.setter
    def channel_id(self, value: int | None) -> None:
        self.set_attr("channel_id", None if value is None else str(int(value)))

    @property
    def dimensions(self) -> list[int] | None:
        raw = self._raw("dimensions")
        return None if raw is None else _attrs.parse_int_list(raw)

    @dimensions.setter
    def dimensions(self, value) -> None:
        self.set_attr("dimensions", None if value is None else _attrs.format_int_list(value))

    @property
    def use_global_device_ids(self) -> bool:
        raw = self._raw("use_global_device_ids")
        return False if raw is None else _attrs.parse_bool(raw)

    @use_global_device_ids.setter
    def use_global_device_ids(self, value: bool) -> None:
        self.set_attr("use_global_device_ids", "true" if value else None)

    @property
    def tuple_index(self) -> int | None:
        """``index=`` of a get-tuple-element."""
        raw = self._raw("index")
        return None if raw is None else _attrs.parse_int(raw)

    @property
    def replica_groups(self) -> list[list[int]] | None:
        """Expanded replica groups (any textual form); ``[]`` means all; None if absent."""
        raw = self._raw("replica_groups")
        return None if raw is None else _rg.parse_replica_groups(raw)

    @replica_groups.setter
    def replica_groups(self, groups) -> None:
        self.set_attr("replica_groups",
                      None if groups is None else _rg.format_replica_groups(groups))

    @property
    def source_target_pairs(self) -> list[tuple[int, int]] | None:
        raw = self._raw("source_target_pairs")
        return None if raw is None else _attrs.parse_pairs(raw)

    @source_target_pairs.setter
    def source_target_pairs(self, pairs) -> None:
        self.set_attr("source_target_pairs", None if pairs is None else _attrs.format_pairs(pairs))

    @property
    def custom_call_target(self) -> str | None:
        raw = self._raw("custom_call_target")
        return None if raw is None else _attrs.parse_string(raw)

    # -- collectives and async pairs -------------------------------------------------
    @property
    def async_role(self) -> str | None:
        """``'start'``, ``'update'`` or ``'done'`` for members of an async family
        (``async-start``, sugared ``all-reduce-start``, ``send``/``recv``, ...), else None."""
        parts = _ops.async_parts(self.opcode)
        return None if parts is None else parts[1]

    def async_start(self) -> Instruction | None:
        """For a done/update: the start it completes (through updates); else None."""
        inst = self
        while inst.async_role in ("done", "update"):
            if not inst.operands:
                return None
            inst = inst.operands[0]
        return inst if inst is not self and inst.async_role == "start" else None

    @property
    def async_wrapped(self) -> Instruction | None:
        """For the generic ``async-*`` family and ``fusion-start/done``: the op it runs.

        That is the op of an ``async-start``'s wrapped computation, or, where that op (or a
        ``fusion-start``) is a collective kernel fusion (XLA:GPU's Triton one-shot
        all-reduce, jaxlib >= 0.11: a fusion whose root is a collective), the collective
        inside it, which carries the replica groups.
        """
        start = self if self.async_role == "start" else self.async_start()
        if start is None:
            return None
        if start.opcode == "fusion-start":
            return _fused_collective(start) or start
        if start.opcode != "async-start":
            return None
        comps = start.called_computations
        if not comps or comps[0].root is None:
            return None
        op = _root_op(comps[0])
        return (_fused_collective(op) or op) if op.opcode == "fusion" else op

    @property
    def collective_op(self) -> Instruction | None:
        """The instruction that carries this collective's attributes (replica groups,
        ``to_apply``): itself for a sync or sugared async collective, the wrapped op for
        the generic ``async-*`` family, the collective inside a collective kernel fusion;
        None for a non-collective."""
        if self.collective_kind is None:
            return None
        if self.opcode == "fusion":
            return _fused_collective(self)
        if self.opcode.startswith("async-") or self.opcode.startswith("fusion-"):
            return self.async_wrapped
        return self

    @property
    def collective_kind(self) -> str | None:
        """Normalised kind (``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``,
        ``'all-to-all'``, ``'collective-permute'``, ...) of a collective or of any member
        of its async family (sugared or generic form), collective kernel fusions
        included (sync ``fusion`` or async); None otherwise."""
        opcode = self.opcode
        kind = _ops.collective_kind_of_opcode(opcode)
        if kind is not None:
            return kind
        if opcode == "fusion":
            wrapped = _fused_collective(self)
        elif opcode.startswith("async-") or opcode.startswith("fusion-"):
            wrapped = self.async_wrapped
        else:
            return None
        return None if wrapped is None else _ops.collective_kind_of_opcode(wrapped.opcode)

    @property
    def is_collective(self) -> bool:
        """True for collectives and the members of their async families."""
        return self.collective_kind is not None

    @property
    def is_collective_kernel(self) -> bool:
        """True for a collective kernel fusion (XLA:GPU >= 0.11 runs small all-reduces as
        Triton kernels that read the peers' buffers over NVLink) in any form: a synchronous
        ``fusion``, ``fusion-start``/``-done``, or the ``async-start``/``-done`` wrapping one."""
        if self.opcode == "fusion":
            return _fused_collective(self) is not None
        if self.async_role is None:
            return False
        start = self if self.async_role == "start" else self.async_start()
        if start is None:
            return False
        if start.opcode == "fusion-start":
            return _fused_collective(start) is not None
        if start.opcode != "async-start":
            return False
        comps = start.called_computations
        if not comps or comps[0].root is None:
            return False
        op = _root_op(comps[0])
        return op.opcode == "fusion" and _fused_collective(op) is not None


_WRAPPER_OPCODES = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast"})


def _root_op(comp) -> Instruction:
    """The op a wrapper computation runs: its root, or the first op under a tuple/bitcast root."""
    root = comp.root
    if root.opcode in _WRAPPER_OPCODES:
        for inst in comp.instructions:
            if inst.opcode not in _WRAPPER_OPCODES:
                return inst
    return root


def _fused_collective(fusion: Instruction) -> Instruction | None:
    """The collective a collective kernel fusion runs (its called computation's root op), or None."""
    comps = fusion.called_computations
    if not comps or comps[0].root is None:
        return None
    op = _root_op(comps[0])
    return op if _ops.collective_kind_of_opcode(op.opcode) is not None else None
