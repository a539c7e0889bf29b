"""Chunk a set of instructions along one axis: slice inputs, per-chunk ops and collectives, concatenate back.

The rewrite of a decomposition (Concerto ASPLOS'25 §5): given a *plan* (each
instruction of a connected region of one computation -> the output dimension
it splits along and the dimension of each operand that splits with it, as
decided by ``concerto_jax.decompose.rules``) and a degree ``n``, every
planned instruction is replaced by ``n`` copies that each compute ``1/n`` of
its output:

* an operand outside the plan that splits is cut by a ``slice`` (one per
  operand, dimension and chunk, shared by all users);
* an operand that does not split (a dot's weight, a reduce's init) is used whole;
* a collective chunk gets a fresh ``channel_id``;
* a planned instruction used outside the plan (or the root) is rebuilt for
  those users by a ``concatenate`` of its chunks, unless it is *replicable*
  (a broadcast of unsplit operands, an iota): then they keep the original.

Attributes that name sizes along the split axis are adjusted by the table
``ADJUST`` (opcode -> function), the default keeps them. Chunks are inserted
at the original instruction's position (chunk 0 first), so the computation
stays in a topological order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hlo_passes import attributes as _attrs
from hlo_passes.errors import HloError
from hlo_passes.instruction import Instruction
from hlo_passes.shapes import Shape

__all__ = ["SplitPlan", "SplitResult", "split_instructions", "ADJUST", "max_channel_id"]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How one instruction splits: its output dimension and each operand's (None = whole)."""

    out_dim: int
    operand_dims: tuple[int | None, ...]
    # True for an op that is cheap to recompute from unsplit operands (a broadcast of
    # them, an iota): users outside the plan keep the original, no concatenation.
    replicable: bool = False


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """What the rewrite added (instruction names)."""

    chunks: dict[str, list[str]]  # original name -> chunk names
    slices: list[str]
    concats: list[str]


def _chunk_shape(shape: Shape, dim: int, n: int) -> Shape:
    dims = list(shape.dims)
    if dims[dim] % n:
        raise HloError(f"dimension {dim} of {shape} (size {dims[dim]}) does not divide by {n}; "
                       "expected a degree that divides every split dimension")
    dims[dim] //= n
    return Shape(shape.dtype, dims, shape.layout)


def _adjust_slice(attrs: dict, inst: Instruction, plan: SplitPlan, n: int) -> None:
    raw = attrs["slice"].strip()[1:-1]
    parts = [p.strip() for p in _attrs.split_top_level(raw)]
    lo_hi = parts[plan.out_dim].strip("[]").split(":")
    hi = int(lo_hi[1]) // n
    parts[plan.out_dim] = f"[0:{hi}]" if len(lo_hi) < 3 else f"[0:{hi}:{lo_hi[2]}]"
    attrs["slice"] = "{" + ", ".join(parts) + "}"


def _adjust_dynamic_slice(attrs: dict, inst: Instruction, plan: SplitPlan, n: int) -> None:
    sizes = _attrs.parse_int_list(attrs["dynamic_slice_sizes"])
    sizes[plan.out_dim] //= n
    attrs["dynamic_slice_sizes"] = _attrs.format_int_list(sizes)


ADJUST: dict[str, Callable[[dict, Instruction, SplitPlan, int], None]] = {
    "slice": _adjust_slice,
    "dynamic-slice": _adjust_dynamic_slice,
}
"""Per-opcode attribute changes of a chunk (default: attributes unchanged)."""


def max_channel_id(module) -> int:
    """The largest ``channel_id`` in the module (0 if none)."""
    return max((i.channel_id or 0 for i in module.instructions()), default=0)


def split_instructions(comp, plans: dict[Instruction, SplitPlan], n: int,
                       next_channel_id: Callable[[], int]) -> SplitResult:
    """Replace the planned instructions of ``comp`` by ``n`` chunks each (see the module docstring).

    Args:
      comp: the computation holding every planned instruction.
      plans: instruction -> its ``SplitPlan``. An operand that is itself planned must
        split along the dimension the user's plan names for it.
      n: the degree (>= 2); every split dimension must divide by it.
      next_channel_id: returns a fresh channel id for each collective chunk.

    Returns:
      The names of the chunks, slices and concatenations added.

    Raises:
      HloError: a plan is inconsistent (dimension mismatch, not divisible, an
        instruction outside ``comp``).
    """
    if n < 2:
        raise HloError(f"expected a degree n >= 2, found {n}")
    module = comp.module
    order = [i for i in comp.post_order() if i in plans]
    if len(order) != len(plans):
        raise HloError("every planned instruction must belong to %" + comp.name)
    for inst in order:
        plan = plans[inst]
        if len(plan.operand_dims) != len(inst.operands):
            raise HloError(f"plan of %{inst.name} names {len(plan.operand_dims)} operands, "
                           f"the instruction has {len(inst.operands)}")
        for op, d in zip(inst.operands, plan.operand_dims, strict=True):
            if op in plans and plans[op].out_dim != d:
                raise HloError(f"%{inst.name} needs %{op.name} split along {d}, but its plan "
                               f"splits dimension {plans[op].out_dim}")

    def add(inst: Instruction, before: Instruction) -> Instruction:
        inst.name = module.unique_name(inst.name) if module is not None else inst.name
        return comp.add_instruction(inst, before=before)

    slices: dict[tuple[int, int, int], Instruction] = {}

    def slice_of(op: Instruction, dim: int, k: int, before: Instruction) -> Instruction:
        key = (id(op), dim, k)
        if key not in slices:
            shape = _chunk_shape(op.shape, dim, n)
            step = shape.dims[dim]
            ranges = [f"[{k * step}:{(k + 1) * step}]" if d == dim else f"[0:{size}]"
                      for d, size in enumerate(op.shape.dims)]
            s = Instruction(f"{op.name}.slice{k}", "slice", shape, [op],
                            {"slice": "{" + ", ".join(ranges) + "}"})
            slices[key] = add(s, before)
        return slices[key]

    chunks: dict[int, list[Instruction]] = {}
    for inst in order:
        plan = plans[inst]
        made = []
        for k in range(n):
            ops = []
            for op, d in zip(inst.operands, plan.operand_dims, strict=True):
                if op in plans:
                    ops.append(chunks[id(op)][k])
                elif d is None:
                    ops.append(op)
                else:
                    ops.append(slice_of(op, d, k, inst))
            attrs = {key: (list(v) if isinstance(v, list) else v) for key, v in inst.attrs.items()
                     if key not in ("sharding", "control-predecessors")}
            ADJUST.get(inst.opcode, lambda *a: None)(attrs, inst, plan, n)
            new = Instruction(f"{inst.name}.chunk{k}", inst.opcode,
                              _chunk_shape(inst.shape, plan.out_dim, n), ops, attrs,
                              literal=inst.literal)
            if inst.channel_id is not None:
                new.channel_id = next_channel_id()
            made.append(add(new, inst))
        chunks[id(inst)] = made

    concats = []
    for inst in order:
        outside = [u for u in inst.users if u not in plans]
        if (not outside and comp.root is not inst) or plans[inst].replicable:
            continue
        cat = Instruction(f"{inst.name}.concat", "concatenate", inst.shape, chunks[id(inst)],
                          {"dimensions": _attrs.format_int_list([plans[inst].out_dim])})
        if "metadata" in inst.attrs:
            cat.attrs["metadata"] = inst.attrs["metadata"]
        add(cat, inst)
        concats.append(cat.name)
        for user in outside:
            user.replace_operand(inst, cat)
        if comp.root is inst:
            comp.root = cat
    for inst in reversed(order):
        if not inst.users and comp.root is not inst:
            comp.remove_instruction(inst)
    comp.set_order(comp.post_order())
    return SplitResult(chunks={i.name: [c.name for c in chunks[id(i)]] for i in order},
                       slices=[s.name for s in slices.values()], concats=concats)
