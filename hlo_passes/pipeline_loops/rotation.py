"""Loop rotation: finish one iteration's last collective during the next.

``rotation_candidates`` / ``rotation_of`` find the loops whose last collective can move into
the next iteration (``Rotation``); ``rotate_loop`` applies it. Deciding whether it pays is the
caller's job (``hlo_passes.pipeline_loops.decide.decide_rotation``).
"""

from __future__ import annotations

import dataclasses
import json

from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.loops import (
    LoopInfo,
    analyze_while,
    through_casts,
)
from hlo_passes.pipeline_loops.loop_state import clone_with_operands, with_elements
from hlo_passes.pipeline_loops.prefetch import loop_shape_problem

__all__ = ["RECOMPUTE_EXPANSION", "Rotation", "rotate_loop", "rotation_candidates", "rotation_of"]

_NO_CARRY = frozenset({"constant", "iota"})
"""Operands of the rotated tail recomputed where the tail is, not carried."""

RECOMPUTE_EXPANSION = 4
"""A ``broadcast`` the tail reads is recomputed in the tail (its operand carried instead of
its result) when its result is at least this many times its operand's bytes."""

_SHAREABLE_CALLS = frozenset({
    "reduce", "all-reduce", "reduce-scatter", "reduce-window", "scatter", "select-and-scatter",
    "sort", "map",
})
"""Opcodes whose called computation (a reducer) may be shared by a clone."""


@dataclasses.dataclass(frozen=True)
class Rotation:
    """A rotation of a loop body around one of its collectives (``rotate_loop``).

    Attributes:
      collective: the body collective whose completion moves into the next iteration.
      tail: names of the body instructions moved (the collective and everything after it
        that the next iteration's state needs), in body order.
      slots: loop-state indices the tail computes.
      carried: names of the values the tail reads from the rest of the body, now carried.
      bytes: size of ``carried``: the extra loop state.
      recomputed: names of the head's broadcasts the tail reads, cloned into the tail
        (their small operands are carried instead: a bias broadcast to the activations'
        shape costs its vector, not a second activation, in the loop state).
    """

    collective: str
    tail: tuple[str, ...]
    slots: tuple[int, ...]
    carried: tuple[str, ...]
    bytes: int
    recomputed: tuple[str, ...] = ()


def _unclonable(insts) -> str | None:
    for x in insts:
        if x.called_computations and x.opcode not in _SHAREABLE_CALLS:
            return f"%{x.name} ({x.opcode}) calls a computation"
    return None


def rotation_of(module, inst: Instruction, collective: str) -> tuple[Rotation | None, str | None]:
    """The rotation of ``inst``'s body around ``collective``: ``(rotation, None)`` or
    ``(None, why not)``.

    The *tail* is the collective and every body instruction that uses it, transitively (the
    root excepted); the rest of the body is the *head*. The tail must not hold another
    collective nor compute the loop counter or anything the condition reads, and no control
    dependency may cross the cut.
    """
    info = analyze_while(inst)
    problem = loop_shape_problem(module, inst, info)
    if problem is not None:
        return None, problem
    body = module.computation(info.body)
    try:
        coll = body.instruction(collective)
    except KeyError:
        return None, f"%{collective} is not in %{body.name}"
    return _rotation(module, info, coll)


def rotation_candidates(module, inst: Instruction) -> list[Rotation]:
    """Every rotation of ``inst``'s body (one per synchronous collective that allows one)."""
    info = analyze_while(inst)
    if loop_shape_problem(module, inst, info) is not None:
        return []
    body = module.computation(info.body)
    rotations = [_rotation(module, info, x)[0] for x in body.instructions
                 if x.is_collective and x.async_role is None]
    return [r for r in rotations if r is not None]


def _rotation(module, info: LoopInfo, coll: Instruction) -> tuple[Rotation | None, str | None]:
    """``rotation_of`` for a loop whose shape ``loop_shape_problem`` accepted."""
    if not info.trip_count:
        return None, "zero trips"
    body, cond = module.computation(info.body), module.computation(info.condition)
    root, param = body.root, body.parameters[0]
    if not coll.is_collective or coll.async_role is not None:
        return None, f"%{coll.name} is not a synchronous collective"
    tail: dict[int, Instruction] = {}
    stack = [coll]
    while stack:
        x = stack.pop()
        if x is root or id(x) in tail:
            continue
        tail[id(x)] = x
        stack.extend(x.users)
    if any(x is not coll and x.is_collective for x in tail.values()):
        return None, "another collective uses its result"
    for x in body.instructions:
        if any((id(p) in tail) != (id(x) in tail) for p in x.control_predecessors):
            return None, "a control dependency crosses the cut"
    slots = tuple(j for j, o in enumerate(root.operands) if id(o) in tail)
    if not slots:
        return None, "the next iteration does not read its result"
    if info.induction_index in slots:
        return None, "it computes the loop counter"
    read = {u.tuple_index for u in cond.parameters[0].users}
    if read & set(slots):
        return None, "the condition reads what it computes"
    order = [x for x in body.instructions if id(x) in tail]
    head = [x for x in body.instructions if id(x) not in tail and x is not root]
    why = _unclonable(order) or _unclonable(head)
    if why is not None:
        return None, why
    # Slots the tail reads from the state itself, not carried: those it computes (one
    # iteration late, a slot holds exactly the value the late tail needs) and the
    # loop-invariant ones.
    direct = set(slots) | {c.index for c in info.carried if c.invariant}
    carried: list[Instruction] = []
    recomputed: list[Instruction] = []

    def read(o: Instruction) -> None:  # the tail reads head value ``o``: carry or recompute it
        if id(o) in tail or o.opcode in _NO_CARRY or o in carried or o in recomputed:
            return
        if o.opcode == "get-tuple-element" and o.operands[0] is param and o.tuple_index in direct:
            return
        if o.opcode == "broadcast" and o.shape.is_array and len(o.operands) == 1 \
                and o.operands[0].shape.is_array \
                and o.shape.byte_size >= RECOMPUTE_EXPANSION * o.operands[0].shape.byte_size:
            recomputed.append(o)
            read(o.operands[0])
            return
        carried.append(o)

    for x in order:
        for o in x.operands:
            read(o)
    if any(o is param or o.shape.is_tuple for o in carried):
        return None, "the tail reads a tuple of the head"
    if any(through_casts(o).is_collective for o in carried):
        # e.g. add(all-reduce(a), all-reduce(b)) cut between its operands: XLA's all-reduce
        # reassociation (one all-reduce of a + b) would be lost, one more transfer per trip
        return None, "the tail combines its collective with another collective's result"
    return Rotation(coll.name, tuple(x.name for x in order), slots, tuple(o.name for o in carried),
                    sum(o.shape.byte_size for o in carried), tuple(o.name for o in recomputed)), None


def _set_trip_count(inst: Instruction, trips: int) -> None:
    raw = inst.backend_config
    if not raw:
        return
    try:
        config = json.loads(raw)
    except ValueError:
        return
    if isinstance(config, dict) and "known_trip_count" in config:
        config["known_trip_count"] = {"n": str(trips)}
        inst.backend_config = json.dumps(config, separators=(",", ":"))


def rotate_loop(module, inst: Instruction, collective: str) -> Rotation:
    """Rotates ``inst``'s body so that ``collective`` of iteration ``i`` completes in iteration ``i + 1``.

    ::

        before                                  after
        ------                                  -----
        S = init                                S, V = H(init)                <- prologue
        while i < L:                            while i < L:                  (L - 1 trips)
          S = T(H(S))                             S_T = T(V)                  <- last iteration's tail
                                                  S, V = H(S with S_T)
                                                S_T = T(V)                    <- epilogue

    ``T`` (the tail, ``rotation_of``) is the collective and what depends on it; ``H`` the
    rest of the body; ``V`` the values ``T`` reads from ``H``, now carried in the loop
    state (appended elements). The loop state's elements ``T`` computes stay in their slots
    one iteration late (the rotated body returns the value it just completed); the loop's
    users read them from the epilogue. Same operations on the same values: results are
    bitwise equal. Cost: ``V`` is carried across iterations, and one iteration's head runs
    before the loop.

    Raises:
      ValueError: the rotation is not possible (``rotation_of`` says why).
    """
    rot, why = rotation_of(module, inst, collective)
    if rot is None:
        raise ValueError(f"cannot rotate %{inst.name} around %{collective}: {why}")
    info = analyze_while(inst)
    parent = inst.parent
    body, cond = module.computation(info.body), module.computation(info.condition)
    root, bparam, cparam = body.root, body.parameters[0], cond.parameters[0]
    init = inst.operands[0]
    n = len(inst.shape.elements)
    tail = [body.instruction(t) for t in rot.tail]
    # The head's broadcasts the tail reads: a clone of each joins the tail (before its
    # first reader there), the head keeps the original where it reads it too.
    for name in rot.recomputed:
        o = body.instruction(name)
        clone = body.add_instruction(clone_with_operands(o, list(o.operands), module), after=o)
        readers = [x for x in tail if any(op is o for op in x.operands)]
        for x in readers:
            x.replace_operand(o, clone)
        tail.insert(min(tail.index(x) for x in readers), clone)
        if not o.users and o is not root:
            body.remove_instruction(o)
    in_tail = {id(x) for x in tail}
    carried = [body.instruction(c) for c in rot.carried]

    # Prologue: the head at the initial state, before the loop.
    pmap: dict[int, Instruction] = {}

    def at_init(x):
        if x.opcode == "get-tuple-element" and x.operands[0] is bparam:
            return init.operands[x.tuple_index]
        return pmap.get(id(x))

    for x in body.instructions:
        if id(x) in in_tail or x is root or x is bparam:
            continue
        if x.opcode == "get-tuple-element" and x.operands[0] is bparam:
            continue
        pmap[id(x)] = parent.add_instruction(clone_with_operands(x, [at_init(o) for o in x.operands], module),
                                             before=init)
    first = [at_init(o) if id(o) not in in_tail else init.operands[j]
             for j, o in enumerate(root.operands)]
    first += [at_init(v) for v in carried]
    # The counter after the first run as a constant, so that the trip count stays static.
    k = info.induction_index
    if info.init is not None and info.step is not None and not init.operands[k].shape.is_tuple:
        first[k] = parent.add_instruction(Instruction(
            module.unique_name("rotated_counter"), "constant", init.operands[k].shape, [], {},
            literal=str(info.init + info.step)), before=init)

    # The body: the tail reads the carried values; the head reads the tail's results.
    new_shape = with_elements(inst.shape, [v.shape for v in carried])
    gtes = []
    for m, v in enumerate(carried):
        g = Instruction(module.unique_name(f"{v.name}.rotated"), "get-tuple-element", v.shape,
                        [bparam], {"index": str(n + m)})
        gtes.append(body.add_instruction(g, after=gtes[-1] if gtes else bparam))
    for x in tail:
        for m, v in enumerate(carried):
            if any(o is v for o in x.operands):
                x.replace_operand(v, gtes[m])
    late = {}  # head's read of a slot the tail computes -> that tail value
    for u in list(bparam.users):
        if u.opcode == "get-tuple-element" and u.tuple_index in rot.slots:
            value = late[id(u)] = root.operands[u.tuple_index]
            for user in [x for x in u.users if id(x) not in in_tail]:
                user.replace_operand(u, value)
            if root is not value and any(o is u for o in root.operands):
                root.set_operands([value if o is u else o for o in root.operands])
    root.set_operands(list(root.operands) + [late.get(id(v), v) for v in carried])
    root.shape = new_shape
    bparam.shape = new_shape
    cparam.shape = new_shape
    # Topological order: the tail (and the constants it reads) right after the carried reads.
    consts = [o for x in tail for o in x.operands if o.opcode in _NO_CARRY and id(o) not in in_tail]
    mine = {id(g) for g in gtes}
    direct = list({id(o): o for x in tail for o in x.operands if id(o) not in mine
                   and o.opcode == "get-tuple-element" and o.operands[0] is bparam}.values())
    front = [bparam] + gtes + direct
    ids = {id(x) for x in front}
    for x in consts + tail:
        if id(x) not in ids:
            front.append(x)
            ids.add(id(x))
    body.set_order(front + [x for x in body.instructions if id(x) not in ids])
    for u in [u for u in bparam.users if not u.users and u.opcode == "get-tuple-element"
              and u.tuple_index in rot.slots and u is not root]:
        body.remove_instruction(u)

    # The loop: the head's first run as its initial state, one trip fewer.
    new_init = parent.add_instruction(
        Instruction(module.unique_name(f"{init.name}.rotated"), "tuple", new_shape, first), before=inst)
    inst.replace_operand(init, new_init)
    if not init.users:
        parent.remove_instruction(init)
    inst.shape = new_shape
    _set_trip_count(inst, info.trip_count - 1)

    # Epilogue: the last iteration's tail, after the loop.
    emap: dict[int, Instruction] = {}
    after = inst
    for m, v in enumerate(carried):
        g = Instruction(module.unique_name(f"{v.name}.last"), "get-tuple-element", v.shape, [inst],
                        {"index": str(n + m)})
        emap[id(gtes[m])] = after = parent.add_instruction(g, after=after)
    for x in direct:
        if id(x) not in emap:  # a slot the tail reads from the state: the loop's result
            g = Instruction(module.unique_name(f"{x.name}.last"), "get-tuple-element", x.shape, [inst],
                            {"index": str(x.tuple_index)})
            emap[id(x)] = after = parent.add_instruction(g, after=after)
    for x in consts + tail:
        if id(x) in emap:
            continue
        ops = [emap[id(o)] for o in x.operands]
        emap[id(x)] = after = parent.add_instruction(clone_with_operands(x, ops, module), after=after)
    ours = {id(x) for x in emap.values()}
    for u in list(inst.users):
        if u.opcode == "get-tuple-element" and u.tuple_index in rot.slots and id(u) not in ours:
            parent.replace_all_uses(u, emap[id(root.operands[u.tuple_index])])
            parent.remove_instruction(u)
    return rot
