"""Our schedule on XLA's own scheduled module, compiled by XLA's backend only.

The path (no opt-barrier: XLA fuses and combines as it always does)::

    XLA's module right after its latency hiding scheduler (every computation scheduled,
      async collective start/done pairs)
      | reschedule_text   the "schedule" pass's per-computation RCPSP (callees first, the
      |                   module's order as the initial schedule, the memory limit of
      |                   ScheduleOptions: by default the starting order's peak), async
      |                   halves at their own events; the text's instruction lines are
      |                   permuted, nothing else is rewritten
      | pjrt_c.compile_hlo run_backend_only: XLA skips its HLO pipeline; its scheduling step
      |                   keeps a module that has a schedule; the backend emits our order
      v
    XLA's final module of our order

Why the after-LHS module and not XLA's final one: the final module has been through the
post-scheduling pipelines (e.g. command buffers wrap kernel sequences into
``command_buffer`` calls), which the backend would run a second time.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from concerto_jax.judge.computation import plan_module
from hlo_passes.ir import parse_module

log = logging.getLogger(__name__)

_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST_LINE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")


@dataclasses.dataclass(frozen=True)
class Rescheduled:
    """Result of ``reschedule_text``.

    Attributes:
      text: the module with every scheduled computation in our order (``is_scheduled=true``).
      computations: the ``schedule`` pass's record per computation (``judge.ComputationPlan``).
      input_us: the entry's predicted time in the input (XLA's) order, nested computations in theirs.
      scheduled_us: the same in our order.
      changed: computations whose order changed.
    """

    text: str
    computations: tuple
    input_us: float
    scheduled_us: float
    changed: tuple[str, ...]


def permute_text(text: str, orders: dict[str, list[str]]) -> str:
    """``text`` with the instruction lines of each computation in ``orders`` permuted.

    Args:
      text: an HLO module as XLA prints it (one instruction per line).
      orders: computation name -> its instruction names in the new order (a permutation of
        the computation's instructions).

    Raises:
      ValueError: a computation's lines do not match its order (names missing or extra).
    """
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    seen = set()
    while i < len(lines):
        line = lines[i]
        m = _COMP_HEADER.match(line)
        if not m or m.group(1) not in orders or line.startswith(" "):
            out.append(line)
            i += 1
            continue
        name = m.group(1)
        out.append(line)
        i += 1
        body: dict[str, str] = {}
        while i < len(lines) and lines[i].strip() != "}":
            im = _INST_LINE.match(lines[i])
            if im is None:
                raise ValueError(f"computation %{name}: unexpected line {lines[i][:80]!r}")
            body[im.group(1)] = lines[i]
            i += 1
        order = orders[name]
        if set(order) != set(body) or len(order) != len(body):
            raise ValueError(f"computation %{name}: the new order names {len(order)} instructions, "
                             f"the text has {len(body)} (differ: {sorted(set(order) ^ set(body))[:5]})")
        out.extend(body[n] for n in order)
        seen.add(name)
    missing = set(orders) - seen
    if missing:
        raise ValueError(f"computations not found in the text: {sorted(missing)[:5]}")
    return "\n".join(out)


_NO_KERNEL = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier"})


def join_idle_pairs(order: list) -> list:
    """``order`` with each async collective's done moved up to its start when no kernel runs between them.

    XLA's post-scheduling pipeline makes such a pair synchronous and moves its START down to
    its done (observed on gpt_zero3_16: ``all-to-all-start, all-gather-start.4,
    all-to-all-done`` came back as ``all-gather-start.4, all-to-all-start, all-to-all-done``,
    which queues the all-to-all behind the all-gather). Moving the DONE up instead keeps the
    collectives' issue order of our plan and leaves XLA nothing to move. Only instructions
    that launch no kernel (``_NO_KERNEL``) or other async collective halves may sit between.
    """
    pos = {inst.name: k for k, inst in enumerate(order)}
    moves = []
    for k, inst in enumerate(order):
        if inst.collective_kind is None or inst.async_role != "done":
            continue
        start = inst.async_start()
        s = pos.get(start.name)
        if s is None or s + 1 == k:
            continue
        between = order[s + 1:k]
        idle = all(b.opcode in _NO_KERNEL or (b.collective_kind is not None and b.async_role is not None)
                   for b in between)
        mine = [b for b in between if b.collective_kind is not None and b.async_role == "update"
                and b.async_start() is start]
        needs = {o.name for o in list(inst.operands) + list(inst.control_predecessors)} - {start.name}
        needs |= {o.name for b in mine for o in list(b.operands) + list(b.control_predecessors)} - {start.name}
        if idle and not (needs & {b.name for b in between if b not in mine}):
            moves.append((start.name, mine + [inst]))
    for start_name, group in moves:
        names = {g.name for g in group}
        order = [i for i in order if i.name not in names]
        at = next(k for k, i in enumerate(order) if i.name == start_name) + 1
        order[at:at] = group
    return order


_WARNED: set[str] = set()
"""Messages of ``reschedule_text`` already logged at WARNING in this process."""


def reschedule_text(text: str, cost_model, options) -> Rescheduled:
    """Order every schedulable computation of XLA's scheduled module by our scheduler.

    Args:
      text: XLA's module after its latency hiding scheduler (``is_scheduled=true``).
      cost_model: the target's ``CostModel``.
      options: ``concerto_jax.Options`` (its ``scheduler`` settings are used).

    Returns:
      A ``Rescheduled``; its text differs from ``text`` only in the order of instruction lines.
    """
    if "is_scheduled=true" not in text.split("\n", 1)[0]:
        raise ValueError("reschedule_text needs a scheduled module (is_scheduled=true)")
    module = parse_module(text, source="xla-after-lhs")
    done, problems = plan_module(module, cost_model, options.scheduler)
    if problems:
        message = "; ".join(problems)
        # once per message at WARNING: the threshold search reschedules the same module many times
        log.log(logging.DEBUG if message in _WARNED else logging.WARNING,
                "reschedule: not fully handled: %s", message)
        _WARNED.add(message)
    orders = {}
    for c in done:
        comp = module.computation(c.name)
        order = join_idle_pairs(list(comp.instructions))
        if c.changed or [i.name for i in order] != [i.name for i in comp.instructions]:
            # the parser's stand-ins for XLA's ``%x#k`` operands have no line in the text,
            # which keeps XLA's form (they launch nothing)
            orders[c.name] = [i.name for i in order if i.name not in module.implicit_tuple_elements]
    changed = tuple(orders)
    new_text = permute_text(text, orders) if orders else text
    entry = done[-1]
    log.info("reschedule: %d computations, %d changed; entry %.1f -> %.1f us (model)",
             len(done), len(changed), entry.program_us, entry.scheduled_us)
    return Rescheduled(new_text, tuple(done), entry.program_us, entry.scheduled_us, changed)
