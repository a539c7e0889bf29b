"""Window pins: ``opt-barrier``s that make XLA's scheduler overlap a collective with the compute we planned.

XLA's GPU compiler reschedules every module it receives through JAX's Python
path (HLO -> StableHLO drops the schedule), but it keeps data dependencies,
and an ``opt-barrier`` is one it may not see through. A collective ``c``
whose planned *window* is the compute ``W`` between its start and its done is
pinned by two barriers (docs/ARCHITECTURE.md F7, "Opt-barriers pin a collective's
window")::

    (c_in', x1', x2', ...) = opt-barrier((c_in, x1, x2, ...))   # before: W's inputs and c's operand
    c = collective(c_in')                                       # c can start as soon as W can
    W ... (reads x1', x2' instead of x1, x2)
    (c', y1', y2', ...) = opt-barrier((c, y1, y2, ...))         # after: c's result and W's outputs
    users of c and of y1, y2 (after the window) read c', y1', y2'

so W cannot run before ``c``'s operand is ready (the start can sit right
before W), and no compute that needs W's results can run before ``c`` is done
(the done cannot drift past the window and steal another collective's
compute). Barriers are no-ops at run time; they block fusion across them, so
they sit only at window boundaries.

The window of a synchronous collective is read from the computation's order
(``windows_from_order``): the instructions after it up to its first real user
(a user that is not a ``get-tuple-element``/``bitcast`` of it), which is how
the ``schedule`` pass places a collective (at its START event; every user
after its DONE).

Pipeline position: after the reordering passes, before the replicated rewrite
and printing (``hlo_passes.pin.run.pin_pass``, registered as ``pin``).
"""

from __future__ import annotations

import dataclasses

from hlo_passes.ir import Computation, HloModule, Instruction, alias_closure
from hlo_passes.ir.shapes import Shape

__all__ = ["ANCHOR_OPCODES", "CHEAP_OPCODES", "PinStats", "Window", "pin_window", "pin_windows", "windows_from_order"]

CHEAP_OPCODES = frozenset({
    "broadcast", "reshape", "bitcast", "transpose", "copy", "get-tuple-element", "tuple",
    "constant", "iota", "parameter", "after-all", "partition-id", "replica-id", "opt-barrier",
})
"""Ops that are not window compute: free or fused into their consumers. Their
operands are never rewired (rewiring would change the graph XLA's simplifier
pattern-matches, e.g. ``A / broadcast(B)``), and they alone never make a window."""

@dataclasses.dataclass(frozen=True)
class Window:
    """The planned overlap of one synchronous collective.

    Attributes:
      collective: the collective instruction's name.
      members: names of the instructions between it and its first real reader, in order
        (other collectives and the collective's own aliases excluded).
      compute: how many members are compute (not ``CHEAP_OPCODES``).
      last: the window's last instruction; None: up to the collective's first real reader.
    """

    collective: str
    members: tuple[str, ...]
    compute: int
    last: str | None = None

    def until(self, last: str) -> Window:
        """The window cut after member ``last`` (the planned transfer ends during it)."""
        k = self.members.index(last) + 1
        return Window(self.collective, self.members[:k], self.compute, last)


@dataclasses.dataclass(frozen=True)
class PinStats:
    """What ``pin_windows`` did.

    Attributes:
      windows: windows with some compute (candidates).
      pinned: collectives that got their two barriers.
      barrier_inputs: values routed through "before" barriers (collective operands included).
      barrier_outputs: values routed through "after" barriers (collective results included).
      skipped: ``{collective: reason}`` for windows left unpinned.
    """

    windows: int
    pinned: int
    barrier_inputs: int
    barrier_outputs: int
    skipped: dict


def _is_sync_collective(inst: Instruction) -> bool:
    return inst.is_collective and inst.async_role is None and inst.opcode not in ("send", "recv")


def _first_reader(comp: Computation, c: Instruction, pos: dict) -> tuple[int, set]:
    aliases = alias_closure(c)
    readers = [pos[id(u)] for a in aliases for u in a.users if u not in aliases and id(u) in pos]
    return min(readers, default=len(comp.instructions)), aliases


def windows_from_order(comp: Computation) -> list[Window]:
    """The window of every synchronous collective of ``comp``, read from its current order.

    A collective's window runs from the instruction after it to the one before its first
    real reader (a user that is not a ``get-tuple-element``/``bitcast`` of it). Windows
    without compute (``CHEAP_OPCODES`` only) and collectives nothing reads are omitted.
    """
    insts = comp.instructions
    pos = {id(i): k for k, i in enumerate(insts)}
    out = []
    for k, c in enumerate(insts):
        if not _is_sync_collective(c):
            continue
        end, aliases = _first_reader(comp, c, pos)
        if end >= len(insts):
            continue
        members = [i for i in insts[k + 1:end] if i not in aliases and not i.is_collective]
        compute = sum(i.opcode not in CHEAP_OPCODES for i in members)
        if compute:
            out.append(Window(c.name, tuple(i.name for i in members), compute))
    return out


def _barrier(comp: Computation, module: HloModule, values: list[Instruction], before: Instruction,
             tag: str) -> list[Instruction]:
    """``tuple -> opt-barrier -> get-tuple-elements`` of ``values``, inserted before ``before``."""
    tup = Instruction(module.unique_name(f"pin_{tag}_tuple"), "tuple",
                      Shape.tuple_of([v.shape for v in values]), values)
    comp.add_instruction(tup, before=before)
    bar = Instruction(module.unique_name(f"pin_{tag}"), "opt-barrier", tup.shape, [tup])
    comp.add_instruction(bar, before=before)
    outs = []
    for k, v in enumerate(values):
        g = Instruction(module.unique_name(f"pin_{tag}_gte"), "get-tuple-element", v.shape, [bar],
                        {"index": str(k)})
        comp.add_instruction(g, before=before)
        outs.append(g)
    return outs


ANCHOR_OPCODES = frozenset({"dot", "convolution", "custom-call", "fusion"})
"""Default window compute that barriers tie: the kernels that carry the time (GEMMs,
convolutions). Elementwise work around them stays free to fuse and to move."""


def pin_window(module: HloModule, comp: Computation, window: Window,
               anchors: frozenset[str] | None = ANCHOR_OPCODES) -> tuple[int, int] | str:
    """Pin one window with its two barriers (see the module docstring).

    The window is re-read from the current order (earlier pins add instructions). Only
    members whose opcode is in ``anchors`` (None: every compute member) get their inputs
    through the "before" barrier and their outputs through the "after" barrier.

    Returns:
      ``(values through the before barrier, values through the after barrier)``, or the reason
      the window was left alone (a string).
    """
    c = comp.instruction(window.collective)
    if any(o.shape.is_token or o.shape.is_tuple for o in c.operands) or c.shape.is_token:
        return "token or tuple operand"
    insts = list(comp.instructions)
    pos = {id(i): k for k, i in enumerate(insts)}
    k = pos[id(c)]
    end, aliases = _first_reader(comp, c, pos)
    if end >= len(insts):
        return "nothing reads the collective"
    if window.last is not None:
        cut = pos[id(comp.instruction(window.last))] + 1
        if not k < cut <= end:
            return f"%{window.last} is not between the collective and its first reader"
        end = cut
    members = [i for i in insts[k + 1:end] if i not in aliases and not i.is_collective]
    member_set = set(members)
    # Before: values defined before c that window compute reads (constants and iotas are free).
    tied = [w for w in members if w.opcode not in CHEAP_OPCODES and (anchors is None or w.opcode in anchors)]
    if not tied:
        return "no anchor compute in the window"
    inputs: list[Instruction] = []
    for w in tied:
        for o in w.operands:
            if pos.get(id(o), len(insts)) < k and o.opcode not in ("constant", "iota", "broadcast") \
                    and not o.shape.is_token and o not in inputs:
                inputs.append(o)
    before_vals = list(dict.fromkeys(list(c.operands) + inputs))
    # After: c and the window values read at or after the window's end.
    outputs = [w for w in tied if not w.shape.is_token
               and any(pos.get(id(u), -1) >= end for u in w.users)]
    after_vals = [c] + outputs
    readers = {id(v): [u for u in v.users if pos.get(id(u), -1) >= end or (v is c and u in aliases)]
               for v in after_vals}
    anchor = insts[end]
    b_out = _barrier(comp, module, before_vals, c, "in")
    repl = dict(zip(before_vals, b_out, strict=True))
    for o in dict.fromkeys(c.operands):
        c.replace_operand(o, repl[o])
    for w in tied:
        for o in dict.fromkeys(w.operands):
            if o in repl and o not in member_set:
                w.replace_operand(o, repl[o])
    a_out = _barrier(comp, module, after_vals, anchor, "out")
    for v, nv in zip(after_vals, a_out, strict=True):
        for u in dict.fromkeys(readers[id(v)]):
            u.replace_operand(v, nv)
    # Aliases of c inside the window now read the barrier: move them after it.
    moved = [a for a in comp.instructions if a in aliases and a is not c
             and comp.instructions.index(a) < comp.instructions.index(anchor)]
    if moved:
        rest = [i for i in comp.instructions if i not in moved]
        j = rest.index(a_out[-1]) + 1
        comp.set_order(rest[:j] + moved + rest[j:])
    return len(before_vals), len(after_vals)


def pin_windows(module: HloModule, windows: list[Window] | None = None,
                min_compute: int = 1, anchors: frozenset[str] | None = ANCHOR_OPCODES) -> PinStats:
    """Pin the windows of ``module``'s entry computation (default: ``windows_from_order``).

    Args:
      module: the module, its entry in the planned order.
      windows: the windows to pin (default: read from the entry's order).
      min_compute: pin only windows with at least this many compute instructions.
      anchors: opcodes of the window compute the barriers tie (see ``pin_window``).

    Returns:
      A ``PinStats``.
    """
    comp = module.entry
    if windows is None:
        windows = windows_from_order(comp)
    pinned = n_in = n_out = 0
    skipped: dict = {}
    for w in windows:
        if w.compute < min_compute:
            skipped[w.collective] = "window too small"
            continue
        res = pin_window(module, comp, w, anchors)
        if isinstance(res, str):
            skipped[w.collective] = res
            continue
        pinned += 1
        n_in += res[0]
        n_out += res[1]
    return PinStats(len(windows), pinned, n_in, n_out, skipped)
