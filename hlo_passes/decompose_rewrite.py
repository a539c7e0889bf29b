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
  (a broadcast of unsplit operands, an iota): then they keep the original;
* a *partial* instruction (``SplitPlan.partial``: a dot contracting the split
  dimension, a reduce over it) computes its whole output in each chunk, and the
  chunks are combined (``add`` / ``maximum`` / ``minimum``) for every user;
* with ``isolate``, chunk ``k >= 1`` reads operands from outside the plan
  through its own ``opt-barrier`` chain, so that XLA cannot fuse the chunks
  back into one kernel.

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

__all__ = ["SplitPlan", "SplitResult", "split_instructions", "ADJUST", "max_channel_id",
           "plans_divisible_by"]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How one instruction splits: its output dimension and each operand's (None = whole)."""

    out_dim: int
    operand_dims: tuple[int | None, ...]
    # True for an op that is cheap to recompute from unsplit operands (a broadcast of
    # them, an iota): users outside the plan keep the original, no concatenation.
    replicable: bool = False
    # A *partial* member (``out_dim`` unused): an op that contracts or reduces the split
    # dimension (a dot contracting it, a reduce over it). Each chunk computes the whole
    # output over its slice; the chunks are combined by this opcode ("add", "maximum",
    # "minimum") and every user reads the combination. Reassociates sums.
    partial: str | None = None


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """What the rewrite added (instruction names)."""

    chunks: dict[str, list[str]]  # original name -> chunk names
    slices: list[str]
    concats: list[str]
    sums: list[str] = dataclasses.field(default_factory=list)  # combinations of partial members
    barriers: list[str] = dataclasses.field(default_factory=list)  # isolate=True: opt-barriers


def _chunk_shape(shape: Shape, dim: int, n: int) -> Shape:
    dims = list(shape.dims)
    if dims[dim] % n:
        raise HloError(f"dimension {dim} of {shape} (size {dims[dim]}) does not divide by {n}; "
                       "expected a degree that divides every split dimension")
    dims[dim] //= n
    return Shape(shape.dtype, dims, shape.layout)


_WIDE = {"bf16": "f32", "f16": "f32"}


def _partial_shape(inst: Instruction) -> Shape:
    """A partial chunk's shape: the whole output; a half-precision dot accumulates in f32
    (the original GEMM rounds once, after its f32 accumulation; so do the summed chunks)."""
    if inst.opcode == "dot" and inst.shape.dtype in _WIDE:
        return Shape(_WIDE[inst.shape.dtype], list(inst.shape.dims), inst.shape.layout)
    return inst.shape


def _wide_reduce(inst: Instruction, plan: SplitPlan) -> bool:
    """A partial ``add`` reduce in half precision (its chunks sum in f32)."""
    return (inst.opcode == "reduce" and plan.partial == "add" and inst.shape.dtype in _WIDE
            and inst.shape.is_array)


def _wide_adder(module, dtype: str):
    """The module's scalar ``dtype`` add computation (created once)."""
    from hlo_passes.computation import Computation

    name = f"concerto_add_{dtype}"
    for comp in module.computations:
        if comp.name == name:
            return comp
    scalar = Shape(dtype, [])
    a = Instruction("lhs", "parameter", scalar, [], {}, parameter_number=0)
    b = Instruction("rhs", "parameter", scalar, [], {}, parameter_number=1)
    root = Instruction("sum", "add", scalar, [a, b], {})
    comp = Computation(name, [a, b, root], root=root)
    module.add_computation(comp)
    return comp


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


_SHARED_OK = frozenset({"constant", "iota"})
"""Outside operands chunks may share (XLA folds or regenerates them inside each kernel)."""

_CLONED = frozenset({"broadcast", "reshape", "bitcast", "copy", "transpose", "negate",
                     "reduce-precision"})
"""Cheap one-pass producers XLA fuses into their consumers: cloned per chunk, not barriered."""


def plans_divisible_by(plans: dict[Instruction, SplitPlan], n: int) -> bool:
    """Every split dimension of ``plans`` (members' outputs but partial ones, and sliced
    operands) divides by ``n``."""
    for inst, plan in plans.items():
        if plan.partial is None and inst.shape.dims[plan.out_dim] % n:
            return False
        for op, d in zip(inst.operands, plan.operand_dims, strict=True):
            if d is not None and op.shape.dims[d] % n:
                return False
    return True


def max_channel_id(module) -> int:
    """The largest ``channel_id`` in the module (0 if none)."""
    return max((i.channel_id or 0 for i in module.instructions()), default=0)


def split_instructions(comp, plans: dict[Instruction, SplitPlan], n: int,
                       next_channel_id: Callable[[], int], isolate: bool = False,
                       wide_partials: bool = False) -> SplitResult:
    """Replace the planned instructions of ``comp`` by ``n`` chunks each (see the module docstring).

    Args:
      comp: the computation holding every planned instruction.
      plans: instruction -> its ``SplitPlan``. An operand that is itself planned must
        split along the dimension the user's plan names for it.
      n: the degree (>= 2); every split dimension must divide by it.
      next_channel_id: returns a fresh channel id for each collective chunk.
      isolate: give chunk ``k >= 1`` its own copy of every operand it reads from outside
        the plan (a chain of ``k`` ``opt-barrier`` s of it; constants and scalars excepted).
        XLA's GPU pipeline merges independent instructions that share an operand (sibling
        multi-output fusion, the dot merger); the chunks of a split share every outside
        operand, so XLA would fuse chunk ``k`` with chunk ``k+1`` back into one kernel that
        waits for both chunks' collectives, and the split would overlap nothing. An
        ``opt-barrier`` is a no-op at run time (its result aliases its operand).
      wide_partials: a half-precision partial ``add`` reduce sums each chunk in f32 (its
        operand converted, a scalar f32 add computation) and rounds once after the chunks
        are added; otherwise each chunk rounds to the reduce's type before the addition.
        Half-precision partial dots always accumulate in f32.

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
            if op in plans and plans[op].partial is not None:
                if d is not None:
                    raise HloError(f"%{inst.name} needs %{op.name} split along {d}, but "
                                   "that is a partial member (its chunks are summed)")
            elif op in plans and plans[op].out_dim != d:
                raise HloError(f"%{inst.name} needs %{op.name} split along {d}, but its plan "
                               f"splits dimension {plans[op].out_dim}")

    def add(inst: Instruction, before: Instruction) -> Instruction:
        inst.name = module.unique_name(inst.name) if module is not None else inst.name
        return comp.add_instruction(inst, before=before)

    slices: dict[tuple[int, int, int], Instruction] = {}
    sums: list[str] = []
    barriers: dict[tuple[int, int], Instruction] = {}
    isolated: list[Instruction] = []

    def own(op: Instruction, k: int, before: Instruction) -> Instruction:
        """Chunk ``k``'s copy of outside operand ``op`` (``op`` itself for chunk 0).

        A barrier makes XLA materialise its operand, so a cheap producer that XLA would
        fuse into its consumers (``_CLONED``: a broadcast, reshape, transpose, ...) is cloned
        for the chunk over chunk ``k``'s copy of its own operands; the barriers go on the
        values that are materialised anyway (parameters, GEMM results, converted weights:
        cloning a weight's convert would convert it once per chunk)."""
        if not isolate or k == 0 or op.opcode in _SHARED_OK or not op.shape.is_array \
                or not op.shape.dims:
            return op
        key = (id(op), k)
        if key not in barriers:
            if op.opcode in _CLONED and not op.control_predecessors:
                ops = [own(o, k, before) for o in op.operands]
                attrs = {a: (list(v) if isinstance(v, list) else v) for a, v in op.attrs.items()
                         if a not in ("sharding", "control-predecessors")}
                b = Instruction(f"{op.name}.own{k}", op.opcode, op.shape, ops, attrs,
                                literal=op.literal)
                barriers[key] = add(b, before)
            else:
                prev = own(op, k - 1, before)
                b = Instruction(f"{op.name}.iso{k}", "opt-barrier", op.shape, [prev], {})
                barriers[key] = add(b, before)
                isolated.append(barriers[key])
        return barriers[key]

    def slice_of(op: Instruction, dim: int, k: int, before: Instruction) -> Instruction:
        key = (id(op), dim, k)
        if key not in slices:
            op = own(op, k, before)
            shape = _chunk_shape(op.shape, dim, n)
            step = shape.dims[dim]
            ranges = [f"[{k * step}:{(k + 1) * step}]" if d == dim else f"[0:{size}]"
                      for d, size in enumerate(op.shape.dims)]
            s = Instruction(f"{op.name}.slice{k}", "slice", shape, [op],
                            {"slice": "{" + ", ".join(ranges) + "}"})
            slices[key] = add(s, before)
        return slices[key]

    chunks: dict[int, list[Instruction]] = {}
    combined: dict[int, Instruction] = {}  # partial member -> the combination of its chunks
    for inst in order:
        plan = plans[inst]
        made = []
        for k in range(n):
            ops = []
            for op, d in zip(inst.operands, plan.operand_dims, strict=True):
                if op in plans and plans[op].partial is not None:
                    ops.append(combined[id(op)])
                elif op in plans:
                    ops.append(chunks[id(op)][k])
                elif d is None:
                    ops.append(own(op, k, inst))
                else:
                    ops.append(slice_of(op, d, k, inst))
            attrs = {key: (list(v) if isinstance(v, list) else v) for key, v in inst.attrs.items()
                     if key not in ("sharding", "control-predecessors")}
            ADJUST.get(inst.opcode, lambda *a: None)(attrs, inst, plan, n)
            if plan.partial is None:
                shape = _chunk_shape(inst.shape, plan.out_dim, n)
            else:
                shape = _partial_shape(inst)
                if wide_partials and _wide_reduce(inst, plan):
                    # a half-precision sum: each chunk sums in f32 (the original's backends
                    # accumulate in f32 and round once; chunks rounded to bf16 and added would
                    # round twice, and a bias gradient that nearly cancels would lose digits)
                    wide = _WIDE[inst.shape.dtype]
                    ops = [add(Instruction(f"{o.name}.{wide}", "convert",
                                           Shape(wide, list(o.shape.dims), o.shape.layout), [o], {}),
                               inst) for o in ops]
                    attrs["to_apply"] = _wide_adder(module, wide)
                    shape = Shape(wide, list(inst.shape.dims), inst.shape.layout)
            new = Instruction(f"{inst.name}.chunk{k}", inst.opcode, shape, ops, attrs,
                              literal=inst.literal)
            if inst.channel_id is not None:
                new.channel_id = next_channel_id()
            made.append(add(new, inst))
        chunks[id(inst)] = made
        if plan.partial is not None:
            acc = made[0]
            for k in range(1, n):
                acc = add(Instruction(f"{inst.name}.psum{k}", plan.partial, acc.shape,
                                      [acc, made[k]], {}), inst)
                sums.append(acc.name)
            if acc.shape.dtype != inst.shape.dtype:
                acc = add(Instruction(f"{inst.name}.psum", "convert", inst.shape, [acc], {}), inst)
                sums.append(acc.name)
            if "metadata" in inst.attrs:
                acc.attrs["metadata"] = inst.attrs["metadata"]
            combined[id(inst)] = acc
            for user in list(inst.users):
                if user not in plans:
                    user.replace_operand(inst, acc)
            if comp.root is inst:
                comp.root = acc

    concats = []
    for inst in order:
        outside = [u for u in inst.users if u not in plans]
        if (not outside and comp.root is not inst) or plans[inst].replicable \
                or plans[inst].partial is not None:
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
                       slices=[s.name for s in slices.values()], concats=concats,
                       barriers=[b.name for b in isolated], sums=sums)
