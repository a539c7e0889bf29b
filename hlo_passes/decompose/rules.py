"""SPMD decomposition rules per HLO opcode: which output axis of an op splits, and how its operands split.

One table, ``RULES``, keyed by opcode, with a default rule (nothing splits).
A rule maps an instruction to its *axis map*: ``{output_dim: operand_dims}``,
where ``operand_dims[i]`` is the dimension of operand ``i`` that must be cut
the same way to compute one chunk of the output along ``output_dim``, or
``None`` when chunk ``k`` needs operand ``i`` whole (a dot's weight, a
reduce's init value, a scalar broadcast). An output dimension that is absent
does not split without changing the arithmetic (a dot's contracting
dimension would become a sum; a reduction over the axis would too), so the
decomposition context stops there.

Every split a rule allows computes each output element from exactly the same
inputs by exactly the same operations as before, so results are bitwise
equal (XLA:CPU dots included: checked in ``tests/test_decompose_rules.py``).

References: Concerto (ASPLOS'25) §5.1, decomposition by SPMD rules.
"""

from __future__ import annotations

from collections.abc import Callable

from hlo_passes.ir import attributes as _attrs

AxisMap = dict[int, tuple[int | None, ...]]
RuleFn = Callable[[object], AxisMap]

ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "compare",
    "convert", "copy", "cosine", "divide", "erf", "exponential", "exponential-minus-one",
    "floor", "imag", "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum",
    "multiply", "negate", "not", "or", "popcnt", "power", "real", "reduce-precision",
    "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt", "select",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt",
    "subtract", "tan", "tanh", "xor",
})
"""Opcodes computed element by element (every dimension splits)."""


def _rank(inst) -> int:
    return len(inst.shape.dims) if inst.shape.is_array else -1


def _elementwise(inst) -> AxisMap:
    if not inst.shape.is_array:
        return {}
    if inst.opcode == "bitcast-convert" and inst.operands[0].shape.dims != inst.shape.dims:
        return {}  # width-changing bitcast adds a dimension
    rank = _rank(inst)
    # clamp accepts scalar bounds: a rank-0 operand is used whole
    return {d: tuple(d if _rank(o) == rank else None for o in inst.operands) for d in range(rank)}


def _divide(inst) -> AxisMap:
    """Elementwise, except along the broadcast dimensions of a divisor ``broadcast(B)`` whose
    ``B`` has one use: XLA:CPU rewrites ``A / broadcast(B)`` into ``A * broadcast(1/B)``
    only while ``B`` has one use, and the chunks would give ``B`` N uses (an ulp apart)."""
    out = _elementwise(inst)
    divisor = inst.operands[1]
    if divisor.opcode == "broadcast" and len(divisor.operands[0].users) == 1:
        kept = set(divisor.dimensions or [])
        out = {d: dims for d, dims in out.items() if d in kept}
    return out


def _dot(inst) -> AxisMap:
    lhs, rhs = inst.operands[:2]
    lb = _attrs.parse_int_list(inst.attr("lhs_batch_dims", "{}"))
    rb = _attrs.parse_int_list(inst.attr("rhs_batch_dims", "{}"))
    lc = _attrs.parse_int_list(inst.attr("lhs_contracting_dims", "{}"))
    rc = _attrs.parse_int_list(inst.attr("rhs_contracting_dims", "{}"))
    lfree = [d for d in range(_rank(lhs)) if d not in lb and d not in lc]
    rfree = [d for d in range(_rank(rhs)) if d not in rb and d not in rc]
    out: AxisMap = {}
    extra = (None,) * (len(inst.operands) - 2)  # sparsity metadata operands: not split
    for o, (a, b) in enumerate(zip(lb, rb, strict=True)):
        out[o] = (a, b) + extra
    for i, a in enumerate(lfree):
        out[len(lb) + i] = (a, None) + extra
    for i, b in enumerate(rfree):
        out[len(lb) + len(lfree) + i] = (None, b) + extra
    return out


def _broadcast(inst) -> AxisMap:
    dims = inst.dimensions or []
    return {d: ((dims.index(d) if d in dims else None),) for d in range(_rank(inst))}


def _reduce(inst) -> AxisMap:
    if not inst.shape.is_array or len(inst.operands) != 2:
        return {}  # variadic (tuple-shaped) reduce: not split
    reduced = set(inst.dimensions or [])
    kept = [d for d in range(_rank(inst.operands[0])) if d not in reduced]
    return {o: (d, None) for o, d in enumerate(kept)}


def _transpose(inst) -> AxisMap:
    perm = inst.dimensions or []
    return {o: (perm[o],) for o in range(_rank(inst))}


def _reshape(inst) -> AxisMap:
    """A dimension maps cleanly when the elements before it and its size agree."""
    src, dst = inst.operands[0].shape.dims, inst.shape.dims
    out: AxisMap = {}
    for o in range(len(dst)):
        before = _prod(dst[:o])
        for i in range(len(src)):
            if src[i] == dst[o] and _prod(src[:i]) == before and dst[o] > 1:
                out[o] = (i,)
                break
    return out


def _prod(dims) -> int:
    p = 1
    for d in dims:
        p *= d
    return p


def _slice_ranges(inst) -> list[tuple[int, int, int]]:
    raw = inst.attr("slice", "{}").strip().strip("{}")
    ranges = []
    for part in _attrs.split_top_level(raw):
        nums = [int(x) for x in part.strip().strip("[]").split(":")]
        ranges.append((nums[0], nums[1], nums[2] if len(nums) > 2 else 1))
    return ranges


def _slice(inst) -> AxisMap:
    src = inst.operands[0].shape.dims
    return {d: (d,) for d, (lo, hi, st) in enumerate(_slice_ranges(inst))
            if lo == 0 and hi == src[d] and st == 1}


def _concatenate(inst) -> AxisMap:
    (cat,) = inst.dimensions
    return {d: (d,) * len(inst.operands) for d in range(_rank(inst)) if d != cat}


def _pad(inst) -> AxisMap:
    raw = inst.attr("padding", "")
    parts = raw.split("x") if raw else []
    out: AxisMap = {}
    for d, p in enumerate(parts):
        if all(int(v) == 0 for v in p.split("_")):
            out[d] = (d, None)
    return out


def _dynamic_slice(inst) -> AxisMap:
    src = inst.operands[0].shape.dims
    sizes = _attrs.parse_int_list(inst.attr("dynamic_slice_sizes", "{}"))
    n_idx = len(inst.operands) - 1
    return {d: (d,) + (None,) * n_idx for d in range(len(sizes)) if sizes[d] == src[d]}


def _dynamic_update_slice(inst) -> AxisMap:
    base, update = inst.operands[:2]
    n_idx = len(inst.operands) - 2
    return {d: (d, d) + (None,) * n_idx for d in range(_rank(base))
            if update.shape.dims[d] == base.shape.dims[d]}


def _iota(inst) -> AxisMap:
    axis = _attrs.parse_int(inst.attr("iota_dimension", "0"))
    return {d: () for d in range(_rank(inst)) if d != axis}


def _all_reduce(inst) -> AxisMap:
    if not inst.shape.is_array or len(inst.operands) != 1:
        return {}  # tuple all-reduce: not split
    return {d: (d,) for d in range(_rank(inst))}


def _gather_like(inst) -> AxisMap:
    """all-gather / reduce-scatter / all-to-all: every dimension but the collective's own."""
    if not inst.shape.is_array or len(inst.operands) != 1:
        return {}
    own = set(inst.dimensions or [])
    if inst.opcode == "all-to-all" and not own:
        return {}  # tuple form without dimensions
    return {d: (d,) for d in range(_rank(inst)) if d not in own}


def _conv_labels(inst):
    raw = inst.attr("dim_labels", "")
    if "_" not in raw or "->" not in raw:
        return None
    lhs, rest = raw.split("_", 1)
    rhs, out = rest.split("->")
    return lhs, rhs, out


def _convolution(inst) -> AxisMap:
    """Batch splits (lhs batch); output features split (rhs 'o') without feature groups."""
    labels = _conv_labels(inst)
    if labels is None:
        return {}
    lhs, rhs, out = labels
    groups = int(inst.attr("feature_group_count", "1"))
    bgroups = int(inst.attr("batch_group_count", "1"))
    res: AxisMap = {}
    if bgroups == 1:
        res[out.index("b")] = (lhs.index("b"), None)
    if groups == 1 and bgroups == 1:
        res[out.index("f")] = (None, rhs.index("o"))
    return res


def _collective_permute(inst) -> AxisMap:
    if not inst.shape.is_array or len(inst.operands) != 1:
        return {}
    return {d: (d,) for d in range(_rank(inst))}


def _gather(inst) -> AxisMap:
    """The batch dimensions of the output (those not in ``offset_dims``) split with the
    indices' dimensions (all but ``index_vector_dim``, in order); the operand is read whole.
    Gathers with operand/indices batching dimensions are not split."""
    if len(inst.operands) != 2 or inst.attr("operand_batching_dims") is not None:
        return {}
    offset = set(_attrs.parse_int_list(inst.attr("offset_dims", "{}")))
    ivd = _attrs.parse_int(inst.attr("index_vector_dim", "0"))
    indices = inst.operands[1]
    idx_dims = [d for d in range(_rank(indices)) if d != ivd]
    out_batch = [d for d in range(_rank(inst)) if d not in offset]
    if len(out_batch) != len(idx_dims):
        return {}
    return {o: (None, i) for o, i in zip(out_batch, idx_dims, strict=True)}


def _no_split(inst) -> AxisMap:
    return {}


RULES: dict[str, RuleFn] = {
    **{op: _elementwise for op in ELEMENTWISE},
    "divide": _divide,
    "dot": _dot,
    "convolution": _convolution,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "transpose": _transpose,
    "reshape": _reshape,
    "slice": _slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
    "iota": _iota,
    "all-reduce": _all_reduce,
    "all-gather": _gather_like,
    "reduce-scatter": _gather_like,
    "all-to-all": _gather_like,
    "collective-permute": _collective_permute,
    "gather": _gather,
}
"""Decomposition rule per opcode; ``DEFAULT_RULE`` for every other opcode."""

DEFAULT_RULE: RuleFn = _no_split
"""Opcodes without a rule (scatter, sort, custom-call, rng, tuple, while, ...) do not split."""


def axis_map(inst) -> AxisMap:
    """The axis map of ``inst`` by its opcode's rule (``{}`` when nothing splits)."""
    if not inst.shape.is_array or inst.shape.dynamic:
        return {}
    try:
        return RULES.get(inst.opcode, DEFAULT_RULE)(inst)
    except (ValueError, TypeError, IndexError):
        return {}  # an attribute form the rule does not know: do not split


def output_dim_for(inst, operand_index: int, operand_dim: int) -> int | None:
    """The output dimension of ``inst`` that splits when operand ``operand_index`` splits
    along ``operand_dim``, or None when that split does not pass through ``inst``."""
    for out, dims in axis_map(inst).items():
        if operand_index < len(dims) and dims[operand_index] == operand_dim:
            return out
    return None
