"""The ``pin`` pass: opt-barriers that make XLA's GPU scheduler keep each collective's planned window.

Run it after the passes that order the program (``schedule``): every synchronous
collective of the entry computation is overlapped, in the plan, with the compute
between it and its first reader; ``hlo_passes.pins`` ties that window with two
``opt-barrier``s so that XLA's latency hiding scheduler, which reorders the
module it receives, overlaps the collective with that compute and not another
(DESIGN.md section 5). Barriers do not change any value.
"""

from __future__ import annotations

import logging

from concerto_jax.pipeline import PassOutcome, register_pass
from hlo_passes.pins import pin_windows

log = logging.getLogger(__name__)


@register_pass("pin")
def pin_pass(module, options) -> PassOutcome:
    """Pin the windows of ``module.entry`` read from its current order; see the module docstring."""
    stats = pin_windows(module)
    out = {"windows": stats.windows, "pinned": stats.pinned, "barrier_inputs": stats.barrier_inputs,
           "barrier_outputs": stats.barrier_outputs, "skipped": len(stats.skipped)}
    if stats.skipped:
        log.info("pin pass: left %d windows unpinned: %s", len(stats.skipped),
                 dict(list(stats.skipped.items())[:5]))
    return PassOutcome(changed=stats.pinned > 0, stats=out)
