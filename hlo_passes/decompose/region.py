"""Region split: one collective's decomposition context grown to everything that depends on its axis.

A per-collective context (``context.py``) stops where a member is used
outside it, so in a train step (every forward activation is read again by
the backward pass) it stays small and pays a concatenation per boundary. The
*region* of a critical collective ``D`` along axis ``a`` (a batch or
sequence axis) is the largest set of instructions that split with it:

1. **Sources**: walk backwards from ``D`` along ``a`` through the rules of
   ``rules.py`` until an instruction cannot produce the split (a parameter,
   a gather, an opcode without a rule); each such (instruction, dim) is a
   source, sliced once per chunk.
2. **Forward propagation**, in program order: an instruction with an operand
   in the region joins when its rule maps every split operand's dimension to
   one output dimension (the other operands are used whole, or sliced where
   the rule cuts them too). An instruction whose rule would *contract* the
   split dimension instead (a dot contracting it: a weight gradient; a
   reduce over it with ``add`` from 0, ``maximum`` or ``minimum``: a loss)
   joins as a **partial** member: each chunk computes the whole output over
   its slice and the chunks are summed (combined by the reducer). Anything
   else stays outside and reads a concatenation of the chunks.

The rewrite (``hlo_passes.decompose.rewrite.split_instructions``) then makes
``N`` copies of the region: ``N`` micro-batches of the whole step that share
the weights (each chunk reads them through its own ``opt-barrier`` chain so
that XLA cannot fuse the chunks back together), with the weight gradients
summed. Partial sums reassociate: a region with a partial member is declared
with a tolerance. Measured gains and costs: docs/DECISIONS.md
D24.

References: Concerto (ASPLOS'25) §5.1 (decomposition context, BFS both ways);
the grouping of a step into independent micro-batches whose communication
overlaps the other's computation is the idea of DeepSpeed Domino (2024).
"""

from __future__ import annotations

import dataclasses
import math

from hlo_passes.decompose import rules
from hlo_passes.decompose.context import joinable
from hlo_passes.decompose.cost import payload_bytes
from hlo_passes.decompose.rewrite import SplitPlan, plans_divisible_by
from hlo_passes.ir import attributes as _attrs
from hlo_passes.ir import device_groups

_PARTIAL_REDUCERS = {"add": "add", "maximum": "maximum", "minimum": "minimum"}


@dataclasses.dataclass
class Region:
    """The region of one collective along one axis.

    Attributes:
      collective: the seed collective.
      axis: its output dimension that is split.
      plans: member -> SplitPlan (``partial`` set on partial members).
      sources: (instruction, dim) pairs sliced per chunk.
      partial: names of the partial members (their chunks are summed).
    """

    collective: object
    axis: int
    plans: dict = dataclasses.field(default_factory=dict)
    sources: list = dataclasses.field(default_factory=list)
    partial: list = dataclasses.field(default_factory=list)

    def divisible_by(self, n: int) -> bool:
        """Every split dimension (members, sliced operands, sources) divides by ``n``."""
        return plans_divisible_by(self.plans, n)

    def collectives(self) -> int:
        return sum(1 for i in self.plans if i.is_collective)


@dataclasses.dataclass(frozen=True)
class RegionScore:
    """A region's case for a split into ``n`` (cost-model µs, one step).

    Attributes:
      comm_us: time of the region's collectives that a GEMM waits for: the communication
        that chunk ``k`` can overlap with another chunk's compute once split, and that
        nothing else would hide.
      overhead_us: the memory passes the split adds: every partial member's ``n - 1``
        additions (read two, write one output each, at the accumulation width), every
        sliced outside operand (read once, written once in slices; a broadcast at its
        operand's size), the ``n - 1`` extra reads of what a split dot or convolution
        reads whole, every concatenation for users outside (none for ``free``
        instructions: loop state carried in chunks); and, for an all-reduce that XLA turns
        into a reduce-scatter (``reduce_scatter_slice``) whose slice stays outside the
        region, the all-reduce's time over the reduce-scatter's (the chunks cannot be
        turned into reduce-scatters). Such an all-reduce's ``comm_us`` is the
        reduce-scatter's time.
      score_us: ``comm_us - overhead_us``.
    """

    comm_us: float
    overhead_us: float

    @property
    def score_us(self) -> float:
        return self.comm_us - self.overhead_us


def score_region(region: Region, n: int, cost_model, num_devices: int,
                 free: frozenset | set = frozenset(), loop_body: bool = False) -> RegionScore:
    """Score a region for the choice between regions (``decompose_pass._best_region``).

    A region along a hidden (model) axis splits weights and turns the contractions over
    that axis into partial sums of activation-sized outputs; a batch region's partial
    members are the weight gradients. This score prefers the region whose collectives
    are worth the most communication per byte of summing, slicing and concatenating.
    ``free``: instructions whose slicing (an outside operand) or concatenation (a member)
    the rewrite does not do (loop state carried in chunks, ``carried_splits``).
    ``loop_body``: the region's computation is a while body (a value it returns is read
    by the next iteration).
    """
    bw = cost_model.gpu.hbm_bytes_per_s / 1e6  # bytes per µs
    waited = _gemm_waits_for(region.collective.parent, loop_body)
    comm = lost = 0.0
    for inst, plan in region.plans.items():
        if not inst.is_collective or plan.partial is not None:
            continue
        groups = device_groups(inst, num_devices)
        t = cost_model.collective(inst.opcode, payload_bytes(inst), groups).time_us
        scattered = reduce_scatter_slice(inst, groups)
        if scattered is not None:
            # XLA runs this all-reduce as a reduce-scatter; split with its slice left
            # outside, each chunk's all-reduce stays one (the slice reads their
            # concatenation): the difference is lost
            rs = cost_model.collective("reduce-scatter", payload_bytes(inst), groups).time_us
            if scattered not in region.plans:
                lost += max(t - rs, 0.0)
            t = rs
        # only communication that a GEMM waits for is worth a split: one
        # whose result only goes to an accumulator or out of the step (a data-parallel
        # weight gradient before the optimizer) overlaps the rest of the step unsplit
        if id(inst) in waited:
            comm += t
    moved = 0.0
    sliced: set = set()
    for inst, plan in region.plans.items():
        if plan.partial is not None:
            size = inst.shape.byte_size
            if inst.opcode == "dot" and inst.shape.dtype in ("bf16", "f16"):
                size = 4 * math.prod(inst.shape.dims)  # half-precision dots sum in f32
            moved += 3 * size * (n - 1)
        for op, d in zip(inst.operands, plan.operand_dims, strict=True):
            if d is not None and op not in region.plans and id(op) not in sliced \
                    and op not in free:
                sliced.add(id(op))
                # XLA slices a broadcast's operand instead (slice(broadcast(x)) ->
                # broadcast(slice(x))); a broadcast of a scalar or of an unsplit vector
                # costs nothing sliced (the rewrite clones it per chunk)
                src = op.operands[0] if op.opcode == "broadcast" and op.operands else op
                moved += 2 * src.shape.byte_size
        if inst.opcode in ("dot", "convolution"):
            # every chunk reads the operands it uses whole: n - 1 more reads of each (the
            # weights of a batch split; the activations of a hidden-axis split)
            for op, d in zip(inst.operands, plan.operand_dims, strict=True):
                if d is None:
                    moved += (n - 1) * op.shape.byte_size
        if plan.partial is None and not plan.replicable and inst not in free and any(
                u not in region.plans for u in inst.users):
            moved += 2 * inst.shape.byte_size
    return RegionScore(comm, moved / bw + lost)


def reduce_scatter_slice(coll, groups) -> object | None:
    """The dynamic-slice that makes the all-reduce ``coll`` a reduce-scatter in XLA's
    pipeline (``ReduceScatterCreator``: the partitioner's all-reduce whose only user keeps
    each rank's ``1/group`` of one dimension at a computed offset), else None. Shapes only:
    the offset is not proven to be the rank's (XLA checks that); a wrong guess costs a score,
    never a result."""
    users = coll.users
    if coll.opcode != "all-reduce" or len(users) != 1 or not coll.shape.is_array:
        return None
    ds = users[0]
    if ds.opcode != "dynamic-slice" or ds.operands[0] is not coll:
        return None
    size = len(groups[0]) if groups else 1
    dims, out = coll.shape.dims, ds.shape.dims
    cut = [d for d in range(len(dims)) if out[d] != dims[d]]
    if size < 2 or len(cut) != 1 or out[cut[0]] * size != dims[cut[0]] \
            or ds.operands[1 + cut[0]].opcode == "constant":
        return None
    return ds


def _gemm_waits_for(comp, loop_body: bool) -> set:
    """Ids of the instructions of ``comp`` that some dot or convolution waits for (its
    ancestors; in a loop body also through the loop state: a value the root returns at
    index ``j`` is waited for where the next iteration's reads of element ``j`` are). Not
    collectives: every gradient reaches the all-reduce of a global-norm clip, which would
    make every gradient collective look critical. One backward walk from the GEMMs."""
    root = comp.root
    next_reads: dict = {}  # a get-tuple-element of the loop state -> the root operand it reads
    if loop_body and comp.parameters and root is not None and root.opcode == "tuple":
        for g in comp.parameters[0].users:
            if g.opcode == "get-tuple-element" and g.tuple_index < len(root.operands):
                next_reads[id(g)] = root.operands[g.tuple_index]
    waited: set = set()
    stack = [op for i in comp.instructions if i.opcode in ("dot", "convolution")
             for op in i.operands]
    while stack:
        x = stack.pop()
        if id(x) in waited:
            continue
        waited.add(id(x))
        stack.extend(x.operands)
        if id(x) in next_reads:
            stack.append(next_reads[id(x)])
    return waited


def _sources(coll, axis: int, comp) -> list[tuple[object, int]]:
    """Backward walk from ``coll`` along ``axis``: the instructions where the split starts."""
    seen: set = set()
    out: list[tuple[object, int]] = []
    stack = [(coll, axis)]
    while stack:
        inst, dim = stack.pop()
        if (id(inst), dim) in seen:
            continue
        seen.add((id(inst), dim))
        m = rules.axis_map(inst) if joinable(inst, comp) else {}
        if dim not in m or (inst.opcode in ("broadcast", "iota") and all(d is None for d in m[dim])):
            if inst.opcode not in ("broadcast", "iota", "constant"):
                out.append((inst, dim))
            continue
        stack.extend((op, d) for op, d in zip(inst.operands, m[dim], strict=True) if d is not None)
    return out


def _reducer(inst) -> str | None:
    comp = inst.to_apply
    if comp is None or comp.root is None:
        return None
    return _PARTIAL_REDUCERS.get(comp.root.opcode)


def _partial_plan(inst, avail: dict) -> SplitPlan | None:
    """The plan of ``inst`` as a partial member, or None (see the module docstring)."""
    split = {i: avail[op] for i, op in enumerate(inst.operands) if op in avail}
    if inst.opcode == "dot":
        lc = _attrs.parse_int_list(inst.attr("lhs_contracting_dims", "{}"))
        rc = _attrs.parse_int_list(inst.attr("rhs_contracting_dims", "{}"))
        if len(inst.operands) != 2 or not lc:
            return None
        pair = None
        for a, b in zip(lc, rc, strict=True):
            if split.get(0) == a or split.get(1) == b:
                pair = (a, b)
        if pair is None:
            return None
        dims = (pair[0], pair[1])
        if any(split.get(i) is not None and split[i] != dims[i] for i in (0, 1)):
            return None
        return SplitPlan(0, dims, partial="add")
    if inst.opcode == "reduce" and len(inst.operands) == 2 and 0 in split and 1 not in split:
        d = split[0]
        if d not in (inst.dimensions or []):
            return None
        red = _reducer(inst)
        init = inst.operands[1]
        if red is None or (red == "add" and not (init.opcode == "constant" and _is_zero(init))):
            return None
        return SplitPlan(0, (d, None), partial=red)
    return None


def _is_zero(const) -> bool:
    lit = (const.literal or "").strip().strip("{}").strip()
    try:
        return float(lit) == 0.0
    except ValueError:
        return False


def build_region(coll, axis: int) -> Region | None:
    """The region of collective ``coll`` along its output dimension ``axis`` (module docstring).

    Returns:
      The region, or None when ``coll`` does not split along ``axis``.
    """
    comp = coll.parent
    if axis not in rules.axis_map(coll):
        return None
    region = _propagate(coll, axis, comp, _sources(coll, axis, comp))
    return region if coll in region.plans else None


def _propagate(coll, axis: int, comp, sources) -> Region:
    """Forward propagation in program order from ``sources`` (see the module docstring)."""
    region = Region(coll, axis)
    region.sources = list(sources)
    avail: dict = {}  # instruction -> the dimension its chunks split (sources and members)
    for src, d in region.sources:
        avail[src] = d
    source_set = {id(s) for s, _ in region.sources}
    for inst in comp.post_order():
        if id(inst) in source_set or not joinable(inst, comp):
            continue
        split_ops = [(i, avail[op]) for i, op in enumerate(inst.operands) if op in avail]
        if not split_ops:
            continue
        plan = None
        for out, dims in rules.axis_map(inst).items():
            # a partial member's result is whole (the sum of its chunks): read whole only
            if all(dims[i] == d for i, d in split_ops) and not any(
                    dims[i] is not None and op in region.plans
                    and region.plans[op].partial is not None
                    for i, op in enumerate(inst.operands)):
                plan = SplitPlan(out, dims)
                break
        if plan is None:
            plan = _partial_plan(inst, avail)
            if plan is None:
                continue  # outside: reads a concatenation
            region.partial.append(inst.name)
        else:
            avail[inst] = plan.out_dim
        region.plans[inst] = plan
    return region


def pull_in_inputs(region: Region, comp, rounds: int = 1) -> Region:
    """Bring into ``region`` the outside operands it slices that could split themselves.

    An outside operand that members read sliced along ``d``, whose rule maps ``d`` (it
    could be a member), that is not a broadcast or iota the rewrite clones anyway, and
    whose every user is a (non-partial) member reading it along ``d``, is split at its
    sources instead: the backward walk from it (``_sources``) adds them and the region is
    propagated again (up to ``rounds`` times). So a second batch input that only meets
    the region late (a loss's targets, a mask) is sliced where it is small, instead of
    being computed whole and sliced where it is large: GPT's one-hot targets are an
    f32[batch, seq, vocab] that XLA would otherwise materialise to slice (measured in
    docs/DECISIONS.md D25).
    """
    def walk(current: Region, op, d):
        if not joinable(op, comp) or d not in rules.axis_map(op) or _replicable(op, d):
            return None
        plans = current.plans
        if all(u in plans and plans[u].partial is None
               and all(ud == d for o, ud in zip(u.operands, plans[u].operand_dims, strict=True)
                       if o is op)
               for u in op.users):
            return _sources(op, d, comp)
        return None

    return _grow(region, comp, rounds, walk)


def _replicable(inst, dim: int) -> bool:
    """A broadcast or iota whose operand does not carry ``dim``: cloned per chunk anyway."""
    return inst.opcode in ("broadcast", "iota") and all(
        d is None for d in rules.axis_map(inst).get(dim, (0,)))


def grow_through_carries(region: Region, comp, rounds: int = 4) -> Region:
    """In a while body: bring into ``region`` the loop state it reads split.

    An outside operand that the region slices along ``d`` and whose backward walk along
    ``d`` (``_sources``) ends only at ``get-tuple-element`` s of the body's parameter (a
    carried activation, possibly through a copy or a convert) joins with those as new
    sources, and the region is propagated again (up to ``rounds`` times). Then the carried
    value is split at its source and can be carried in chunks across iterations
    (``hlo_passes.decompose.rewrite.split_while_body``) instead of being sliced in every
    iteration.
    """
    params = comp.parameters
    if len(params) != 1:
        return region
    param = params[0]

    def walk(_current: Region, op, d):
        found = _sources(op, d, comp)
        if found and all(s.opcode == "get-tuple-element" and s.operands
                         and s.operands[0] is param for s, _ in found):
            return found
        return None

    return _grow(region, comp, rounds, walk)


def _grow(region: Region, comp, rounds: int, walk) -> Region:
    """Up to ``rounds`` times: for each outside operand ``op`` the region reads sliced along
    ``d``, ``walk(region, op, d)`` gives the (instruction, dim) pairs to add as sources (or
    None); new sources (one split dimension each) are added and the region propagated
    again (``pull_in_inputs``, ``grow_through_carries``)."""
    for _ in range(rounds):
        seen = {(id(s), d) for s, d in region.sources}
        taken = {id(s) for s, _ in region.sources}  # one split dimension per source
        new: list = []
        for inst, plan in region.plans.items():
            for op, d in zip(inst.operands, plan.operand_dims, strict=True):
                if d is None or op in region.plans or (id(op), d) in seen:
                    continue
                for w in walk(region, op, d) or ():
                    if id(w[0]) not in taken and (id(w[0]), w[1]) not in seen:
                        taken.add(id(w[0]))
                        seen.add((id(w[0]), w[1]))
                        new.append(w)
                seen.add((id(op), d))
        if not new:
            break
        grown = _propagate(region.collective, region.axis, comp, region.sources + new)
        if region.collective not in grown.plans:
            break
        region = grown
    return region
