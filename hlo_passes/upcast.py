"""A wider-precision twin of a module: the reference that tells reassociation from a wrong result.

``upcast_floats(module)`` rewrites a module in place so that every computation runs
one float precision wider: bf16 / f16 -> f32 where the module has half-precision
values (f32 is left as it is), otherwise f32 -> f64 (and c64 -> c128). The entry's
parameters and outputs keep their types (converted on the way in and out), so the
twin takes the same arguments and returns the same types as the original and can be
run in its place.

Ops whose meaning is tied to their element types run at their original types, with
their operands converted down and their results converted up: ``bitcast-convert``
(a u32 -> f32 bit pattern is how ``jax.random`` makes uniform floats), ``bitcast``
across types, custom calls, infeed / outfeed / send / recv. ``dot`` loses an
``algorithm=`` attribute (it names the operand types). ``reduce-precision`` keeps its
rounding: it is part of what the original computes.

Use: an exact rewrite that reassociates sums (``decompose``'s region split) gives
results that differ from the original's by rounding; after an optimizer that
amplifies rounding (Adam's first update is +-lr on the sign of each gradient) that
difference can be large, and only a more precise reference says whether the
rewritten step is as accurate as the original (``concerto_jax.first_step``).
"""

from __future__ import annotations

from hlo_passes.ir import Computation, HloModule, Instruction
from hlo_passes.ir.errors import HloError
from hlo_passes.ir.shapes import Shape

__all__ = ["UpcastError", "upcast_floats", "widening_of"]

_HALF = {"bf16": "f32", "f16": "f32"}
_SINGLE = {"f32": "f64", "c64": "c128"}
_NARROW = frozenset({"f8e3m4", "f8e4m3", "f8e4m3fn", "f8e4m3b11fnuz", "f8e4m3fnuz", "f8e5m2",
                     "f8e5m2fnuz", "f8e8m0fnu", "f4e2m1fn"})
# run at their original element types (operands converted down, results up)
_TYPE_BOUND = frozenset({"bitcast-convert", "custom-call", "infeed", "outfeed", "send", "recv",
                         "send-done", "recv-done"})


class UpcastError(HloError):
    """The module has nothing to widen, or values whose wider twin would mean something else."""


def _dtypes(shape: Shape, out: set) -> set:
    if shape.is_tuple:
        for e in shape.elements:
            _dtypes(e, out)
    else:
        out.add(shape.dtype)
    return out


def widening_of(module: HloModule) -> dict[str, str]:
    """The element-type map ``upcast_floats`` would apply (raises ``UpcastError`` if none)."""
    types: set = set()
    for inst in module.instructions():
        _dtypes(inst.shape, types)
    narrow = sorted(types & _NARROW)
    if narrow:
        raise UpcastError(f"the module computes in {narrow}: a wider twin would not compute "
                          f"what it computes (its scaling is part of the program)")
    if types & _HALF.keys():
        return dict(_HALF)
    if "f32" in types:
        return dict(_SINGLE)
    raise UpcastError("the module has no bf16, f16 or f32 values to widen")


def _widened(shape: Shape, mapping: dict[str, str]) -> Shape:
    if shape.is_tuple:
        return Shape.tuple_of([_widened(e, mapping) for e in shape.elements])
    if shape.dtype not in mapping:
        return shape
    return Shape(mapping[shape.dtype], shape.dims, shape.layout, dynamic=shape.dynamic)


def _convert(comp: Computation, value: Instruction, shape: Shape, *, after: Instruction) -> Instruction:
    """``value`` as ``shape`` (same dims, other element types): converts, through
    get-tuple-element / tuple for a tuple. Added after ``after``; returns the last one."""
    if value.shape == shape:
        return value
    module = comp.module
    if shape.is_tuple:
        parts = []
        for i, element in enumerate(shape.elements):
            gte = comp.add_instruction(Instruction(
                module.unique_name(f"{value.name}.gte{i}"), "get-tuple-element",
                value.shape.elements[i], [value], {"index": str(i)}), after=after)
            part = _convert(comp, gte, element, after=gte)
            parts.append(part)
            after = part
        return comp.add_instruction(Instruction(module.unique_name(f"{value.name}.tuple"), "tuple",
                                                shape, parts), after=after)
    if shape.is_token or shape.is_opaque:
        return value
    return comp.add_instruction(Instruction(module.unique_name(f"{value.name}.convert"), "convert",
                                            shape, [value]), after=after)


def upcast_floats(module: HloModule) -> dict[str, str]:
    """Widen the module's float computation in place; returns the element-type map applied.

    Raises:
      UpcastError: nothing to widen, fp8 / fp4 values, a type-bound op that calls a
        computation, or a tuple-typed entry parameter holding a widened type.
    """
    mapping = widening_of(module)
    original = {id(inst): inst.shape for inst in module.instructions()}
    operand_shapes = {id(inst): [o.shape for o in inst.operands] for inst in module.instructions()}
    entry_out = module.entry.root.shape

    def type_bound(inst: Instruction) -> bool:
        return inst.opcode in _TYPE_BOUND or (
            inst.opcode == "bitcast" and bool(inst.operands)
            and original[id(inst.operands[0])].dtype != original[id(inst)].dtype)

    for comp in module.computations:
        for inst in comp.instructions:
            bound = type_bound(inst)
            if bound and inst.called_computations:
                raise UpcastError(f"%{inst.name} ({inst.opcode}) calls a computation: its types "
                                  f"cannot be kept apart from the widened module")
            if comp.is_entry and inst.opcode == "parameter":
                if inst.shape.is_tuple and _widened(inst.shape, mapping) != inst.shape:
                    raise UpcastError(f"entry parameter %{inst.name} is a tuple holding "
                                      f"{sorted(_dtypes(inst.shape, set()) & mapping.keys())}")
                continue
            if not bound:
                inst.shape = _widened(inst.shape, mapping)
            if inst.opcode == "dot" and "algorithm" in inst.attrs:
                del inst.attrs["algorithm"]
    for comp in list(module.computations):
        for inst in list(comp.instructions):
            if id(inst) not in original:  # a convert added below
                continue
            bound = type_bound(inst)
            if bound:  # operands back to their original types
                for i, (op, want) in enumerate(zip(list(inst.operands), operand_shapes[id(inst)],
                                                   strict=True)):
                    if op.shape != want:
                        inst.replace_operand(i, _convert(comp, op, want, after=op))
            if bound or (comp.is_entry and inst.opcode == "parameter"):
                wide = _widened(inst.shape, mapping)
                if wide != inst.shape:  # the result up to the widened type, for its users
                    users = list(inst.users)
                    up = _convert(comp, inst, wide, after=inst)
                    for user in users:
                        user.replace_operand(inst, up)
                    if comp.root is inst:
                        comp.root = up
    entry = module.entry
    if entry.root.shape != entry_out:  # the outputs keep their types
        entry.root = _convert(entry, entry.root, entry_out, after=entry.root)
    return mapping
