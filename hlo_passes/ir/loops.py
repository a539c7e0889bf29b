"""Control flow of an HLO module: which computations run, loop trip counts and carried values.

Pipeline position: read-only analysis used by the passes that work on every
computation of a module (``hlo_passes.schedule.run``) and by the loop
rewrite (``hlo_passes.pipeline_loops``).

* ``schedulable_computations(module)``: the computations that run as sequences of
  kernels -- the entry, ``while`` bodies and conditions, ``conditional`` branches,
  ``call`` targets, nested to any depth -- callees before callers. Fused
  computations, reducers (``to_apply`` of reduce/all-reduce/...) and async
  wrappers are not in the list: they are parts of one kernel.
* ``analyze_while(inst)``: a ``LoopInfo`` with the trip count (from XLA's
  ``backend_config`` ``known_trip_count``, else from the pattern JAX writes for
  ``lax.scan``/``fori_loop``: an ``s32`` counter in the carried tuple, initialised
  by a constant, compared against a constant by the condition, stepped by a
  constant in the body), the carried values and their bytes, and the reason when
  the trip count cannot be known.
* ``side_effects(comp)``: instructions whose order must not change (infeed,
  outfeed, send/recv, side-effecting custom-calls, RNG state).
"""

from __future__ import annotations

import dataclasses
import json
import math

from hlo_passes.ir.computation import Computation
from hlo_passes.ir.instruction import Instruction

__all__ = ["CarriedValue", "LoopInfo", "analyze_while", "schedulable_computations", "side_effects"]

_CONTROL_FLOW_ATTRS = {
    "while": ("condition", "body"),
    "conditional": ("branch_computations", "true_computation", "false_computation"),
    "call": ("to_apply",),
}
"""Opcode -> attributes naming computations that run as sequences of kernels."""

_SIDE_EFFECT_OPCODES = frozenset({
    "infeed", "outfeed", "send", "send-done", "recv", "recv-done", "rng",
    "rng-get-and-update-state",
})
"""Opcodes whose relative order is observable (I/O, RNG state)."""

_COMPARE_TRIPS = {
    # direction -> trips for `i <dir> bound` with i = init, init + step, ... (step > 0)
    "LT": lambda init, bound, step: math.ceil((bound - init) / step),
    "LE": lambda init, bound, step: math.floor((bound - init) / step) + 1,
    "NE": lambda init, bound, step: (bound - init) // step if (bound - init) % step == 0 else None,
}
_SWAPPED = {"GT": "LT", "GE": "LE", "NE": "NE", "LT": "GT", "LE": "GE"}


def control_flow_callees(inst: Instruction) -> list[Computation]:
    """The computations ``inst`` runs as control flow (``while``/``conditional``/``call``)."""
    out: list[Computation] = []
    for key in _CONTROL_FLOW_ATTRS.get(inst.opcode, ()):
        value = inst.attrs.get(key)
        if value is None:
            continue
        out.extend(value if isinstance(value, list) else [value])
    return out


def schedulable_computations(module) -> list[Computation]:
    """Entry plus every computation reached through control flow, callees first.

    A computation reached from several call sites appears once.
    """
    order: list[Computation] = []
    seen: set[str] = set()

    def visit(comp: Computation) -> None:
        if comp.name in seen:
            return
        seen.add(comp.name)
        for inst in comp.instructions:
            for callee in control_flow_callees(inst):
                visit(callee)
        order.append(comp)

    visit(module.entry)
    return order


def control_flow_depths(module) -> dict[str, int]:
    """Nesting depth of every computation reached through control flow: 0 for the entry,
    one more than its deepest caller for a callee (a body inside a body: 2)."""
    depth: dict[str, int] = {}
    for comp in reversed(schedulable_computations(module)):  # callers before callees
        d = depth.setdefault(comp.name, 0)
        for inst in comp.instructions:
            for callee in control_flow_callees(inst):
                depth[callee.name] = max(depth.get(callee.name, 0), d + 1)
    return depth


def side_effects(comp: Computation) -> list[Instruction]:
    """Instructions of ``comp`` whose relative order is observable."""
    out = []
    for inst in comp.instructions:
        if inst.opcode in _SIDE_EFFECT_OPCODES:
            out.append(inst)
        elif inst.opcode == "custom-call" and str(inst.attrs.get("custom_call_has_side_effect", "")) == "true":
            out.append(inst)
    return out


@dataclasses.dataclass(frozen=True)
class CarriedValue:
    """One element of a while loop's carried tuple.

    Attributes:
      index: position in the tuple.
      bytes: size of the value (bytes of all its array leaves).
      invariant: the body passes it through unchanged (e.g. the stacked weights).
    """

    index: int
    bytes: int
    invariant: bool


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """What the scheduler and the loop rewrite need to know about one ``while``.

    Attributes:
      name: the while instruction's name.
      body: name of the body computation.
      condition: name of the condition computation.
      trip_count: iterations, or None when it cannot be known statically.
      source: where the trip count came from ("backend_config", "pattern") or why
        it is unknown.
      induction_index: tuple index of the loop counter (None if not found).
      init: initial counter value; step: increment per iteration (None if not found).
      carried: the carried tuple's elements (empty when the state is not a tuple).
    """

    name: str
    body: str
    condition: str
    trip_count: int | None
    source: str
    induction_index: int | None = None
    init: int | None = None
    step: int | None = None
    carried: tuple[CarriedValue, ...] = ()

    @property
    def carried_bytes(self) -> int:
        """Bytes held by the loop state across iterations."""
        return sum(c.bytes for c in self.carried)


CASTS = ("copy", "convert", "bitcast", "reshape")
"""Opcodes that change a value's type or layout, not which value it is."""


def through_casts(inst: Instruction) -> Instruction:
    """The producer of ``inst`` behind any chain of ``CASTS``."""
    while inst.opcode in CASTS and inst.operands:
        inst = inst.operands[0]
    return inst


def _int_constant(inst: Instruction) -> int | None:
    """The value of an integer scalar constant (through copies/converts of one), else None."""
    inst = through_casts(inst)
    if inst.opcode != "constant" or inst.shape.is_tuple or inst.shape.dims:
        return None
    if not inst.shape.dtype.startswith(("s", "u")):
        return None
    try:
        return int(str(inst.literal).strip())
    except (TypeError, ValueError):
        return None


def _carried_index(inst: Instruction, param: Instruction) -> int | None:
    """k if ``inst`` is ``get-tuple-element(param), index=k`` (through copies), else None."""
    while inst.opcode in ("copy", "bitcast") and inst.operands:
        inst = inst.operands[0]
    if inst.opcode == "get-tuple-element" and inst.operands and inst.operands[0] is param:
        return inst.tuple_index
    return None


def _known_trip_count(inst: Instruction) -> int | None:
    raw = inst.backend_config
    if not raw:
        return None
    try:
        config = json.loads(raw)
        return int(config["known_trip_count"]["n"])
    except (ValueError, KeyError, TypeError):
        return None


def _leaf_bytes(shape) -> int:
    if shape.is_tuple:
        return sum(_leaf_bytes(e) for e in shape.elements)
    if shape.is_token or shape.is_opaque:
        return 0
    return shape.byte_size


def _carried(inst: Instruction, body: Computation) -> tuple[CarriedValue, ...]:
    if not inst.shape.is_tuple or not body.parameters:
        return ()
    param = body.parameters[0]
    root = body.root
    out = []
    for k, element in enumerate(inst.shape.elements):
        invariant = (root is not None and root.opcode == "tuple" and k < len(root.operands)
                     and _carried_index(root.operands[k], param) == k)
        out.append(CarriedValue(k, _leaf_bytes(element), invariant))
    return tuple(out)


def analyze_while(inst: Instruction) -> LoopInfo:
    """Trip count and carried values of a ``while`` instruction.

    Raises:
      ValueError: ``inst`` is not a while.
    """
    if inst.opcode != "while":
        raise ValueError(f"analyze_while: expected a while instruction, found %{inst.name} ({inst.opcode})")
    body, cond = inst.attrs["body"], inst.attrs["condition"]
    base = dict(name=inst.name, body=body.name, condition=cond.name, carried=_carried(inst, body))
    pattern = _pattern(inst, body, cond)
    known = _known_trip_count(inst)
    if known is not None:
        fields = {k: v for k, v in pattern.items() if k in ("induction_index", "init", "step")}
        return LoopInfo(trip_count=known, source="backend_config", **fields, **base)
    return LoopInfo(**pattern, **base)


def _pattern(inst: Instruction, body: Computation, cond: Computation) -> dict:
    """Trip count from JAX's counter pattern; ``source`` says why when it fails."""

    def unknown(why: str, **found) -> dict:
        return dict(trip_count=None, source=why, **found)

    if not inst.shape.is_tuple or not inst.operands or not cond.parameters or not body.parameters:
        return unknown("the loop state is not a tuple")
    root = cond.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return unknown("the condition is not a compare")
    direction = str(root.attrs.get("direction", ""))
    lhs, rhs = root.operands
    cparam = cond.parameters[0]
    k, bound = _carried_index(lhs, cparam), _int_constant(rhs)
    if k is None or bound is None:
        k, bound = _carried_index(rhs, cparam), _int_constant(lhs)
        direction = _SWAPPED.get(direction, "")
    if k is None or bound is None:
        return unknown("the condition does not compare a loop counter with a constant")
    init_tuple = inst.operands[0]
    if init_tuple.opcode != "tuple" or k >= len(init_tuple.operands):
        return unknown("the initial loop state is not a tuple instruction", induction_index=k)
    init = _int_constant(init_tuple.operands[k])
    broot, bparam = body.root, body.parameters[0]
    if init is None:
        return unknown("the loop counter's initial value is not a constant", induction_index=k)
    if broot is None or broot.opcode != "tuple" or k >= len(broot.operands):
        return unknown("the body does not return a tuple", induction_index=k, init=init)
    nxt = broot.operands[k]
    step = None
    if nxt.opcode == "add" and len(nxt.operands) == 2:
        a, b = nxt.operands
        if _carried_index(a, bparam) == k:
            step = _int_constant(b)
        elif _carried_index(b, bparam) == k:
            step = _int_constant(a)
    if step is None or step <= 0:
        return unknown("the body does not step the loop counter by a positive constant",
                       induction_index=k, init=init)
    rule = _COMPARE_TRIPS.get(direction)
    trips = None if rule is None else rule(init, bound, step)
    if trips is None:
        return unknown(f"unsupported loop condition direction {direction!r}",
                       induction_index=k, init=init, step=step)
    return dict(trip_count=max(int(trips), 0), source="pattern", induction_index=k, init=init,
                step=step)


def loop_state_problem(inst: Instruction) -> str | None:
    """Why the loop state of ``while`` ``inst`` cannot be given other elements (None if it
    can): its result must be read only through ``get-tuple-element``, its body and
    condition called by it alone and reading their parameter only through
    ``get-tuple-element``, and its body must return a ``tuple`` instruction."""
    body, cond = inst.attrs["body"], inst.attrs["condition"]
    module = body.module
    if not inst.shape.is_tuple or len(inst.operands) != 1:
        return "the loop state is not one tuple"
    if inst is inst.parent.root or any(u.opcode != "get-tuple-element" for u in inst.users):
        return "the loop result is used as a whole (not only through get-tuple-element)"
    callers = [i for i in module.instructions() for c in i.called_computations
               if c is body or c is cond]
    if len(callers) != 2:
        return "the body or condition is shared with another instruction"
    for comp in (body, cond):
        if len(comp.parameters) != 1 or any(
                u.opcode != "get-tuple-element" for u in comp.parameters[0].users):
            return f"%{comp.name} uses its loop state other than through get-tuple-element"
    if body.root is None or body.root.opcode != "tuple":
        return "the body does not return a tuple instruction"
    return None


def runs_per_step(comps: list) -> dict[str, int]:
    """How often each computation of ``comps`` (``schedulable_computations``: callees first,
    the entry last) runs per run of the entry: while bodies by their trip count (1 when
    unknown), conditions once more, other callees as often as their callers."""
    runs = {comps[-1].name: 1}
    for comp in reversed(comps):  # callers before callees
        m = runs.get(comp.name, 0)
        for inst in comp.instructions:
            if inst.opcode == "while":
                info = analyze_while(inst)
                trips = info.trip_count or 1
                runs[info.body] = runs.get(info.body, 0) + m * trips
                runs[info.condition] = runs.get(info.condition, 0) + m * (trips + 1)
            else:
                for callee in control_flow_callees(inst):
                    runs[callee.name] = runs.get(callee.name, 0) + m
    return runs
