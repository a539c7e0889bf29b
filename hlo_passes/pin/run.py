"""The ``pin`` pass: opt-barriers that make XLA's GPU scheduler keep each collective's planned window.

Run it after the passes that order the program (``schedule``). The plan is read
from the entry computation's order: every synchronous collective starts where
it sits and is waited for right before its first reader; simulated with the
target's cost model (``Options.target``), its transfer overlaps some of the
compute after it. The window is cut after the last compute instruction that
starts before the transfer ends (the rest of the gap before the first reader
is not needed to hide it), and ``hlo_passes.pin.rewrite`` ties that window with two
``opt-barrier``s, so that XLA's latency hiding scheduler, which reorders the
module it receives, overlaps the collective with that compute and not another
(docs/ARCHITECTURE.md F7). Short windows keep barriers few: they block fusion
across them. Barriers do not change any value.
"""

from __future__ import annotations

import logging

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.judge import judge_graph, planned_events
from concerto_jax.simulator import SimOptions
from hlo_passes.options import PassOptions
from hlo_passes.pin.rewrite import CHEAP_OPCODES, pin_windows, windows_from_order
from hlo_passes.registry import PassOutcome

log = logging.getLogger(__name__)


def planned_windows(module, cost_model) -> list:
    """The windows of ``module.entry`` cut where the planned transfer of each collective ends."""
    windows = windows_from_order(module.entry)
    if not windows:
        return []
    hg = build_taskgraph(module, cost_model, fold_aliases=False)
    sim = judge_graph(hg.graph, planned_events(hg.graph, hg.events),
                      sim=SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, memory=False)).sim
    timing = {t.name: t for t in sim.timings}
    out = []
    for w in windows:
        c = timing.get(w.collective)
        if c is None:
            continue
        last = None
        for name in w.members:
            t = timing.get(name)
            inst = module.entry.instruction(name)
            if t is None or inst.opcode in CHEAP_OPCODES:
                continue
            if t.start_us < c.end_us:
                last = name
            else:
                break
        if last is not None:
            out.append(w.until(last))
    return out


def pin_pass(module, options: PassOptions) -> PassOutcome:
    """Pin the planned windows of ``module.entry``; see the module docstring."""
    windows = planned_windows(module, CostModel(get_cluster(options.target)))
    stats = pin_windows(module, windows)
    out = {"windows": stats.windows, "pinned": stats.pinned, "barrier_inputs": stats.barrier_inputs,
           "barrier_outputs": stats.barrier_outputs, "skipped": len(stats.skipped)}
    if stats.skipped:
        log.info("pin pass: left %d windows unpinned: %s", len(stats.skipped),
                 dict(list(stats.skipped.items())[:5]))
    return PassOutcome(changed=stats.pinned > 0, stats=out)
