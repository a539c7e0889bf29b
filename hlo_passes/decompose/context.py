"""Decomposition context: the ops around a collective that split with it along one axis.

From the collective D and one of its output dimensions, a breadth-first
search walks *backwards* through operands (the pre-context, which produces
D's input) and *forwards* through users (the post-context, which consumes
D's result). An op joins when its rule (``hlo_passes.decompose.rules``)
lets the axis pass and every operand already in the context splits the
way the op needs; the search stops at ops whose rule says the axis does
not split (a contraction over it, a reduction over it, an opcode without a
rule), at ops in another computation, and once each side's compute covers
the collective's time (the paper's stopping rule), or at a size limit.

References: Concerto (ASPLOS'25) §5.1, decomposition context.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from hlo_passes.decompose import rules
from hlo_passes.decompose.rewrite import SplitPlan, plans_divisible_by

_NEVER = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "while", "call",
                    "conditional", "custom-call", "rng", "rng-bit-generator",
                    "rng-get-and-update-state", "after-all", "send", "recv", "infeed", "outfeed",
                    "opt-barrier", "partition-id", "replica-id"})
"""Opcodes that never join a context (no data to split, side effects, or tuple plumbing)."""


@dataclasses.dataclass
class Context:
    """One collective's decomposition context along one axis.

    Attributes:
      collective: the collective instruction D.
      axis: D's output dimension that is split.
      plans: every member (D included) -> how it splits.
      pre: members that D depends on.
      post: members that depend on D.
      pre_us / post_us: compute time of the pre / post members.
    """

    collective: object
    axis: int
    plans: dict = dataclasses.field(default_factory=dict)
    pre: list = dataclasses.field(default_factory=list)
    post: list = dataclasses.field(default_factory=list)
    pre_us: float = 0.0
    post_us: float = 0.0

    def members(self) -> set[str]:
        return {i.name for i in self.plans}

    def divisible_by(self, n: int) -> bool:
        """Every split dimension (members and sliced operands) divides by ``n``."""
        return plans_divisible_by(self.plans, n)

    def max_degree(self) -> int:
        """The largest split size (an upper bound on useful degrees)."""
        return min(i.shape.dims[p.out_dim] for i, p in self.plans.items())

    def trimmed(self, keep_pre: bool, keep_post: bool,
                cost_of: Callable[[object], float]) -> Context:
        """This context without its pre side or its post side (the collective stays).

        Every slice and concatenation the split adds is a memory pass on the unfused
        graph; a side whose ops need large outside operands sliced can cost more than it
        hides, so the search also prices the one-sided contexts. Pre members left with a
        user outside are dropped too (a concatenation would undo their split), and so are
        the broadcasts/iotas no kept member reads.
        """
        kept = {self.collective}
        kept |= set(self.pre) if keep_pre else set()
        kept |= set(self.post) if keep_post else set()
        changed = True
        while changed:  # pre members must have all their users in the context
            changed = False
            for inst in list(kept):
                if inst in self.pre and any(u not in kept for u in inst.users):
                    kept.discard(inst)
                    changed = True
        out = Context(self.collective, self.axis)
        for inst, plan in self.plans.items():
            if inst in kept:
                out.plans[inst] = plan
        for inst, plan in self.plans.items():
            if plan.replicable and any(u in kept for u in inst.users):
                out.plans[inst] = plan
        out.pre = [i for i in self.pre if i in kept]
        out.post = [i for i in self.post if i in kept]
        out.pre_us = sum(cost_of(i) for i in out.pre)
        out.post_us = sum(cost_of(i) for i in out.post)
        return out


def joinable(inst, comp) -> bool:
    return (inst.parent is comp and inst.opcode not in _NEVER and inst.shape.is_array
            and not inst.shape.dynamic
            and not inst.control_predecessors
            and not any(inst in u.control_predecessors for u in inst.users))


_REPLICABLE = frozenset({"broadcast", "iota"})


def _replicable(inst, dims) -> bool:
    return inst.opcode in _REPLICABLE and all(d is None for d in dims)


def _add_replicable_operands(ctx: Context, inst, dims, comp) -> None:
    """Clone cheap broadcasts/iotas feeding a member instead of slicing them."""
    for op, d in zip(inst.operands, dims, strict=True):
        if d is None or op in ctx.plans or not joinable(op, comp):
            continue
        m = rules.axis_map(op)
        if d in m and _replicable(op, m[d]):
            ctx.plans[op] = SplitPlan(d, m[d], replicable=True)


def build_context(coll, axis: int, cost_of: Callable[[object], float], *,
                  cover_us: float | None = None, max_ops: int = 256) -> Context | None:
    """BFS the context of collective ``coll`` along its output dimension ``axis``.

    Args:
      coll: the collective instruction (a synchronous, array-shaped collective).
      axis: an output dimension of ``coll`` that its rule lets split.
      cost_of: compute time (µs) of an instruction on the target.
      cover_us: stop growing a side once its compute reaches this (None: no limit).
      max_ops: at most this many members per side.

    Returns:
      The context, or None when the collective itself does not split along ``axis``.
    """
    amap = rules.axis_map(coll)
    if axis not in amap:
        return None
    comp = coll.parent
    ctx = Context(coll, axis)
    ctx.plans[coll] = SplitPlan(axis, amap[axis])
    _add_replicable_operands(ctx, coll, amap[axis], comp)

    # Backwards: operands that produce the split slice of D's input.
    queue = deque((op, d) for op, d in zip(coll.operands, amap[axis], strict=True) if d is not None)
    while queue and len(ctx.pre) < max_ops:
        if cover_us is not None and ctx.pre_us >= cover_us:
            break
        inst, dim = queue.popleft()
        if (inst in ctx.plans and not ctx.plans[inst].replicable) or not joinable(inst, comp):
            continue
        m = rules.axis_map(inst)
        if dim not in m:
            continue
        replicable = _replicable(inst, m[dim])
        if not replicable and any(u not in ctx.plans for u in inst.users):
            continue  # used outside the context: a concatenation would undo the split
        ctx.plans[inst] = SplitPlan(dim, m[dim], replicable=replicable)
        if replicable:
            continue
        ctx.pre.append(inst)
        ctx.pre_us += cost_of(inst)
        _add_replicable_operands(ctx, inst, m[dim], comp)
        queue.extend((op, d) for op, d in zip(inst.operands, m[dim], strict=True) if d is not None)

    # Forwards: users that consume the split result.
    queue = deque([coll])
    while queue and len(ctx.post) < max_ops:
        if cover_us is not None and ctx.post_us >= cover_us:
            break
        src = queue.popleft()
        for user in list(src.users):
            if user in ctx.plans or not joinable(user, comp):
                continue
            plan = _forward_plan(user, ctx.plans)
            if plan is None:
                continue
            ctx.plans[user] = plan
            _add_replicable_operands(ctx, user, plan.operand_dims, comp)
            ctx.post.append(user)
            ctx.post_us += cost_of(user)
            queue.append(user)
    _drop_inconsistent(ctx)
    return ctx


def _forward_plan(user, plans) -> SplitPlan | None:
    """The plan of ``user`` under which every operand in the context splits as planned."""
    for out, dims in rules.axis_map(user).items():
        ok = any(op in plans for op in user.operands)
        for op, d in zip(user.operands, dims, strict=True):
            if op in plans and plans[op].out_dim != d:
                ok = False
                break
        if ok:
            return SplitPlan(out, dims)
    return None


def _drop_inconsistent(ctx: Context) -> None:
    """Remove pre members whose user in the context needs them split another way."""
    changed = True
    while changed:
        changed = False
        for inst, plan in list(ctx.plans.items()):
            for op, d in zip(inst.operands, plan.operand_dims, strict=True):
                if op in ctx.plans and ctx.plans[op].out_dim != d and op is not ctx.collective:
                    _remove(ctx, op)
                    changed = True


def _remove(ctx: Context, inst) -> None:
    del ctx.plans[inst]
    if inst in ctx.pre:
        ctx.pre.remove(inst)
    if inst in ctx.post:
        ctx.post.remove(inst)
