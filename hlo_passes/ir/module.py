"""HLO modules: header attributes, verbatim source sections, computations, unique names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hlo_passes.ir.computation import Computation
    from hlo_passes.ir.instruction import Instruction

__all__ = ["HloModule"]


class HloModule:
    """An HLO module.

    Attributes:
      name: module name.
      attrs: ordered ``{name: raw text}`` of the ``HloModule`` header line
        (``entry_computation_layout``, ``is_scheduled``, ``num_partitions``, ...).
      sections: verbatim text of the FileNames/FunctionNames/FileLocations/
        StackFrames blocks ("" when absent).
      computations: list of Computations in printing order (callees first).
      implicit_tuple_elements: names of the ``get-tuple-element`` instructions the parser
        made for operands written ``%x#k`` (they have no line in the parsed text).
    """

    __slots__ = ("name", "attrs", "sections", "computations", "implicit_tuple_elements",
                 "_by_name", "_names")

    def __init__(self, name: str, attrs: dict[str, str] | None = None, sections: str = ""):
        self.name = name
        self.attrs = {} if attrs is None else attrs
        self.sections = sections
        self.computations: list[Computation] = []
        self.implicit_tuple_elements: frozenset[str] = frozenset()
        self._by_name: dict[str, Computation] = {}
        self._names: set[str] | None = None

    def __str__(self) -> str:
        from hlo_passes.ir.printer import module_to_text  # lazy: the IR's cycle (printer)
        return module_to_text(self)

    def __repr__(self) -> str:
        lines = str(self).splitlines()
        return "\n".join(lines[:40] + ([f"... ({len(lines) - 40} more lines)"]
                                       if len(lines) > 40 else []))

    def to_text(self) -> str:
        """The module as HLO text (see :func:`hlo_passes.ir.printer.module_to_text`)."""
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
