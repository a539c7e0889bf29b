"""Serial schedule-generation scheme (SGS) and simple bounds for RCPSP instances.

The SGS gives the CP-SAT model a feasible horizon and a solution hint; the bounds
(critical path, resource energy) give it a lower bound and per-task time windows.

References: Kolisch & Hartmann (1999), "Heuristic algorithms for solving the
resource-constrained project scheduling problem"; Concerto (ASPLOS'25) §4.2.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from concerto_jax.scheduler.rcpsp import RcpspInstance


def topological_order(succs: Sequence[Sequence[int]]) -> list[int]:
    """Kahn's order of a DAG given by successor lists (raises ValueError on a cycle)."""
    n = len(succs)
    indeg = [0] * n
    for ss in succs:
        for s in ss:
            indeg[s] += 1
    stack = [i for i in range(n) if indeg[i] == 0][::-1]
    order = []
    while stack:
        i = stack.pop()
        order.append(i)
        for s in succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                stack.append(s)
    if len(order) != n:
        raise ValueError(f"precedence graph has a cycle ({n - len(order)} tasks on or after it)")
    return order


def earliest_starts(durations: Sequence[int], succs: Sequence[Sequence[int]]) -> list[int]:
    """Earliest start of each task ignoring resources (forward longest path)."""
    est = [0] * len(durations)
    for i in topological_order(succs):
        end = est[i] + durations[i]
        for s in succs[i]:
            if end > est[s]:
                est[s] = end
    return est


def latest_tails(durations: Sequence[int], succs: Sequence[Sequence[int]]) -> list[int]:
    """Length of the longest path from each task's start to the end (its duration included)."""
    tail = list(durations)
    for i in reversed(topological_order(succs)):
        best = 0
        for s in succs[i]:
            if tail[s] > best:
                best = tail[s]
        tail[i] = durations[i] + best
    return tail


def resource_lower_bound(instance: RcpspInstance) -> int:
    """Energy bound: max over resources of ceil(sum(duration * demand) / capacity)."""
    best = 0
    for r, cap in enumerate(instance.capacities):
        energy = sum(d * q[r] for d, q in zip(instance.durations, instance.demands, strict=False))
        best = max(best, -(-energy // cap) if cap else 0)
    return best


def serial_sgs(instance: RcpspInstance, priority: Sequence[float]) -> tuple[list[int], int]:
    """Serial SGS: repeatedly schedule the eligible task of highest priority as early as possible.

    Args:
      instance: the problem.
      priority: larger first, among tasks whose predecessors are all scheduled.

    Returns:
      (start times, makespan).
    """
    n = instance.num_tasks
    dur = instance.durations
    succs = instance.successors
    horizon = sum(dur) + 1
    caps = np.asarray(instance.capacities, dtype=np.int64)[:, None]
    dem = np.asarray(instance.demands, dtype=np.int64).reshape(n, len(instance.capacities))
    usage = np.zeros((len(instance.capacities), horizon), dtype=np.int64)
    npred = [0] * n
    for ss in succs:
        for s in ss:
            npred[s] += 1
    ready_at = [0] * n
    eligible = {i for i in range(n) if npred[i] == 0}
    starts = [0] * n
    for _ in range(n):
        i = max(eligible, key=lambda j: (priority[j], -j))
        eligible.remove(i)
        d = dur[i]
        t = ready_at[i]
        if d > 0 and dem[i].any():
            need = dem[i][:, None]
            while True:
                window = usage[:, t : t + d] + need > caps
                if not window.any():
                    break
                t += int(np.nonzero(window.any(axis=0))[0][-1]) + 1
            usage[:, t : t + d] += need
        starts[i] = t
        for s in succs[i]:
            ready_at[s] = max(ready_at[s], t + d)
            npred[s] -= 1
            if npred[s] == 0:
                eligible.add(s)
    makespan = max((starts[i] + dur[i] for i in range(n)), default=0)
    return starts, makespan


def serial_sgs_best(instance: RcpspInstance, samples: int = 30, seed: int = 0) -> tuple[list[int], int]:
    """Best of the SGS under the latest-start rule, the longest-tail rule and biased random samples.

    Returns:
      (start times, makespan) of the best schedule found.
    """
    dur = instance.durations
    succs = instance.successors
    tail = latest_tails(dur, succs)
    horizon = max(tail, default=0)
    rules = [
        [-(horizon - t) for t in tail],  # minimum latest start time (LST)
        [t + 1e-3 * sum(q) * d for t, q, d in zip(tail, instance.demands, dur, strict=False)],
    ]
    rng = random.Random(seed)
    for _ in range(samples):
        rules.append([t * (0.75 + 0.5 * rng.random()) for t in tail])
    best = None
    for prio in rules:
        starts, mk = justify(instance, *serial_sgs(instance, prio))
        if best is None or mk < best[1]:
            best = (starts, mk)
    return best


def justify(instance: RcpspInstance, starts: list[int], makespan: int, passes: int = 3):
    """Forward-backward improvement: right-justify then left-justify a schedule, repeatedly.

    Each backward pass schedules the reversed project (successors become predecessors)
    in order of latest finish; each forward pass in order of earliest start of the
    backward schedule. Never returns a longer schedule.

    References: Valls, Ballestín & Quintanilla (2005), "Justification and RCPSP".
    """
    n = instance.num_tasks
    preds: list[list[int]] = [[] for _ in range(n)]
    for i, ss in enumerate(instance.successors):
        for s in ss:
            preds[s].append(i)
    reverse = dataclasses.replace(instance, successors=tuple(tuple(p) for p in preds))
    dur = instance.durations
    for _ in range(passes):
        ends = [starts[i] + dur[i] for i in range(n)]
        rstarts, rmk = serial_sgs(reverse, ends)  # latest finish first
        fstarts, fmk = serial_sgs(instance, [-(rmk - rstarts[i] - dur[i]) for i in range(n)])
        if fmk >= makespan:
            break
        starts, makespan = fstarts, fmk
    return starts, makespan
