"""Emit: a per-device module as a *scheduled* HLO module with explicit async collective pairs.

Each computation's order is its schedule. Every synchronous collective
becomes a start/done pair in the form XLA 0.10.2 prints in its final GPU modules:

===================  ========================================================  ==================
collective           start (shape)                                              done
===================  ========================================================  ==================
all-reduce           ``all-reduce-start`` (the result shape)                   ``all-reduce-done``
all-gather           ``all-gather-start`` ((operand, result))                  ``all-gather-done``
collective-permute   ``collective-permute-start`` ((operand, result))          ``collective-permute-done``
reduce-scatter       ``reduce-scatter-start`` (((operands), result)), the       ``reduce-scatter-done``
                     sugared ``async-start`` wrapping one reduce-scatter
all-to-all           ``all-to-all-start`` (((operands), result)), same form     ``all-to-all-done``
===================  ========================================================  ==================

The start sits where the collective was (its START event in the plan); the done
right before the collective's first real reader (its DONE event: every reader
waits for it, nothing else does), so the compute between them is the planned
overlap. The header gets ``is_scheduled=true``. XLA's own parser checks the
result (``emit_scheduled``). Tuple-shaped (multi-operand) all-reduces and
all-gathers keep their synchronous form.
"""

from __future__ import annotations

from hlo_passes.ir import (
    Computation,
    HloModule,
    Instruction,
    alias_closure,
    module_to_text,
    parse_module,
    xla_parse,
)
from hlo_passes.ir.shapes import Shape

__all__ = ["ASYNC_FORMS", "emit_scheduled", "to_async_pairs"]


def _result_only(inst: Instruction) -> Shape:
    return inst.shape


def _operand_and_result(inst: Instruction) -> Shape:
    return Shape.tuple_of([inst.operands[0].shape, inst.shape])


def _operands_tuple_and_result(inst: Instruction) -> Shape:
    return Shape.tuple_of([Shape.tuple_of([o.shape for o in inst.operands]), inst.shape])


ASYNC_FORMS = {
    "all-reduce": _result_only,
    "all-gather": _operand_and_result,
    "collective-permute": _operand_and_result,
    "reduce-scatter": _operands_tuple_and_result,
    "all-to-all": _operands_tuple_and_result,
}
"""Shape of the start instruction per collective opcode (rule table; see module docstring)."""


def to_async_pairs(module: HloModule, comp: Computation | None = None) -> int:
    """Turn the synchronous collectives of ``comp`` (default: the entry) into start/done pairs.

    Returns:
      The number of collectives converted.
    """
    comp = module.entry if comp is None else comp
    count = 0
    for c in [i for i in comp.instructions if i.opcode in ASYNC_FORMS]:
        if c.shape.is_tuple or any(o.shape.is_tuple for o in c.operands):
            continue
        if c.opcode in ("all-gather", "collective-permute") and len(c.operands) != 1:
            continue
        insts = list(comp.instructions)
        pos = {id(i): k for k, i in enumerate(insts)}
        aliases = alias_closure(c)
        readers = [pos[id(u)] for a in aliases for u in a.users if u not in aliases]
        if comp.root is c:
            readers.append(len(insts))
        end = min(readers, default=len(insts))
        start = Instruction(module.unique_name(f"{c.opcode}-start"), f"{c.opcode}-start",
                            ASYNC_FORMS[c.opcode](c), list(c.operands), dict(c.attrs))
        done = Instruction(module.unique_name(f"{c.opcode}-done"), f"{c.opcode}-done", c.shape, [start],
                           {k: v for k, v in c.attrs.items() if k == "metadata"})
        comp.add_instruction(start, before=c)
        comp.add_instruction(done, before=c)
        was_root = comp.root is c
        comp.replace_all_uses(c, done)
        if was_root:
            comp.root = done
        comp.remove_instruction(c)
        # Aliases of c (get-tuple-element/bitcast) follow the done; the done precedes the first reader.
        moved = [a for a in comp.instructions if a in aliases and a is not c]
        rest = [i for i in comp.instructions if i not in moved and i is not done]
        anchor = insts[end] if end < len(insts) else None
        if anchor is not None and anchor in rest:
            j = rest.index(anchor)
        elif comp.root in rest:
            j = rest.index(comp.root)
        else:
            j = len(rest)
        comp.set_order(rest[:j] + [done] + moved + rest[j:])
        count += 1
    return count


def emit_scheduled(text: str) -> str:
    """The module in ``text`` as a scheduled module with async collective pairs.

    Raises:
      hlo_passes.HloError: the text does not parse.
      RuntimeError: XLA's parser rejects the result (a bug here).
    """
    module = parse_module(text, source="emit")
    for comp in module.computations:  # entry, call and while bodies: wherever collectives sit
        to_async_pairs(module, comp)
    module.is_scheduled = True
    out = module_to_text(module)
    try:
        xla_parse(out)
    except Exception as e:
        raise RuntimeError(f"XLA's parser rejected the scheduled module: {e}") from e
    return out
