"""Software pipelining of while loops: prefetch next iteration's collectives (FSDP all-gather).

The rewrite, for a ``while`` whose body gathers a slice of loop-invariant
carried data selected by the loop counter (the stacked weights of scanned
layers under FSDP/ZeRO-3: ``all-gather(reshape(dynamic-slice(weights, i)))``)::

    before                                   after
    ------                                   -----
    init = tuple(i0, w, ...)                 y0   = all-gather(chain(w, i0))    <- prologue
    while(init)                              init = tuple(i0, w, ..., y0)
      body(i, w, ...):                       while(init)
        y = all-gather(chain(w, i))            body(i, w, ..., y):             <- y carried in
        ... uses y ...                           ... uses y ...
        return (i + 1, w, ...)                   y' = all-gather(chain(w, i + 1))
                                                 return (i + 1, w, ..., y')    <- prefetched

so the gather for iteration ``i + 1`` is issued during iteration ``i`` and the
scheduler can overlap it with that iteration's work. The last iteration's
prefetch reads an index one past the end: ``dynamic-slice`` clamps its start
indices, so it reads valid data that is never used (one extra gather per loop
run, the price of needing no epilogue). Values are unchanged (the same gather
of the same data), so results stay bitwise equal. Cost in memory: each
prefetched buffer (the gathered result) is carried across iterations, i.e.
live for the whole body on top of what the body held.

``prefetch_candidates`` finds the collectives the rewrite can move;
``pipeline_prefetch`` applies it. Deciding whether it pays is the caller's
job (``hlo_passes.pipeline_loops.decide`` schedules the body both ways).
"""

from __future__ import annotations

import dataclasses

from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.loops import (
    LoopInfo,
    analyze_while,
    loop_state_problem,
    side_effects,
)
from hlo_passes.pipeline_loops.loop_state import clone_with_operands, with_elements

__all__ = ["PrefetchCandidate", "loop_shape_problem", "pipeline_prefetch", "prefetch_candidates"]

_PREFETCHABLE = frozenset({"all-gather"})
"""Collective opcodes whose next-iteration instance may be issued one iteration early."""

_NOT_IN_CHAIN = frozenset({
    "parameter", "while", "conditional", "call", "custom-call", "rng", "rng-get-and-update-state",
    "infeed", "outfeed", "send", "recv", "send-done", "recv-done", "after-all",
})


@dataclasses.dataclass(frozen=True)
class PrefetchCandidate:
    """A collective of a loop body that can be issued one iteration early.

    Attributes:
      collective: its name in the body.
      chain: names of the body instructions computing its operand from the loop
        counter and loop-invariant carried values (operands first).
      bytes: size of its result: the extra buffer carried across iterations.
    """

    collective: str
    chain: tuple[str, ...]
    bytes: int


def loop_shape_problem(module, inst: Instruction, info: LoopInfo) -> str | None:
    """Why the loop cannot be rewritten (None if it can)."""
    body, cond = module.computation(info.body), module.computation(info.condition)
    if info.trip_count is None or info.induction_index is None or info.step is None:
        return f"trip count not static ({info.source})"
    if not inst.operands or inst.operands[0].opcode != "tuple":
        return "the initial loop state is not a tuple instruction"
    if side_effects(body) or side_effects(cond):
        return "the body or condition has side effects"
    return loop_state_problem(inst)


def prefetch_candidates(module, inst: Instruction) -> list[PrefetchCandidate]:
    """Collectives of ``inst``'s body whose operand depends only on the counter and invariants.

    A collective of loop-invariant data only (a one-layer scan indexes its weights
    with a constant) qualifies too: its prefetch is the same gather again.
    """
    info = analyze_while(inst)
    if loop_shape_problem(module, inst, info) is not None:
        return []
    body = module.computation(info.body)
    param = body.parameters[0]
    invariant = {c.index for c in info.carried if c.invariant}
    out = []
    for coll in body.instructions:
        if coll.opcode not in _PREFETCHABLE or coll.control_predecessors:
            continue
        chain, ok = [], True
        seen: set[int] = set()
        stack = list(coll.operands)
        while stack and ok:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if x.opcode == "get-tuple-element" and x.operands and x.operands[0] is param:
                if x.tuple_index != info.induction_index and x.tuple_index not in invariant:
                    ok = False
                continue
            if x.opcode in _NOT_IN_CHAIN or x.is_collective or x.control_predecessors:
                ok = False
                continue
            chain.append(x)
            stack.extend(x.operands)
        if ok:
            order = {id(i): k for k, i in enumerate(body.instructions)}
            chain.sort(key=lambda i: order[id(i)])
            out.append(PrefetchCandidate(coll.name, tuple(i.name for i in chain),
                                         coll.shape.byte_size))
    return out


def pipeline_prefetch(module, inst: Instruction, collectives: list[str]) -> list[str]:
    """Rewrites ``inst`` so the named body collectives are prefetched one iteration early.

    Args:
      module: the module holding ``inst``.
      inst: a ``while`` instruction.
      collectives: names of body collectives from ``prefetch_candidates``.

    Returns:
      Names of the prologue collectives added before the loop.

    Raises:
      ValueError: the loop cannot be rewritten or a name is not a candidate.
    """
    info = analyze_while(inst)
    problem = loop_shape_problem(module, inst, info)
    if problem is not None:
        raise ValueError(f"cannot pipeline %{inst.name}: {problem}")
    cands = {c.collective: c for c in prefetch_candidates(module, inst)}
    missing = [c for c in collectives if c not in cands]
    if missing:
        raise ValueError(f"cannot pipeline %{inst.name}: {missing} are not prefetchable collectives "
                         f"of its body (candidates: {sorted(cands)})")
    if not collectives:
        return []
    parent = inst.parent
    body, cond = module.computation(info.body), module.computation(info.condition)
    bparam, cparam = body.parameters[0], cond.parameters[0]
    init = inst.operands[0]
    n = len(inst.shape.elements)
    root = body.root
    counter_next = root.operands[info.induction_index]
    prologue, next_values, shapes = [], [], []
    replaced: list[Instruction] = []  # original collectives and chains, removed once dead
    for name in collectives:
        cand = cands[name]
        coll = body.instruction(name)
        chain = [body.instruction(c) for c in cand.chain] + [coll]
        replaced.extend(chain)
        # Prologue: the chain at the initial state, before the loop.
        pmap: dict[int, Instruction] = {}
        # Next iteration: the chain at counter + step, inside the body (invariants reused).
        nmap: dict[int, Instruction] = {}

        def leaf(x, where):
            if x.opcode == "get-tuple-element" and x.operands and x.operands[0] is bparam:
                if where == "prologue":
                    return init.operands[x.tuple_index]
                return counter_next if x.tuple_index == info.induction_index else x
            return None

        for x in chain:
            ops = []
            for o in x.operands:
                mapped = pmap.get(id(o)) or leaf(o, "prologue")
                ops.append(mapped if mapped is not None else o)
            pmap[id(x)] = parent.add_instruction(clone_with_operands(x, ops, module), before=init)
        for x in chain:
            ops, varies = [], False
            for o in x.operands:
                if id(o) in nmap:
                    ops.append(nmap[id(o)])
                    varies = varies or nmap[id(o)] is not o
                    continue
                mapped = leaf(o, "next")
                ops.append(mapped if mapped is not None else o)
                varies = varies or (mapped is not None and mapped is not o)
            if varies or x is coll:
                nmap[id(x)] = body.add_instruction(clone_with_operands(x, ops, module), before=root)
            else:
                nmap[id(x)] = x
        prologue.append(pmap[id(coll)])
        next_values.append(nmap[id(coll)])
        shapes.append(coll.shape)
    # Carry the prefetched buffers: loop state, init tuple, body/cond parameters, body root.
    new_shape = with_elements(inst.shape, shapes)
    if init.users == [inst]:
        init.set_operands(list(init.operands) + prologue)
        init.shape = new_shape
    else:
        new_init = Instruction(module.unique_name(init.name), "tuple", new_shape,
                               list(init.operands) + prologue)
        parent.add_instruction(new_init, before=inst)
        inst.replace_operand(init, new_init)
    inst.shape = new_shape
    bparam.shape = new_shape
    cparam.shape = new_shape
    for k, name in enumerate(collectives):
        coll = body.instruction(name)
        carried = Instruction(module.unique_name(f"{name}.prefetched"), "get-tuple-element",
                              coll.shape, [bparam], {"index": str(n + k)})
        body.add_instruction(carried, after=bparam)
        body.replace_all_uses(coll, carried)
    root.set_operands(list(root.operands) + next_values)
    root.shape = new_shape
    # The original in-iteration collectives and the chain values only they used are dead now.
    order = {id(i): k for k, i in enumerate(body.instructions)}
    for x in sorted({id(x): x for x in replaced}.values(), key=lambda i: -order[id(i)]):
        if not x.users and x is not root and x.parent is body:
            body.remove_instruction(x)
    return [p.name for p in prologue]
