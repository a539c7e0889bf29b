"""Our schedule on XLA's own scheduled module, compiled by XLA's backend only (issue #9).

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

log = logging.getLogger(__name__)

_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST_LINE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")


@dataclasses.dataclass(frozen=True)
class Rescheduled:
    """Result of ``reschedule_text``.

    Attributes:
      text: the module with every scheduled computation in our order (``is_scheduled=true``).
      computations: the ``schedule`` pass's record per computation (``ComputationSchedule``).
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


def reschedule_text(text: str, cost_model, options) -> Rescheduled:
    """Order every schedulable computation of XLA's scheduled module by our scheduler.

    Args:
      text: XLA's module after its latency hiding scheduler (``is_scheduled=true``).
      cost_model: the target's ``CostModel``.
      options: ``concerto_jax.Options`` (its ``scheduler`` settings are used).

    Returns:
      A ``Rescheduled``; its text differs from ``text`` only in the order of instruction lines.
    """
    import hlo_passes
    from concerto_jax.passes.schedule_pass import schedule_computation
    from hlo_passes.loops import schedulable_computations

    if "is_scheduled=true" not in text.split("\n", 1)[0]:
        raise ValueError("reschedule_text needs a scheduled module (is_scheduled=true)")
    module = hlo_passes.parse_module(text, source="xla-after-lhs")
    times: dict[str, dict[str, float]] = {"program": {}, "scheduled": {}, "bound": {}}
    problems: list[str] = []
    done = [schedule_computation(module, comp, cost_model, options, times, problems)
            for comp in schedulable_computations(module)]
    if problems:
        log.warning("reschedule: not fully handled: %s", "; ".join(problems))
    changed = tuple(c.name for c in done if c.changed)
    orders = {c: [i.name for i in module.computation(c).instructions] for c in changed}
    new_text = permute_text(text, orders) if orders else text
    entry = done[-1]
    log.info("reschedule: %d computations, %d changed; entry %.1f -> %.1f us (model)",
             len(done), len(changed), entry.program_us, entry.scheduled_us)
    return Rescheduled(new_text, tuple(done), entry.program_us, entry.scheduled_us, changed)
