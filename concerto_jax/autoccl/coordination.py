"""Leader/worker coordination: the leader (process 0) decides, every process receives the config.

AutoCCL runs its optimizer on a leader and a coordinator broadcasts each new
candidate to all ranks, so that every rank runs the *same* collective
configuration (mismatched NCCL settings or bucket layouts across ranks would
deadlock or corrupt the collective). Here the config travels as one int32
vector (``SearchSpace.encode``) through
``jax.experimental.multihost_utils.broadcast_one_to_all``; every process must
call ``broadcast_decision`` at the same points, which the online tuner
guarantees by making decisions on a fixed step schedule.

References:
  AutoCCL NSDI'25 §4.3 (leader-worker architecture, coordinator).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from concerto_jax.autoccl.space import Config, SearchSpace

__all__ = ["broadcast_decision", "is_leader", "multi_process"]


def is_leader() -> bool:
    """True on process 0 (the process that measures and decides)."""
    return jax.process_index() == 0


def multi_process() -> bool:
    """True when the JAX runtime spans several processes."""
    return jax.process_count() > 1


def broadcast_decision(
    space: SearchSpace, config: Config | None, frozen: bool
) -> tuple[Config, bool]:
    """Sends the leader's (config, frozen) to every process.

    Args:
      space: the search space (fixes the encoding length).
      config: the leader's decision; ignored on workers (may be None there).
      frozen: the leader's frozen flag; ignored on workers.

    Returns:
      The leader's (config, frozen) on every process.
    """
    n = len(space.strategy) + len(space.resources)
    if is_leader():
        payload = np.concatenate([[int(frozen)], space.encode(config)]).astype(np.int32)
    else:
        payload = np.zeros(n + 1, dtype=np.int32)
    if multi_process():
        payload = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    return space.decode(payload[1:]), bool(payload[0])
