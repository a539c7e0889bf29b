"""The rewrite of the ``replicated_reductions`` step: a collective of a replicated operand
moves ``1/h`` of its bytes over its group and gathers the rest over the orthogonal one
(``hlo_passes.replicated_reductions.decide`` says where it pays and proves the operand
replicated)."""

from __future__ import annotations

from collections.abc import Callable

from hlo_passes.ir import attributes as _attrs
from hlo_passes.ir.errors import HloError
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.replica_groups import format_replica_groups
from hlo_passes.ir.shapes import Shape


def split_replicated_collective(ar: Instruction, gather_groups: list[list[int]], dim: int | None,
                                next_channel_id: Callable[[], int]) -> Instruction:
    """Rewrites ``all-reduce(x)`` over groups ``G`` as ``all-gather(all-reduce(slice(x)))``,
    ``reduce-scatter(x)`` as ``all-gather(reduce-scatter(sub-blocks of x))`` and
    ``all-gather(x)`` as the ``(q, j) <- (j, q)`` transpose of ``all-gather(all-gather(slice(x)))``.

    Valid when ``x`` holds the same data on every device of each ``gather_groups`` group
    (``hlo_passes.ir.uniformity``) and every ``G`` group's members sit at one position of
    their gather groups (the caller checks both; for a reduce-scatter, also that a gather
    group's members sit at one position of their ``G`` groups, so they receive the same
    block). All-reduce: device ``d`` at position ``j`` of its gather group reduces slice
    ``j`` of ``x`` over ``G`` (``1/h`` of the bytes), and the all-gather over its gather
    group puts the ``h`` reduced slices back together. Reduce-scatter: ``x``'s scatter
    dimension holds ``|G|`` blocks; device ``d`` reduce-scatters sub-block ``j`` of every
    block (``1/h`` of the bytes) and receives sub-block ``j`` of its own block; the
    all-gather puts the block together. All-gather: device ``d`` gathers slice ``j`` of
    every group member's ``x`` over ``G``, the second gather collects the ``h`` slices and a
    transpose puts them in the original order (data movement only). Each element is
    reduced over the same devices in the same order as before.

    Args:
      ar: a synchronous array ``all-reduce`` or ``reduce-scatter`` with
        ``use_global_device_ids`` (SPMD form: device ids are partition ids).
      gather_groups: the groups of ``h`` devices to gather over, each in slice order.
      dim: all-reduce: the dimension of ``x`` to slice (its size divides by ``h``), or
        None to slice the flattened array (its element count divides by ``h``);
        reduce-scatter: ignored (its scatter dimension; each block divides by ``h``).
      next_channel_id: a fresh channel id per new collective.

    Returns:
      The all-gather (or the reshape after it) that replaced ``ar`` for its users.
    """
    comp = ar.parent
    module = comp.module
    if ar.control_predecessors or any(ar in u.control_predecessors for u in comp.instructions):
        raise HloError(f"{ar.name}: has control dependencies")
    if ar.opcode not in ("all-reduce", "reduce-scatter", "all-gather") or not ar.shape.is_array \
            or len(ar.operands) != 1:
        raise HloError(f"{ar.name}: expected a one-operand array all-reduce, reduce-scatter or "
                       f"all-gather, got {ar.opcode} {ar.shape}")
    h = len(gather_groups[0])
    shape = ar.shape.without_layout()
    x = ar.operands[0]
    in_shape = x.shape.without_layout()

    def add(opcode, shp, operands, attrs=None, **kw):
        inst = Instruction(module.unique_name(f"{ar.name}.{opcode}"), opcode, shp, operands,
                           dict(attrs or {}), **kw)
        return comp.add_instruction(inst, before=ar)

    position = {}
    for g in gather_groups:
        if len(g) != h:
            raise HloError(f"{ar.name}: gather groups of unequal sizes {gather_groups}")
        for j, d in enumerate(g):
            position[int(d)] = j
    num = module.num_devices
    if sorted(position) != list(range(num)):
        raise HloError(f"{ar.name}: gather groups do not cover the {num} devices once")

    def device_index(scale: int) -> Instruction:
        """``position[partition-id] * scale`` as an s32 scalar."""
        table = add("constant", Shape.array("s32", (num,)), [],
                    literal="{" + ", ".join(str(position[d] * scale) for d in range(num)) + "}")
        pid = add("partition-id", Shape.array("u32", ()), [])
        index = add("convert", Shape.array("s32", ()), [pid])
        picked = add("dynamic-slice", Shape.array("s32", (1,)), [table, index],
                     {"dynamic_slice_sizes": "{1}"})
        return add("reshape", Shape.array("s32", ()), [picked])

    zero = None

    def dynamic_slice(src: Instruction, axis: int, offset: Instruction, size: int) -> Instruction:
        nonlocal zero
        if zero is None:
            zero = add("constant", Shape.array("s32", ()), [], literal="0")
        dims = list(src.shape.dims)
        sizes = [size if k == axis else n for k, n in enumerate(dims)]
        starts = [offset if k == axis else zero for k in range(len(dims))]
        return add("dynamic-slice", Shape.array(src.shape.dtype, sizes), [src, *starts],
                   {"dynamic_slice_sizes": _attrs.format_int_list(sizes)})

    if ar.opcode == "all-reduce":
        source, dims = x, list(shape.dims)
        if dim is None:
            if shape.num_elements % h:
                raise HloError(f"{ar.name}: {shape.num_elements} elements do not divide by {h}")
            dims = [shape.num_elements]
            source = add("reshape", Shape.array(shape.dtype, dims), [x])
            dim = 0
        if dims[dim] % h:
            raise HloError(f"{ar.name}: dimension {dim} of {shape} does not divide by {h}")
        chunk = dims[dim] // h
        piece = dynamic_slice(source, dim, device_index(chunk), chunk)
        gathered_dims = dims
    elif ar.opcode == "all-gather":
        (dim,) = ar.dimensions or [None]
        size = in_shape.dims[dim]
        if size % h:
            raise HloError(f"{ar.name}: dimension {dim} of {in_shape} does not divide by {h}")
        piece = dynamic_slice(x, dim, device_index(size // h), size // h)
        gathered_dims = list(shape.dims)
    else:
        (dim,) = ar.dimensions or [None]
        groups = ar.replica_groups or [list(range(num))]
        parts = len(groups[0])
        block = in_shape.dims[dim] // parts
        if in_shape.dims[dim] % parts or block % h:
            raise HloError(f"{ar.name}: blocks of dimension {dim} of {in_shape} do not divide by {h}")
        split = list(in_shape.dims[:dim]) + [parts, h, block // h] + list(in_shape.dims[dim + 1:])
        blocks = add("reshape", Shape.array(in_shape.dtype, split), [x])
        sub = dynamic_slice(blocks, dim + 1, device_index(1), 1)
        merged = list(in_shape.dims)
        merged[dim] = parts * (block // h)
        piece = add("reshape", Shape.array(in_shape.dtype, merged), [sub])
        gathered_dims = list(shape.dims)
    attrs = {k: v for k, v in ar.attrs.items() if k not in ("sharding", "backend_config")}
    reduced_dims = list(gathered_dims)
    reduced_dims[dim] //= h
    reduced = add(ar.opcode, Shape.array(shape.dtype, reduced_dims), [piece], attrs)
    reduced.channel_id = next_channel_id()
    gathered = add("all-gather", Shape.array(shape.dtype, gathered_dims), [reduced],
                   {"channel_id": str(next_channel_id()),
                    "replica_groups": format_replica_groups(gather_groups),
                    "dimensions": "{" + str(dim) + "}",
                    "use_global_device_ids": "true"})
    out = gathered
    if ar.opcode == "all-gather":
        # The two gathers leave the pieces in (gather rank j, group position q) order; the
        # original holds them as (q, j): swap the two axes.
        parts = shape.dims[dim] // in_shape.dims[dim]
        piece_len = in_shape.dims[dim] // h
        lead, rest = list(shape.dims[:dim]), list(shape.dims[dim + 1:])
        split = add("reshape", Shape.array(shape.dtype, lead + [h, parts, piece_len] + rest), [gathered])
        perm = list(range(len(lead))) + [dim + 1, dim] + list(range(dim + 2, len(lead) + 3 + len(rest)))
        swapped = add("transpose", Shape.array(shape.dtype, lead + [parts, h, piece_len] + rest), [split],
                      {"dimensions": _attrs.format_int_list(perm)})
        out = add("reshape", Shape.array(shape.dtype, shape.dims), [swapped])
    elif list(gathered_dims) != list(shape.dims):
        out = add("reshape", Shape.array(shape.dtype, shape.dims), [gathered])
    if ar.shape.layout is not None and out.shape.layout is None:
        out.shape = out.shape.with_layout(ar.shape.layout)
    comp.replace_all_uses(ar, out)
    comp.remove_instruction(ar)
    return out
