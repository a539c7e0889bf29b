"""Chunk a set of instructions along one axis: slice inputs, per-chunk ops and collectives, concatenate back.

The rewrite of a decomposition (Concerto ASPLOS'25 §5): given a *plan* (each
instruction of a connected region of one computation -> the output dimension
it splits along and the dimension of each operand that splits with it, as
decided by ``hlo_passes.decompose.rules``) and a degree ``n``, every
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

from hlo_passes.ir import attributes as _attrs
from hlo_passes.ir.computation import Computation
from hlo_passes.ir.errors import HloError
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.loops import CASTS, loop_state_problem, through_casts
from hlo_passes.ir.opcodes import COLLECTIVE_KINDS
from hlo_passes.ir.shapes import Shape

__all__ = ["SplitPlan", "SplitResult", "split_instructions", "split_while_body",
           "carried_splits", "ADJUST", "plans_divisible_by"]


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


KEEP_AXIS_MIN_FACTOR = 8
"""A partial reduce keeps the split axis in its chunks only where each chunk's kept partial
is at least this many times smaller than the chunk's operand (``_kept_axis``)."""

XLA_COLUMN_TREE_BOUND = 32 * 128
"""Rows above which XLA's GPU pipeline rewrites a column reduction into a tree (a partial
reduce to [rows / bound-ish, cols] fused with its elementwise siblings, then a small one):
``ReductionDimensionRaceFreeBound`` for column reductions, warp size x 128 (XLA
``service/gpu/reduction_utils.cc``, ``TreeReductionRewriter``). At or under it, a column
reduce that shares its input with a row reduce (a norm's backward) makes XLA materialise
that input in f32 instead."""


def _kept_axis(inst: Instruction, plan: SplitPlan, n: int, wide: bool):
    """How a partial reduce's chunks keep the split axis, or None where they do not.

    The case: a column reduce over the split axis *and* other axes (a norm's weight
    gradient: the sum of ``dy * x_hat`` over batch and sequence, split along the batch)
    whose rows are above ``XLA_COLUMN_TREE_BOUND`` in the original and at or under it in a
    chunk. XLA tree-rewrites the original and fuses its partial sums with the norm's dx;
    a chunk falls under the bound and XLA materialises the f32 product for it instead
    (held-out TP step, 8,192 -> 4,096 rows: +27 us of writes and a separate dx kernel per
    norm and chunk; docs/DECISIONS.md D25). So each chunk reduces over the other axes
    only (rows per batch entry, e.g. 1,024), which XLA fuses with dx; the chunks' partials
    (the split axis kept, at chunk size) are combined and reduced over that axis once.
    Where the chunks stay above the bound (XLA tree-rewrites them as it did the
    original), the plain form is kept: the kept form measured slower there (GPT TP=8,
    16,384 -> 8,192 rows). Single-input reduces whose operand's minor dimension is kept
    (column reductions) only; a half-precision one only where its chunks sum in f32
    (``wide``: the kept partials would round once per row otherwise).

    Returns ``(dimensions of a chunk's reduce, a chunk's output dims, the split axis's
    position in them)``.
    """
    if inst.opcode != "reduce" or plan.partial is None or len(inst.operands) != 2 \
            or not inst.shape.is_array or (inst.shape.dtype in _WIDE and not wide):
        return None
    d = plan.operand_dims[0]
    dims = _attrs.parse_int_list(inst.attrs.get("dimensions", "{}"))
    if d is None or d not in dims or len(dims) < 2:
        return None
    shape = inst.operands[0].shape
    src = shape.dims
    order = shape.minor_to_major or tuple(reversed(range(len(src))))
    if not order or order[0] in dims:  # a row reduction (or a full one)
        return None
    rows = 1
    for x in dims:
        rows *= src[x]
    if not rows // n <= XLA_COLUMN_TREE_BOUND < rows:
        return None
    reduced = [x for x in dims if x != d]
    kept = [i for i in range(len(src)) if i not in reduced]
    out = [src[i] // n if i == d else src[i] for i in kept]
    chunk_in = 1
    for i, size in enumerate(src):
        chunk_in *= size // n if i == d else size
    kept_elems = 1
    for size in out:
        kept_elems *= size
    if kept_elems * KEEP_AXIS_MIN_FACTOR > chunk_in:
        return None
    return reduced, out, kept.index(d)


def _wide_adder(module, dtype: str):
    """The module's scalar ``dtype`` add computation (created once)."""
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


_GENERATING = frozenset({"add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum",
                         "compare", "select", "clamp", "convert", "and", "or", "xor", "not",
                         "shift-left", "shift-right-logical", "shift-right-arithmetic"}) | _CLONED


def _generated(op: Instruction, depth: int = 16) -> bool:
    """Whether ``op`` reads no array from memory: constants, iotas and scalars combined by
    elementwise ops and broadcasts (a vocabulary index ``iota + shard offset``). XLA
    regenerates such a value inside each kernel that reads it, as it does a constant:
    chunks share it; a barrier would make XLA materialise it (``[B, S, V]`` s32 for a
    one-hot of a vocab-parallel loss, 110 us of writes on gpt_tp8_nvlink)."""
    if op.opcode in _SHARED_OK or (op.shape.is_array and not op.shape.dims):
        return True
    return depth > 0 and op.opcode in _GENERATING and bool(op.operands) \
        and all(_generated(o, depth - 1) for o in op.operands)


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


def _reassociable(coll: Instruction) -> bool:
    """Whether ``coll``'s one user combines it with another collective elementwise
    (``add(all-reduce(a), all-reduce(b))``, through converts or reshapes): XLA's
    all-reduce reassociation turns that into one collective of the combined value, but
    only while each collective has that one user, so the chunks of such a collective are
    not ordered through a barrier (which would be a second user)."""
    x = coll
    while len(x.users) == 1 and x.users[0].opcode in CASTS:
        x = x.users[0]
    if len(x.users) != 1:
        return False
    user = x.users[0]

    def reduced(op: Instruction, depth: int) -> bool:  # a collective, or user.opcode of one
        op = through_casts(op)
        if op.opcode in COLLECTIVE_KINDS:
            return True
        return depth > 0 and op.opcode == user.opcode \
            and any(reduced(o, depth - 1) for o in op.operands)

    return any(reduced(op, 8) for op in user.operands if op is not x)


def split_instructions(comp, plans: dict[Instruction, SplitPlan], n: int,
                       next_channel_id: Callable[[], int], isolate: bool = False,
                       wide_partials: bool = False,
                       presplit: dict[Instruction, tuple[int, list[Instruction]]] | None = None,
                       keep_axis: bool = False) -> SplitResult:
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
        ``opt-barrier`` is a no-op at run time (its result aliases its operand). Likewise
        chunk ``k``'s copy of a collective reads its operand through a barrier with chunk
        ``k-1``'s copy (``after``), so that XLA's collective combiners do not merge them,
        unless the collective is summed with another (XLA's reassociation needs it alone).
      wide_partials: a half-precision partial ``add`` reduce sums each chunk in f32 (its
        operand converted, a scalar f32 add computation) and rounds once after the chunks
        are added; otherwise each chunk rounds to the reduce's type before the addition.
        Half-precision partial dots always accumulate in f32.
      keep_axis: a partial reduce over the split axis and others reduces each chunk over
        the others only and the combined chunks over the split axis once (``_kept_axis``).
      presplit: outside operand -> (dimension, its ``n`` chunks, already in ``comp``): chunk
        ``k`` reads chunk ``k`` where it would read the ``k``-th slice along that
        dimension (a loop-carried value kept in chunks, ``split_while_body``); no barrier.

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
                or not op.shape.dims or _generated(op):
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
        if presplit and op in presplit and presplit[op][0] == dim:
            return presplit[op][1][k]
        key = (id(op), dim, k)
        if key not in slices and op.opcode == "broadcast" and op.operands:
            # a chunk of a broadcast is a broadcast of the chunk's operand (a slice of it if
            # the split dimension comes from the operand), not a slice of the whole
            # broadcast, which XLA would have to fuse through the slice or materialise
            mapped = _attrs.parse_int_list(op.attr("dimensions") or "{}")
            src = op.operands[0]
            src = (slice_of(src, mapped.index(dim), k, before) if dim in mapped
                   else own(src, k, before))
            slices[key] = add(Instruction(f"{op.name}.chunk{k}", "broadcast",
                                          _chunk_shape(op.shape, dim, n), [src],
                                          {a: v for a, v in op.attrs.items()
                                           if a in ("dimensions", "metadata")}), before)
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

    def after(prev: Instruction, value: Instruction, before: Instruction) -> Instruction:
        """``value`` read through an ``opt-barrier`` together with ``prev``: whatever reads it
        depends on ``prev`` (nothing else changes; the barrier aliases both at run time).

        Chunk ``k``'s collective reads its operand this way after chunk ``k-1``'s collective.
        Without it XLA's collective combiners, which merge independent collectives of one
        kind, may merge the chunks of a collective back into one, or chunk ``k-1``'s and
        chunk ``k``'s tiny collectives of a region (a vocab-parallel loss's max and sum), so
        that chunk ``k-1`` waits for chunk ``k`` there and the pipeline drains. (A control
        edge would say the same but does not survive the StableHLO that JAX compiles.)"""
        pair = add(Instruction(f"{value.name}.after", "tuple",
                               Shape.tuple_of([prev.shape, value.shape]), [prev, value], {}), before)
        barrier = add(Instruction(f"{value.name}.after.barrier", "opt-barrier", pair.shape,
                                  [pair], {}), before)
        return add(Instruction(f"{value.name}.after.value", "get-tuple-element", value.shape,
                               [barrier], {"index": "1"}), before)

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
            kept = keep_axis and _kept_axis(inst, plan, n, wide_partials)
            if kept:
                attrs["dimensions"] = _attrs.format_int_list(kept[0])
                shape = Shape(shape.dtype, kept[1], ",".join(map(str, reversed(range(len(kept[1]))))))
            if isolate and k and inst.opcode in COLLECTIVE_KINDS and ops \
                    and not _reassociable(inst):
                ops[0] = after(made[-1], ops[0], inst)
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
            kept = keep_axis and _kept_axis(inst, plan, n, wide_partials)
            if kept:  # the chunks' partials, combined, reduced over the split axis once
                first = made[0]
                acc = add(Instruction(
                    f"{inst.name}.pkept", "reduce", Shape(acc.shape.dtype, list(inst.shape.dims),
                                                          inst.shape.layout),
                    [acc, first.operands[1]], {"dimensions": _attrs.format_int_list([kept[2]]),
                                               "to_apply": first.attrs["to_apply"]}), inst)
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


# -- loop-carried chunks ---------------------------------------------------------------------


def barrier_state_reads(body, reads) -> list[Instruction]:
    """Of ``reads`` (instructions of while body ``body``), the ``get-tuple-element`` s of an
    ``opt-barrier`` whose tuple element is a read of the loop state (a ``get-tuple-element``
    of the body's parameter), where ``release_barrier_state_reads`` can release them: the
    barrier's operand is a tuple used by it alone, every user of the barrier is a
    ``get-tuple-element``, and the barrier is not the root."""
    param = body.parameters[0] if len(body.parameters) == 1 else None
    out = []
    for g in reads:
        if g.opcode != "get-tuple-element" or not g.operands or g.operands[0].opcode != "opt-barrier":
            continue
        b = g.operands[0]
        t = b.operands[0] if b.operands else None
        if (t is None or t.opcode != "tuple" or len(t.users) != 1 or b is body.root
                or not all(u.opcode == "get-tuple-element" for u in b.users)):
            continue
        op = t.operands[g.tuple_index]
        if op.opcode == "get-tuple-element" and op.operands and op.operands[0] is param:
            out.append(g)
    return out


def release_barrier_state_reads(body, reads) -> list[str]:
    """Take the loop-state reads ``reads`` (from ``barrier_state_reads``) out of their
    ``opt-barrier`` s: their users read the loop state directly, and each barrier keeps its
    other elements (its tuple and shape shrink, the remaining reads are re-indexed).

    JAX's remat puts the residuals of a rematerialised layer through an ``opt-barrier`` in
    the backward loop body (``prevent_cse``), the incoming cotangent with them: the cotangent
    is then read through the barrier, so a region split of the body slices and concatenates
    it in every iteration instead of carrying it in chunks (``carried_splits`` wants the
    loop state read by the region alone). An ``opt-barrier`` is the identity on values and a
    loop-state read is available from the start of the iteration, so releasing it changes
    no value and keeps the barrier's hold on everything else it orders (its other
    elements: the weights and residuals the recomputation reads). Returns the names of the
    released reads.
    """
    by_barrier: dict[int, tuple[Instruction, set]] = {}
    for g in reads:
        by_barrier.setdefault(id(g.operands[0]), (g.operands[0], set()))[1].add(g.tuple_index)
    released = []
    for b, indices in by_barrier.values():
        t = b.operands[0]
        keep = [k for k in range(len(t.operands)) if k not in indices]
        if not keep:
            continue  # a barrier of nothing: leave it whole
        for u in list(b.users):
            k = u.tuple_index
            if k in indices:
                body.replace_all_uses(u, t.operands[k])
                body.remove_instruction(u)
                released.append(u.name)
            else:
                u.set_attr("index", str(keep.index(k)))
        ops = [t.operands[k] for k in keep]
        t.set_operands(ops)
        t.shape = Shape.tuple_of([o.shape for o in ops])
        b.shape = t.shape
    return released


def carried_splits(w: Instruction, plans: dict[Instruction, SplitPlan], n: int) -> dict[int, int]:
    """Elements of ``w``'s loop state that can be carried as ``n`` chunks when its body is
    split by ``plans``: tuple index -> the split dimension.

    Element ``i`` qualifies when the body reads it through one ``get-tuple-element`` whose
    users are all planned and read it split along one dimension ``d`` (or the root passes it
    through unchanged, at index ``i``), the body's next value of it is that value passed
    through or a planned (not partial, not replicable) instruction split along ``d``, and
    the condition does not read it. Then every iteration's slices of it and concatenation
    of it are gone: the chunks stay apart for the whole loop (``split_while_body``).
    """
    if loop_state_problem(w) is not None:
        return {}
    body, cond = w.attr("body"), w.attr("condition")
    param, root = body.parameters[0], body.root
    by_index: dict[int, list[Instruction]] = {}
    for g in param.users:
        by_index.setdefault(g.tuple_index, []).append(g)
    cond_reads = {g.tuple_index for g in cond.parameters[0].users}
    out: dict[int, int] = {}
    for idx, gs in by_index.items():
        if len(gs) != 1 or idx in cond_reads or not gs[0].shape.is_array:
            continue
        g = gs[0]
        dims: set = set()
        ok = True
        for u in g.users:
            if u is root:
                continue
            if u not in plans:
                ok = False
                break
            dims.update(plans[u].operand_dims[j] for j, op in enumerate(u.operands) if op is g)
        if not ok or len(dims) != 1 or None in dims:
            continue
        d = dims.pop()
        if any(op is g and j != idx for j, op in enumerate(root.operands)):
            continue
        r = root.operands[idx]
        if r is not g:
            p = plans.get(r)
            if (p is None or p.partial is not None or p.replicable or p.out_dim != d
                    or sum(op is r for op in root.operands) != 1):
                continue
        if g.shape.dims[d] % n:
            continue
        out[idx] = d
    return out


def _chunks_of(x: Instruction, d: int, n: int, comp, before: Instruction) -> list[Instruction]:
    """``n`` chunks of ``x`` along ``d`` in ``comp``: the operands of a concatenation that
    built it from such chunks, otherwise slices (added before ``before``)."""
    shape = _chunk_shape(x.shape, d, n)
    if (x.opcode == "concatenate" and x.dimensions == [d] and len(x.operands) == n
            and all(op.shape.dims == shape.dims for op in x.operands)):
        return list(x.operands)
    out = []
    for k in range(n):
        ranges = [f"[{k * shape.dims[d]}:{(k + 1) * shape.dims[d]}]" if j == d else f"[0:{size}]"
                  for j, size in enumerate(x.shape.dims)]
        s = Instruction(f"{x.name}.chunk{k}", "slice", shape, [x],
                        {"slice": "{" + ", ".join(ranges) + "}"})
        out.append(comp.add_instruction(s, before=before))
    return out


def split_while_body(w: Instruction, plans: dict[Instruction, SplitPlan], n: int,
                     next_channel_id: Callable[[], int], isolate: bool = False,
                     wide_partials: bool = False, keep_axis: bool = False,
                     ) -> tuple[SplitResult, dict[int, int]]:
    """Split ``w``'s body by ``plans`` (``split_instructions``) and carry the loop state
    that splits with it in chunks (``carried_splits``).

    A body split alone slices its carried activations at the top of every iteration and
    concatenates them at the bottom: two memory passes of each per iteration. Here element
    ``i`` of the loop state becomes ``n`` elements (chunk 0 at index ``i``, the others
    appended at the end), chunk ``k`` of the body reads chunk ``k`` directly, and the root
    returns the chunks; before the loop the initial value is sliced once (or, when it is
    a concatenation of such chunks, e.g. the previous loop's result, its operands are
    used), after it the chunks are concatenated once for the users. Values are unchanged.

    Returns:
      The body's ``SplitResult`` and the re-chunked elements (index -> dimension).
    """
    body, cond = w.attr("body"), w.attr("condition")
    module = body.module
    carries = carried_splits(w, plans, n)
    param, root = body.parameters[0], body.root
    base = len(w.shape.elements)
    elements = list(w.shape.elements)
    extra: list[Shape] = []
    presplit: dict[Instruction, tuple[int, list[Instruction]]] = {}
    original: dict[int, Instruction] = {}
    for idx, d in sorted(carries.items()):
        g = next(u for u in param.users if u.tuple_index == idx)
        original[idx] = g
        shape = _chunk_shape(g.shape, d, n)
        chunks = []
        for k in range(n):
            index = idx if k == 0 else base + len(extra)
            if k:
                extra.append(shape)
            c = Instruction(module.unique_name(f"{g.name}.carry{k}"), "get-tuple-element", shape,
                            [param], {"index": str(index)})
            chunks.append(body.add_instruction(c, after=param))
        presplit[g] = (d, chunks)
        elements[idx] = shape
    res = split_instructions(body, plans, n, next_channel_id, isolate=isolate,
                             wide_partials=wide_partials, presplit=presplit, keep_axis=keep_axis)
    if not carries:
        return res, carries
    ops, tail = list(root.operands), []
    for idx in sorted(carries):
        g = original[idx]
        r = ops[idx]
        if r is g:
            pieces = presplit[g][1]
        else:  # the concatenation split_instructions built for the root
            if r.opcode != "concatenate" or len(r.operands) != n:
                raise HloError(f"expected the chunks of loop state element {idx} at the root of "
                               f"%{body.name}, found %{r.name} ({r.opcode})")
            pieces = list(r.operands)
        ops[idx] = pieces[0]
        tail.extend(pieces[1:])
    replaced = [o for o in root.operands if o.opcode == "concatenate"]
    new_shape = Shape.tuple_of(elements + extra)
    root.set_operands(ops + tail)
    root.shape = new_shape
    for x in replaced:  # the root's concatenations no longer read
        if not x.users and x.parent is body:
            body.remove_instruction(x)
    for g in original.values():
        if not g.users:
            body.remove_instruction(g)
    param.shape = new_shape
    cond.parameters[0].shape = new_shape
    # Outside: the initial state in chunks, the result concatenated once.
    parent, init = w.parent, w.operands[0]
    if init.opcode == "tuple":
        state = list(init.operands)
    else:
        state = [parent.add_instruction(Instruction(
            module.unique_name(f"{init.name}.element{j}"), "get-tuple-element", e, [init],
            {"index": str(j)}), before=w) for j, e in enumerate(w.shape.elements)]
    init_state = [state[idx] for idx in carries]
    tail = []
    for idx, d in sorted(carries.items()):
        pieces = _chunks_of(state[idx], d, n, parent, before=w)
        state[idx] = pieces[0]
        tail.extend(pieces[1:])
    new_init = parent.add_instruction(Instruction(module.unique_name(f"{init.name}.chunked"),
                                                  "tuple", new_shape, state + tail), before=w)
    w.replace_operand(init, new_init)
    if not init.users and init is not parent.root:
        parent.remove_instruction(init)
    for x in {id(x): x for x in init_state}.values():  # concatenations now read as chunks
        if x.opcode == "concatenate" and not x.users and x is not parent.root \
                and x.parent is parent:
            parent.remove_instruction(x)
    w.shape = new_shape
    extra_index = base
    for idx, d in sorted(carries.items()):
        indices = [idx] + list(range(extra_index, extra_index + n - 1))
        extra_index += n - 1
        for u in [u for u in w.users if u.tuple_index == idx]:
            u.shape = elements[idx]
            pieces = [u] + [parent.add_instruction(Instruction(
                module.unique_name(f"{u.name}.carry{k}"), "get-tuple-element", elements[idx],
                [w], {"index": str(j)}), after=u) for k, j in enumerate(indices[1:], 1)]
            cat = Instruction(module.unique_name(f"{u.name}.concat"), "concatenate",
                              Shape(u.shape.dtype, _whole_dims(elements[idx], d, n),
                                    u.shape.layout), pieces,
                              {"dimensions": _attrs.format_int_list([d])})
            parent.add_instruction(cat, after=pieces[-1])
            for user in [x for x in u.users if x is not cat]:
                user.replace_operand(u, cat)
            if parent.root is u:
                parent.root = cat
    parent.set_order(parent.post_order())
    body.set_order(body.post_order())
    return res, carries


def _whole_dims(chunk: Shape, d: int, n: int) -> list[int]:
    dims = list(chunk.dims)
    dims[d] *= n
    return dims
