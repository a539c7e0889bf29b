"""Rewrite: merge compatible synchronous collectives into one variadic collective.

``all-reduce`` and ``all-gather`` take several operands in HLO (XLA's own
``all-reduce-combiner`` / ``all-gather-combiner`` produce that form): the result
is a tuple with one element per operand, each element exactly what the
collective of that operand alone would give (element-wise the same reduction
over the same group, in the same order), so a fused collective followed by
``get-tuple-element``s is bitwise equal to the collectives it replaces.

Which collectives are *compatible* is ``fusion_key`` (equal keys fuse): same
opcode, one array operand each, the same expanded replica groups, the same
cross-replica/partition mode (channel id present or not,
``use_global_device_ids``), the same gather dimension, the same element type
and, for reductions, reducer computations of the same structure (the SPMD
partitioner gives every all-reduce its own clone of ``add``). Whether a group
may fuse without a cycle (no member reaching another) is the caller's
decision; ``fuse_group`` re-checks it and raises otherwise.

References: Concerto (ASPLOS'25) §4.5, Algorithm 1 (collective fusion).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hlo_passes.ir.computation import Computation
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.shapes import Shape

__all__ = ["FUSIBLE_OPCODES", "cross_replica_variadic_all_reduces", "fusion_key", "fuse_group",
           "stable_topological_order"]

FUSIBLE_OPCODES = frozenset({"all-reduce", "all-gather"})
"""Synchronous collectives with a variadic form that XLA parses and compiles (jaxlib 0.10.2)."""

_KEY_ATTRS = {
    # opcode -> attributes (besides groups, mode and dtype) that must be equal.
    "all-reduce": ("to_apply",),
    "all-gather": ("dimensions",),
}


def _computation_key(comp) -> tuple:
    """Structure of a (reducer) computation: opcodes, shapes, operand wiring, literals."""
    index = {inst.name: i for i, inst in enumerate(comp.instructions)}
    return tuple((inst.opcode, str(inst.shape.without_layout()), inst.parameter_number,
                  inst.literal, tuple(index[o.name] for o in inst.operands),
                  inst is comp.root) for inst in comp.instructions)


def fusion_key(inst: Instruction) -> tuple | None:
    """What must be equal for ``inst`` to fuse with another collective (None: never fuses).

    Only single-operand, array-shaped ``all-reduce``/``all-gather`` without
    control dependencies or sharding qualify.
    """
    if inst.opcode not in FUSIBLE_OPCODES or inst.shape.is_tuple or len(inst.operands) != 1:
        return None
    if inst.control_predecessors or any(inst in u.control_predecessors for u in inst.users):
        return None
    if "sharding" in inst.attrs:
        return None
    groups = inst.replica_groups
    key: list = [inst.opcode, inst.shape.dtype, inst.operands[0].shape.dtype,
                 None if groups is None else tuple(tuple(g) for g in groups),
                 inst.channel_id is not None, inst.use_global_device_ids]
    for attr in _KEY_ATTRS[inst.opcode]:
        value = inst.attrs.get(attr)
        if attr == "to_apply":
            key.append(None if value is None else _computation_key(value))
        else:
            key.append(tuple(inst.dimensions or ()) if attr == "dimensions" else value)
    return tuple(key)


def stable_topological_order(comp: Computation, rank: dict[int, float]) -> list[Instruction]:
    """A topological order of ``comp`` that follows ``rank`` (by ``id(inst)``) where it can.

    Kahn's algorithm with a priority queue: among the instructions whose operands and
    control predecessors are placed, the lowest rank goes first (ties: current order).
    """
    pos = {id(inst): i for i, inst in enumerate(comp.instructions)}
    deps = {id(inst): {id(d) for d in inst.operands + inst.control_predecessors
                       if d.parent is comp} for inst in comp.instructions}
    users: dict[int, list[Instruction]] = {id(i): [] for i in comp.instructions}
    for inst in comp.instructions:
        for d in deps[id(inst)]:
            users[d].append(inst)
    waiting = {k: len(v) for k, v in deps.items()}
    heap = [(rank.get(id(i), pos[id(i)]), pos[id(i)], id(i), i)
            for i in comp.instructions if not waiting[id(i)]]
    heapq.heapify(heap)
    order: list[Instruction] = []
    while heap:
        *_, inst = heapq.heappop(heap)
        order.append(inst)
        for u in users[id(inst)]:
            waiting[id(u)] -= 1
            if not waiting[id(u)]:
                heapq.heappush(heap, (rank.get(id(u), pos[id(u)]), pos[id(u)], id(u), u))
    if len(order) != len(comp.instructions):
        raise ValueError(f"%{comp.name} has a dependency cycle: {len(comp.instructions) - len(order)} "
                         "instructions cannot be ordered")
    return order


def _reaches(sources: Sequence[Instruction], targets: set[int], comp: Computation) -> bool:
    """Whether an instruction in ``targets`` (ids) depends, transitively, on one of ``sources``."""
    control_users: dict[int, list[Instruction]] = {}
    for inst in comp.instructions:
        for p in inst.control_predecessors:
            control_users.setdefault(id(p), []).append(inst)

    def dependents(inst: Instruction) -> list[Instruction]:
        return list(inst.users) + control_users.get(id(inst), [])

    seen: set[int] = set()
    stack = [u for s in sources for u in dependents(s)]
    while stack:
        inst = stack.pop()
        if id(inst) in targets:
            return True
        if id(inst) in seen:
            continue
        seen.add(id(inst))
        stack.extend(dependents(inst))
    return False


def fuse_group(comp: Computation, members: Sequence[Instruction]) -> Instruction:
    """Replace ``members`` (compatible collectives of ``comp``) by one variadic collective.

    The fused collective takes every member's operand; each member's users read its
    element through a ``get-tuple-element``. The computation is reordered
    topologically, the fused collective where the first member was (or as early as
    its operands allow), everything else in its current order.

    Args:
      comp: the computation holding the members.
      members: two or more collectives with equal, non-None ``fusion_key``.

    Returns:
      The fused collective.

    Raises:
      ValueError: fewer than two members, members not in ``comp``, keys that differ,
        or a member that depends on another (fusing would create a cycle).
    """
    if len(members) < 2:
        raise ValueError(f"a fused collective needs two or more members, got {len(members)}")
    keys = {fusion_key(m) for m in members}
    if None in keys or len(keys) != 1:
        names = ", ".join("%" + m.name for m in members)
        raise ValueError(f"collectives {names} are not compatible (expected one fusion key, "
                         f"found {len(keys)}{' including an unfusible one' if None in keys else ''})")
    if any(m not in comp for m in members):
        raise ValueError(f"every member must belong to %{comp.name}")
    ids = {id(m) for m in members}
    if _reaches(members, ids, comp):
        raise ValueError("a member depends on another: fusing them would create a cycle; "
                         "fuse only collectives that are independent in the graph")
    pos = {id(i): k for k, i in enumerate(comp.instructions)}
    members = sorted(members, key=lambda m: pos[id(m)])
    first = members[0]
    module = comp.module
    attrs = {k: v for k, v in first.attrs.items() if k != "control-predecessors"}
    shape = Shape.tuple_of([m.shape for m in members])
    name = module.unique_name(first.opcode) if module is not None else first.name + ".fused"
    fused = Instruction(name, first.opcode, shape, [m.operands[0] for m in members], attrs)
    comp.add_instruction(fused, before=first)
    rank = {id(i): float(k) for k, i in enumerate(comp.instructions)}
    for k, m in enumerate(members):
        gte = Instruction(module.unique_name("get-tuple-element") if module is not None
                          else f"{m.name}.gte", "get-tuple-element", m.shape, [fused],
                          {"index": str(k)})
        comp.add_instruction(gte, after=m)
        rank[id(gte)] = rank[id(m)]
        if "metadata" in m.attrs:
            gte.attrs["metadata"] = m.attrs["metadata"]
        comp.replace_all_uses(m, gte)
        comp.remove_instruction(m)
    comp.set_order(stable_topological_order(comp, rank))
    return fused


def cross_replica_variadic_all_reduces(module) -> int:
    """In a replicated program (N replicas x 1 partition), write variadic all-reduces in
    cross-replica form: no ``channel_id``, no ``use_global_device_ids``, same groups.

    With one partition the flattened global ids are the replica ids, so the meaning is
    unchanged. Needed because XLA compiles an all-reduce with a channel id outside SPMD
    mode as a cross-module one, and its layout assignment then fails on a tuple result
    (jaxlib 0.10.2, CPU: ``LogicalBuffer ... does not have a layout``; the same module
    without the channel id compiles and runs).

    Returns:
      The number of all-reduces rewritten.

    Raises:
      ValueError: the module has more than one partition.
    """
    if module.num_partitions != 1:
        raise ValueError(f"expected a replicated module (1 partition), found "
                         f"{module.num_partitions} partitions")
    changed = 0
    for inst in module.instructions():
        if inst.opcode == "all-reduce" and inst.shape.is_tuple and inst.channel_id is not None \
                and inst.use_global_device_ids:
            inst.channel_id = None
            inst.set_attr("use_global_device_ids", None)
            changed += 1
    return changed
