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

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from hlo_passes import attributes as _attrs
from hlo_passes import opcodes as _ops
from hlo_passes import replica_groups as _rg
from hlo_passes.shapes import Shape

__all__ = ["Instruction", "Computation", "HloModule"]


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
        from hlo_passes.printer import instruction_to_text
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
        """For the generic ``async-*`` family: the op its wrapped computation runs."""
        start = self if self.opcode == "async-start" else self.async_start()
        if start is None or start.opcode != "async-start":
            return None
        comps = start.called_computations
        if not comps or comps[0].root is None:
            return None
        root = comps[0].root
        if root.opcode in ("tuple", "get-tuple-element", "bitcast"):
            for inst in comps[0].instructions:
                if inst.opcode not in ("parameter", "tuple", "get-tuple-element", "bitcast"):
                    return inst
        return root

    @property
    def collective_kind(self) -> str | None:
        """Normalised kind (``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``,
        ``'all-to-all'``, ``'collective-permute'``, ...) of a collective or of any member
        of its async family (sugared or generic form); None otherwise."""
        kind = _ops.collective_kind_of_opcode(self.opcode)
        if kind is not None or not self.opcode.startswith("async-"):
            return kind
        wrapped = self.async_wrapped
        return None if wrapped is None else _ops.collective_kind_of_opcode(wrapped.opcode)

    @property
    def is_collective(self) -> bool:
        """True for collectives and the members of their async families."""
        return self.collective_kind is not None


class Computation:
    """An HLO computation: instructions in order (the schedule, when scheduled).

    Attributes:
      name: unique name (without ``%``).
      instructions: list of Instructions in order (mutate via methods).
      root: the ROOT instruction.
      is_entry: True for the ENTRY computation.
      module: the HloModule holding the computation, or None.
      execution_thread: raw ``execution_thread="..."`` value, or None.
    """

    __slots__ = ("name", "instructions", "root", "is_entry", "module",
                 "execution_thread", "_by_name")

    def __init__(self, name: str, instructions: Iterable[Instruction] = (),
                 root: Instruction | None = None, is_entry: bool = False):
        self.name = name
        self.instructions: list[Instruction] = []
        self._by_name: dict[str, Instruction] = {}
        self.root = None
        self.is_entry = is_entry
        self.module: HloModule | None = None
        self.execution_thread: str | None = None
        for inst in instructions:
            self._append(inst)
        self.root = root if root is not None else (
            self.instructions[-1] if self.instructions else None)

    def _append(self, inst: Instruction) -> None:
        if inst.name in self._by_name:
            raise ValueError(f"duplicate instruction name %{inst.name} in %{self.name}")
        inst.parent = self
        self.instructions.append(inst)
        self._by_name[inst.name] = inst

    def __repr__(self) -> str:
        from hlo_passes.printer import computation_to_text
        return computation_to_text(self)

    def __len__(self) -> int:
        return len(self.instructions)

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)

    def __contains__(self, inst) -> bool:
        return isinstance(inst, Instruction) and self._by_name.get(inst.name) is inst

    def instruction(self, name: str) -> Instruction:
        """The instruction called ``name`` (KeyError if none)."""
        return self._by_name[name.lstrip("%")]

    @property
    def parameters(self) -> list[Instruction]:
        """Parameter instructions ordered by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number)

    def post_order(self) -> list[Instruction]:
        """A topological order of all instructions (operands and control predecessors
        first), equal to ``instructions`` whenever that already is one."""
        visited: set[int] = set()
        order: list[Instruction] = []
        for top in self.instructions:
            if id(top) in visited:
                continue
            visited.add(id(top))
            stack = [(top, iter(top.operands + top.control_predecessors))]
            while stack:
                inst, it = stack[-1]
                for dep in it:
                    if id(dep) not in visited and dep.parent is self:
                        visited.add(id(dep))
                        stack.append((dep, iter(dep.operands + dep.control_predecessors)))
                        break
                else:
                    stack.pop()
                    order.append(inst)
        return order

    # -- mutation ------------------------------------------------------------------
    def _unique(self, name: str) -> str:
        if self.module is not None:
            return self.module.unique_name(name)
        base, n = name, 0
        while name in self._by_name:
            n += 1
            name = f"{base}.{n}"
        return name

    def add_instruction(self, inst: Instruction, *, before: Instruction | None = None,
                        after: Instruction | None = None) -> Instruction:
        """Inserts ``inst`` (at the end, or before/after another), renaming it if its
        name is taken. Its operands must already be in this computation."""
        if inst.parent is not None:
            raise ValueError(f"%{inst.name} already belongs to %{inst.parent.name}")
        taken = inst.name in self._by_name or (
            self.module is not None and self.module.has_name(inst.name))
        if taken:
            inst.name = self._unique(inst.name)
        if self.module is not None:
            self.module.register_name(inst.name)
        if before is not None:
            index = self.instructions.index(before)
        elif after is not None:
            index = self.instructions.index(after) + 1
        else:
            index = len(self.instructions)
        inst.parent = self
        self.instructions.insert(index, inst)
        self._by_name[inst.name] = inst
        return inst

    def remove_instruction(self, inst: Instruction) -> None:
        """Removes an instruction that has no users and is not the root."""
        if inst.users:
            raise ValueError(f"cannot remove %{inst.name}: still used by "
                             + ", ".join("%" + u.name for u in inst.users))
        if inst is self.root:
            raise ValueError(f"cannot remove %{inst.name}: it is the ROOT of %{self.name}")
        inst.set_operands(())
        for other in self.instructions:
            if inst in other.control_predecessors:
                other.remove_control_predecessor(inst)
        self.instructions.remove(inst)
        del self._by_name[inst.name]
        if self.module is not None:
            self.module.release_name(inst.name)
        inst.parent = None

    def replace_all_uses(self, old: Instruction, new: Instruction) -> None:
        """Makes every user of ``old`` (and the root slot) use ``new`` instead."""
        for user in list(old.users):
            if user is not new:
                user.replace_operand(old, new)
        if self.root is old:
            self.root = new

    def replace_instruction(self, old: Instruction, new: Instruction) -> None:
        """Adds ``new`` right after ``old`` if it is not here yet, moves all uses of
        ``old`` to it and removes ``old``."""
        if new.parent is None:
            self.add_instruction(new, after=old)
        self.replace_all_uses(old, new)
        self.remove_instruction(old)

    def rename(self, inst: Instruction, name: str) -> str:
        """Renames ``inst`` to ``name`` or, if taken, a unique variant; returns it."""
        if name == inst.name:
            return name
        del self._by_name[inst.name]
        if self.module is not None:
            self.module.release_name(inst.name)
        name = self._unique(name)
        if self.module is not None:
            self.module.register_name(name)
        inst.name = name
        self._by_name[name] = inst
        return name

    def set_order(self, order: Sequence[Instruction]) -> None:
        """Reorders the instructions; ``order`` must be a permutation of them."""
        if len(order) != len(self.instructions) or {id(i) for i in order} != {
                id(i) for i in self.instructions}:
            raise ValueError(f"new order of %{self.name} is not a permutation of its instructions")
        self.instructions = list(order)


class HloModule:
    """An HLO module.

    Attributes:
      name: module name.
      attrs: ordered ``{name: raw text}`` of the ``HloModule`` header line
        (``entry_computation_layout``, ``is_scheduled``, ``num_partitions``, ...).
      sections: verbatim text of the FileNames/FunctionNames/FileLocations/
        StackFrames blocks ("" when absent).
      computations: list of Computations in printing order (callees first).
    """

    __slots__ = ("name", "attrs", "sections", "computations", "_by_name", "_names")

    def __init__(self, name: str, attrs: dict[str, str] | None = None, sections: str = ""):
        self.name = name
        self.attrs = {} if attrs is None else attrs
        self.sections = sections
        self.computations: list[Computation] = []
        self._by_name: dict[str, Computation] = {}
        self._names: set[str] | None = None

    def __str__(self) -> str:
        from hlo_passes.printer import module_to_text
        return module_to_text(self)

    def __repr__(self) -> str:
        lines = str(self).splitlines()
        return "\n".join(lines[:40] + ([f"... ({len(lines) - 40} more lines)"]
                                       if len(lines) > 40 else []))

    def to_text(self) -> str:
        """The module as HLO text (see :func:`hlo_passes.printer.module_to_text`)."""
        return str(self)

    @property
    def entry(self) -> Computation:
        for comp in self.computations:
            if comp.is_entry:
                return comp
        raise ValueError(f"module {self.name} has no ENTRY computation")

    def computation(self, name: str) -> Computation:
        """The computation called ``name`` (KeyError if none)."""
        return self._by_name[name.lstrip("%")]

    def instructions(self) -> Iterator[Instruction]:
        """Every instruction of every computation, computations in order."""
        for comp in self.computations:
            yield from comp.instructions

    def add_computation(self, comp: Computation, *, before: Computation | None = None) -> None:
        """Adds a computation (before ``before``, else before the entry, else last)."""
        if comp.name in self._by_name:
            base, n = comp.name, 0
            while comp.name in self._by_name:
                n += 1
                comp.name = f"{base}.{n}"
        if before is None and any(c.is_entry for c in self.computations):
            before = self.entry
        index = self.computations.index(before) if before is not None else len(self.computations)
        self.computations.insert(index, comp)
        self._by_name[comp.name] = comp
        comp.module = self
        for inst in comp.instructions:
            if self.has_name(inst.name):
                comp.rename(inst, inst.name)  # uniquify against the module
            else:
                self.register_name(inst.name)

    def remove_computation(self, comp: Computation) -> None:
        """Removes a computation (the caller makes sure nothing calls it)."""
        self.computations.remove(comp)
        del self._by_name[comp.name]
        if self._names is not None:
            self._names.difference_update(i.name for i in comp.instructions)
        comp.module = None

    # -- names -----------------------------------------------------------------------
    def _name_set(self) -> set[str]:
        if self._names is None:
            self._names = {i.name for i in self.instructions()}
        return self._names

    def has_name(self, name: str) -> bool:
        return name in self._name_set()

    def register_name(self, name: str) -> None:
        self._name_set().add(name)

    def release_name(self, name: str) -> None:
        self._name_set().discard(name)

    def unique_name(self, base: str) -> str:
        """``base`` if no instruction of the module has it, else ``base.N``."""
        names = self._name_set()
        if base not in names:
            return base
        n = 1
        while f"{base}.{n}" in names:
            n += 1
        return f"{base}.{n}"

    # -- header attributes -------------------------------------------------------------
    def _int_attr(self, key: str, default: int) -> int:
        raw = self.attrs.get(key)
        return default if raw is None else int(raw)

    @property
    def num_partitions(self) -> int:
        return self._int_attr("num_partitions", 1)

    @num_partitions.setter
    def num_partitions(self, value: int) -> None:
        self.attrs["num_partitions"] = str(int(value))

    @property
    def replica_count(self) -> int:
        return self._int_attr("replica_count", 1)

    @replica_count.setter
    def replica_count(self, value: int) -> None:
        self.attrs["replica_count"] = str(int(value))

    @property
    def num_devices(self) -> int:
        """``num_partitions * replica_count``."""
        return self.num_partitions * self.replica_count

    @property
    def is_scheduled(self) -> bool:
        return self.attrs.get("is_scheduled") == "true"

    @is_scheduled.setter
    def is_scheduled(self, value: bool) -> None:
        if value:
            self.attrs["is_scheduled"] = "true"
        else:
            self.attrs.pop("is_scheduled", None)

    @property
    def entry_computation_layout(self) -> str | None:
        return self.attrs.get("entry_computation_layout")

    @property
    def frontend_attributes(self) -> str | None:
        return self.attrs.get("frontend_attributes")
