"""IR -> HLO text, in XLA's own layout so that text XLA printed round-trips byte for byte."""

from __future__ import annotations

from hlo_passes.ir.computation import Computation
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.module import HloModule

__all__ = ["module_to_text", "computation_to_text", "instruction_to_text", "signature_text"]


def _join_indexed(items: list[str]) -> str:
    """``a, b, c, d, e, /*index=5*/f``: XLA's separator for long lists."""
    if len(items) <= 5:
        return ", ".join(items)
    parts = [items[0]]
    for i in range(1, len(items)):
        parts.append(f", /*index={i}*/" if i % 5 == 0 else ", ")
        parts.append(items[i])
    return "".join(parts)


def _value_text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "{" + ", ".join("%" + v.name for v in value) + "}"
    return "%" + value.name  # a Computation


def instruction_to_text(inst: Instruction, *, root: bool | None = None) -> str:
    """One instruction line, without indentation or newline.

    Args:
      inst: the instruction.
      root: print the ``ROOT`` marker; by default when ``inst`` is its computation's root.
    """
    if root is None:
        root = inst.parent is not None and inst.parent.root is inst
    if inst.opcode == "constant":
        args = inst.literal if inst.literal is not None else ""
    elif inst.opcode == "parameter":
        args = str(inst.parameter_number)
    else:
        ops = inst.operands
        if len(ops) <= 5:
            args = ", ".join(["%" + o.name if o is not None else "%<undefined>" for o in ops])
        else:
            args = _join_indexed(["%" + o.name for o in ops])
    parts = [f"{'ROOT ' if root else ''}%{inst.name} = {inst.shape} {inst.opcode}({args})"]
    for key, value in inst.attrs.items():
        parts.append(f", {key}={_value_text(value)}")
    return "".join(parts)


def signature_text(comp: Computation) -> str:
    """``(p0: f32[4], p1: s32[]) -> f32[4]``: the computation's program shape."""
    params = ", ".join(f"{p.name}: {p.shape.without_layout()}" for p in comp.parameters)
    result = comp.root.shape.without_layout() if comp.root is not None else "()"
    return f"({params}) -> {result}"


def computation_to_text(comp: Computation) -> str:
    """The computation: header line, indented instructions, closing brace."""
    head = f"{'ENTRY ' if comp.is_entry else ''}%{comp.name} {signature_text(comp)}"
    lines = [head + " {"]
    root = comp.root
    for inst in comp.instructions:
        lines.append("  " + instruction_to_text(inst, root=inst is root))
    # after the closing brace, where XLA's printer puts it
    lines.append("}" if comp.execution_thread is None else f"}}, execution_thread={comp.execution_thread}")
    return "\n".join(lines)


def module_to_text(module: HloModule) -> str:
    """The whole module as HLO text that XLA's parser accepts.

    Layout follows XLA's dumps: the header line, the verbatim FileNames/... sections,
    then the computations (callees first, ENTRY usually last) separated by blank lines.
    """
    head = "HloModule " + module.name + "".join(
        f", {k}={v}" for k, v in module.attrs.items())
    chunks = [head, ""]
    if module.sections:
        chunks += [module.sections, "", ""]
    for comp in module.computations:
        chunks += [computation_to_text(comp), ""]
    return "\n".join(chunks) + "\n"
