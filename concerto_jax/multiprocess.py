"""One plan for every process: process 0 decides, the others receive its decision.

Under ``jax.distributed`` every process must run the same program, or the
collectives deadlock. Solvers with time limits, and passes in general, are
not guaranteed to give the same answer in two processes, so only process 0
(the leader) runs the pipeline; the result (the emitted module and its
account, as JSON) is broadcast to every process. Every process also checks
that it captured the same module as the leader; the decision to use the plan
or to fall back is then taken jointly (all processes see the same flags), so
a failure anywhere makes *every* process fall back, never some of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from hlo_passes.ir import without_source_locations

log = logging.getLogger(__name__)


class LeaderPlanError(RuntimeError):
    """The leader could not produce a plan, or this process captured a different module."""


def _digest(text: str) -> np.ndarray:
    """The program's digest: without the stack tables JAX records of where it was traced (the
    same step traced from two code paths differs there only)."""
    return np.frombuffer(hashlib.sha256(without_source_locations(text).encode()).digest(),
                         dtype=np.int32).copy()


def leader_decides(captured_text: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``build`` on process 0 only and return its JSON-serialisable result on every process.

    Args:
      captured_text: this process's captured module (all processes must agree on it, source
        locations aside).
      build: produces the plan (a JSON-serialisable dict); called on the leader only.

    Returns:
      The leader's plan, identical on every process.

    Raises:
      LeaderPlanError: on every process alike, if the leader's ``build`` failed or
        some process captured a module different from the leader's.
    """
    if jax.process_count() == 1:
        return build()
    leader = jax.process_index() == 0
    payload = b""
    leader_error = ""
    if leader:
        try:
            payload = json.dumps(build()).encode()
        except Exception as e:  # noqa: BLE001 - reported to every process below
            leader_error = f"{type(e).__name__}: {e}"
            payload = leader_error.encode()
    header = np.zeros(2 + 8, dtype=np.int32)
    if leader:
        header[0] = 0 if leader_error else 1
        header[1] = len(payload)
        header[2:] = _digest(captured_text)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    size = int(header[1])
    buf = np.zeros(max(size, 1), dtype=np.uint8)
    if leader:
        buf[:size] = np.frombuffer(payload, dtype=np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    data = bytes(buf[:size])
    same = np.array([int(np.array_equal(header[2:], _digest(captured_text)))], dtype=np.int32)
    all_same = np.asarray(multihost_utils.process_allgather(same)).reshape(-1)
    if not header[0]:
        raise LeaderPlanError(f"process 0 could not build the plan: {data.decode(errors='replace')}")
    if not all_same.all():
        bad = [int(i) for i in np.nonzero(all_same == 0)[0]]
        raise LeaderPlanError(
            f"processes {bad} captured a different module than process 0 (the step must be "
            "the same program on every process)")
    log.info("process %d received the leader's plan (%d bytes)", jax.process_index(), size)
    return json.loads(data.decode())


def all_succeeded(ok: bool) -> bool:
    """True on every process iff ``ok`` is True on every process (a joint decision)."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.array([int(ok)], dtype=np.int32))
    return bool(np.asarray(flags).all())
