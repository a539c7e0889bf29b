"""The IR verifier: one function that checks the invariants every pass relies on."""

from __future__ import annotations

from hlo_passes.ir import opcodes as _ops
from hlo_passes.ir.computation import Computation
from hlo_passes.ir.errors import HloVerifyError
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.module import HloModule
from hlo_passes.ir.printer import instruction_to_text
from hlo_passes.ir.replica_groups import is_partition_of

__all__ = ["verify", "collective_id_space"]

_GROUPED = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
            "ragged-all-to-all", "collective-broadcast")
_HAS_GLOBAL_FLAG = ("all-reduce", "all-gather", "reduce-scatter")


def _context(inst: Instruction, radius: int = 2) -> str:
    comp = inst.parent
    if comp is None:
        return "  >> " + instruction_to_text(inst)
    insts = comp.instructions
    index = next((i for i, x in enumerate(insts) if x is inst), None)
    if index is None:
        return "  >> " + instruction_to_text(inst)
    lines = [f"  in computation %{comp.name}:"]
    for i in range(max(0, index - radius), min(len(insts), index + radius + 1)):
        mark = ">>" if i == index else "  "
        text = instruction_to_text(insts[i])
        lines.append(f"  {mark} {text if len(text) <= 300 else text[:300] + ' ...'}")
    return "\n".join(lines)


def _fail(message: str, inst: Instruction | None = None, comp: Computation | None = None):
    context = _context(inst) if inst is not None else ""
    raise HloVerifyError(message, inst, comp if comp is not None else (
        inst.parent if inst is not None else None), context)


def collective_id_space(inst: Instruction, module: HloModule) -> int:
    """How many ids the replica groups of a collective range over.

    XLA's collective op group modes: without ``channel_id`` ids are replicas
    (``replica_count``); with ``use_global_device_ids=true`` they are flattened
    device ids (``replica_count * num_partitions``); with a channel but no global
    ids they are partitions for ops without that flag (all-to-all, ...) and
    replicas for ops with it (all-reduce, all-gather, reduce-scatter).
    """
    kind = inst.collective_kind
    if inst.channel_id is None:
        return module.replica_count
    if inst.use_global_device_ids:
        return module.num_devices
    return module.replica_count if kind in _HAS_GLOBAL_FLAG else module.num_partitions


def _check_instruction(inst: Instruction, comp: Computation, module: HloModule,
                       position: dict[int, int], computations: set[int]) -> None:
    here = position[id(inst)]
    for op in inst.operands:
        if op is None or op.parent is not comp or id(op) not in position:
            _fail(f"operand of %{inst.name} is not an instruction of %{comp.name}", inst)
        if position[id(op)] >= here:
            _fail(f"operand %{op.name} of %{inst.name} is not defined before its use "
                  "(the order is not topological, or the graph has a cycle)", inst)
        if inst not in op.users:
            _fail(f"%{inst.name} uses %{op.name} but is missing from its users", inst)
    for user in inst.users:
        if not any(o is inst for o in user.operands):
            _fail(f"%{user.name} is listed as a user of %{inst.name} but does not use it", inst)
        if user.parent is not comp:
            _fail(f"user %{user.name} of %{inst.name} is not in %{comp.name}", inst)
    if len({id(u) for u in inst.users}) != len(inst.users):
        _fail(f"%{inst.name} lists a user twice", inst)
    for pred in inst.control_predecessors:
        if pred.parent is not comp or position.get(id(pred), here) >= here:
            _fail(f"control predecessor %{pred.name} of %{inst.name} is not an earlier "
                  f"instruction of %{comp.name}", inst)
    for callee in inst.called_computations:
        if id(callee) not in computations:
            _fail(f"%{inst.name} calls %{callee.name}, which is not in the module", inst)
        if callee.is_entry:
            _fail(f"%{inst.name} calls the ENTRY computation", inst)
    opcode = inst.opcode
    if opcode in ("fusion", "call", "async-start") and inst.called_computations:
        callee = inst.called_computations[0]
        if len(callee.parameters) != len(inst.operands):
            _fail(f"%{inst.name} passes {len(inst.operands)} operands to %{callee.name}, "
                  f"which has {len(callee.parameters)} parameters", inst)
    if opcode == "get-tuple-element":
        index = inst.tuple_index
        if len(inst.operands) != 1 or index is None:
            _fail(f"get-tuple-element %{inst.name} needs one operand and index=", inst)
        shape = inst.operands[0].shape
        if not shape.is_tuple or not 0 <= index < len(shape.elements):
            _fail(f"get-tuple-element %{inst.name}: index {index} out of range of "
                  f"{shape}", inst)
        if not shape.elements[index].compatible(inst.shape):
            _fail(f"get-tuple-element %{inst.name}: shape {inst.shape} differs from "
                  f"element {index} of the operand, {shape.elements[index]}", inst)
    _check_async(inst)
    _check_groups(inst, module)


def _check_async(inst: Instruction) -> None:
    parts = _ops.async_parts(inst.opcode)
    if parts is None:
        return
    base, role = parts
    update, done = base + "-update", base + "-done"
    if role in ("start", "update"):
        ends = [u for u in inst.users if u.opcode in (update, done)]
        if len(ends) != 1 or sum(o is inst for o in ends[0].operands) != 1:
            _fail(f"async {role} %{inst.name} must be consumed by exactly one {done} "
                  f"or {update} (found {len(ends)})", inst)
    if role in ("update", "done"):
        first = inst.operands[0] if inst.operands else None
        allowed = (base + "-start", update) if base != "send" and base != "recv" else (base,)
        if first is None or first.opcode not in allowed:
            _fail(f"%{inst.name} must take a {' or '.join(allowed)} as its first operand", inst)


def _check_groups(inst: Instruction, module: HloModule) -> None:
    kind = inst.collective_kind
    if kind is None or inst.async_role in ("done", "update"):
        return
    target = inst if inst.opcode != "async-start" else inst.async_wrapped
    if target is None:
        return
    try:
        groups = target.replica_groups
        pairs = target.source_target_pairs
    except ValueError as e:
        _fail(f"%{inst.name}: bad replica groups: {e}", inst)
    num_ids = collective_id_space(target, module)
    if groups and kind in _GROUPED and not is_partition_of(groups, num_ids):
        _fail(f"%{inst.name}: replica groups {groups} do not partition the {num_ids} ids "
              "of its collective mode into equal disjoint groups", inst)
    if pairs:
        sources = [s for s, _ in pairs]
        targets = [t for _, t in pairs]
        if len(set(sources)) != len(sources) or len(set(targets)) != len(targets) or any(
                not 0 <= i < num_ids for i in sources + targets):
            _fail(f"%{inst.name}: source_target_pairs {pairs} repeat a source or target "
                  f"or leave the range 0..{num_ids - 1}", inst)


def verify(module: HloModule) -> HloModule:
    """Checks the invariants of ``module``; returns it unchanged.

    Invariants:
      * computation names are unique; exactly one computation is the ENTRY;
      * instruction names are unique in the module;
      * every computation has instructions and exactly one ROOT, which is one of them;
        parameter numbers are 0..n-1, each once;
      * operands are instructions of the same computation defined *before* their use
        (so the order is topological and the graph acyclic); control predecessors too;
      * ``users`` is consistent with ``operands`` (each user uses the instruction,
        each use is listed once);
      * called computations (to_apply, calls, condition, body, branches, ...) are in
        the module and are not the ENTRY; fusion/call/async-start operand counts
        match the callee's parameters;
      * async pairs: each start (``*-start``, ``async-start``, ``send``/``recv``,
        ``copy-start``) is consumed by exactly one matching done (or a chain of
        ``async-update`` ending in ``async-done``), and each done/update consumes
        the matching start;
      * get-tuple-element: a tuple operand, index in range, shape equal to the element;
      * replica groups, when present and non-empty, are equally sized disjoint groups
        that cover exactly the ids of the collective's mode (see
        :func:`collective_id_space`); collective-permute pairs have unique sources
        and targets within range.

    Raises:
      HloVerifyError: the first invariant that does not hold, with the offending
        instruction and its neighbours.
    """
    names: set[str] = set()
    comp_names: set[str] = set()
    computations = {id(c) for c in module.computations}
    entries = [c for c in module.computations if c.is_entry]
    if len(entries) != 1:
        _fail(f"module {module.name} has {len(entries)} ENTRY computations, expected 1")
    for comp in module.computations:
        if comp.name in comp_names:
            _fail(f"computation name %{comp.name} is not unique", comp=comp)
        comp_names.add(comp.name)
        if not comp.instructions:
            _fail(f"computation %{comp.name} has no instructions", comp=comp)
        if comp.root is None or comp.root.parent is not comp or comp.root not in comp:
            _fail(f"computation %{comp.name} has no ROOT among its instructions", comp=comp)
        position = {}
        for i, inst in enumerate(comp.instructions):
            if inst.name in names:
                _fail(f"instruction name %{inst.name} is not unique in the module", inst)
            names.add(inst.name)
            if inst.parent is not comp:
                _fail(f"%{inst.name} is listed in %{comp.name} but its parent is "
                      f"{inst.parent.name if inst.parent else None}", inst)
            position[id(inst)] = i
        numbers = sorted(p.parameter_number for p in comp.parameters)
        if numbers != list(range(len(numbers))):
            _fail(f"computation %{comp.name} has parameter numbers {numbers}, expected "
                  f"0..{len(numbers) - 1}", comp=comp)
        for inst in comp.instructions:
            _check_instruction(inst, comp, module, position, computations)
    return module
