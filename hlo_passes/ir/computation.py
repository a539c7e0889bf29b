"""HLO computations: ordered instructions, post order and safe mutation helpers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from hlo_passes.ir.instruction import Instruction

if TYPE_CHECKING:
    from hlo_passes.ir.module import HloModule

__all__ = ["Computation"]


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
        from hlo_passes.ir.printer import computation_to_text  # lazy: the IR's cycle (printer)
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
