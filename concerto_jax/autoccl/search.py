"""Subspace enumeration + coordinate descent with an adaptive step and restarts.

The search is written as a *generator*: it yields the next config to
measure and receives the measured time (seconds, lower is better) through
``send``. That one piece of code serves both the offline driver
(``minimize(space, measure)``) and the online tuner, which feeds it one
aggregated measurement every few training steps (``online.py``).

Per subspace (one combination of strategy values), the resource parameters
are searched by coordinate descent on their grid indices (AutoCCL
Algorithm 2): move along one dimension while the time improves, the step
growing after every success and shrinking (halving) after a failure; when
both directions fail at step 1 that dimension is done and the next one is
tried; an improvement re-opens all dimensions; the descent ends when a full
round over the dimensions brings nothing. Unimodality per dimension is what
makes this sound (AutoCCL §4.2, "the trends ... unimodal"). Optional random
restarts guard against the cases where the joint surface is not
well-behaved.

Differences from the paper, on purpose: the step is an integer number of
grid points that starts coarse (a quarter of the grid), doubles on success
and halves on failure down to one grid point (the paper starts small and
grows the step with the relative gain; starting coarse is what gets across
the flat, noisy plateaus measured on real runs, e.g. bucket sizes much
smaller than the gradients); and an improvement must exceed
``min_rel_improvement`` so that measurement noise cannot drive a random
walk.

References:
  AutoCCL NSDI'25 §4.2 (Algorithm 2, coordinate descent), §4.1 (subspaces).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator

import numpy as np

from concerto_jax.autoccl.space import Config, SearchSpace

__all__ = ["SearchOptions", "SearchResult", "coordinate_descent", "minimize"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """Options of the coordinate-descent search."""

    initial_step: int | None = (
        None  # first step along a dimension in grid points (None: a quarter of the grid)
    )
    grow: int = 2  # step multiplier after a successful move
    max_step: int = 64  # cap on the step, in grid points
    restarts: int = 0  # extra descents per subspace from random starting points
    min_rel_improvement: float = 0.01  # a move counts as better only if time < best*(1-this)
    subspace_top_k: int | None = (
        None  # descend only in the k subspaces best at their start point (None: all)
    )
    refresh_incumbent: bool = (
        True  # re-measure a once-measured incumbent before giving up on a dimension
    )
    max_evaluations: int | None = None  # hard budget of distinct measured configs (None: unbounded)
    seed: int = 0  # seed of the restart points
    start: Config | None = None  # starting config of the first subspace (None: space defaults)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Outcome of a search."""

    best_config: Config  # config with the lowest measured time
    best_time: float  # its measured time (seconds)
    start_config: Config  # the first config measured (the baseline)
    start_time: float  # its measured time (seconds)
    evaluations: int  # distinct configs measured
    history: tuple[tuple[Config, float], ...]  # every measurement, in order

    @property
    def speedup(self) -> float:
        """start_time / best_time."""
        return self.start_time / self.best_time


class _BudgetExhausted(Exception):
    pass


def _initial_step(grid, options: SearchOptions) -> int:
    if options.initial_step is not None:
        return max(1, options.initial_step)
    return max(1, len(grid.values) // 4)


def coordinate_descent(
    space: SearchSpace, options: SearchOptions = SearchOptions()
) -> Generator[Config, float, SearchResult]:
    """Generator driving the search: yields configs, receives their times.

    Usage::

        gen = coordinate_descent(space)
        config = next(gen)
        try:
            while True:
                config = gen.send(measure(config))
        except StopIteration as stop:
            result = stop.value

    A config already measured is not yielded again (its time is reused), except that an
    incumbent measured once is re-measured once before a dimension is given up
    (``refresh_incumbent``): a single lucky sample must not freeze the search.

    Args:
      space: the search space.
      options: search options.

    Returns:
      (as ``StopIteration.value``) the ``SearchResult``.

    References:
      AutoCCL NSDI'25 §4.2, Algorithm 2.
    """
    rng = np.random.default_rng(options.seed)
    cache: dict[Config, float] = {}  # config -> current estimate (median of its samples)
    samples: dict[Config, list[float]] = {}
    history: list[tuple[Config, float]] = []

    def evaluate(cfg: Config) -> Generator[Config, float, float]:
        if cfg in cache:
            return cache[cfg]
        if options.max_evaluations is not None and len(cache) >= options.max_evaluations:
            raise _BudgetExhausted
        t = yield cfg
        t = float(t)
        if np.isnan(t) or t <= 0:
            logger.warning(
                "autoccl: measurement %r for %s is not a positive time; treated as +inf", t, cfg
            )
            t = float("inf")
        cache[cfg] = t
        samples[cfg] = [t]
        history.append((cfg, t))
        return t

    def refresh(
        sub: Config, x: list[int], dim: int
    ) -> Generator[Config, float, tuple[list[int], float]]:
        """Re-measures a lucky-looking incumbent once; moves to a probed neighbour that now wins."""
        cfg = space.from_indices(sub, x)
        if len(samples[cfg]) == 1 and np.isfinite(cache[cfg]):
            t = float((yield cfg))
            samples[cfg].append(t if t > 0 and not np.isnan(t) else float("inf"))
            cache[cfg] = float(np.median(samples[cfg]))
            history.append((cfg, t))
        fx, best_x = cache[cfg], x
        for k in range(len(space.resources[dim].values)):
            y = list(x)
            y[dim] = k
            cy = space.from_indices(sub, y)
            if (
                cy in cache
                and better(cache[cy], fx)
                and cache[cy] < cache[space.from_indices(sub, best_x)]
            ):
                best_x = y
        return best_x, cache[space.from_indices(sub, best_x)]

    def better(a: float, b: float) -> bool:
        return a < b * (1.0 - options.min_rel_improvement)

    def descend(sub: Config, x: list[int]) -> Generator[Config, float, tuple[list[int], float]]:
        grids = space.resources
        fx = yield from evaluate(space.from_indices(sub, x))
        d = len(grids)
        if d == 0 or fx == float("inf"):  # +inf: combination not offered; nothing to descend
            return x, fx
        step = [_initial_step(g, options) for g in grids]
        first_dir = [+1] * d
        dim, failed_dims = 0, 0
        while failed_dims < d:
            improved = False
            for direction in (first_dir[dim], -first_dir[dim]):
                s = step[dim]
                while True:
                    y = list(x)
                    y[dim] = int(np.clip(x[dim] + direction * s, 0, len(grids[dim].values) - 1))
                    if y[dim] == x[dim]:
                        if s > 1:  # clipped at the border: try shorter steps
                            s = max(1, s // 2)
                            continue
                        break
                    fy = yield from evaluate(space.from_indices(sub, y))
                    if better(fy, fx):
                        x, fx, improved = y, fy, True
                        first_dir[dim] = direction
                        step[dim] = s = min(s * options.grow, options.max_step)
                    elif s > 1:
                        s = max(1, s // 2)  # shrink on failure
                    else:
                        break
                if improved:
                    break
            if not improved and options.refresh_incumbent:
                x_new, fx = yield from refresh(sub, x, dim)
                improved, x = x_new != x, x_new
            if not improved:
                step[dim] = _initial_step(grids[dim], options)
            failed_dims = 0 if improved else failed_dims + 1
            dim = (dim + 1) % d
        return x, fx

    subspaces = space.subspaces()
    start = options.start if options.start is not None else space.default_config()
    start_sub = space.strategy_of(start)
    subspaces.sort(key=lambda s: s != start_sub)  # the start's subspace first
    starts = {s: space.default_config(s) for s in subspaces}
    starts[start_sub] = start
    try:
        if options.subspace_top_k is not None and len(subspaces) > options.subspace_top_k:
            probe = []
            for s in subspaces:
                t = yield from evaluate(starts[s])
                probe.append((t, s != start_sub, s))
            probe.sort(key=lambda p: (p[0], p[1]))
            kept = [p[2] for p in probe[: options.subspace_top_k]]
            logger.info("autoccl: subspaces kept after probing: %s", kept)
            subspaces = kept
        for sub in subspaces:
            x0 = space.resource_indices(starts[sub])
            x, fx = yield from descend(sub, x0)
            logger.debug("autoccl: subspace %s descent -> %s (%.3g s)", sub, x, fx)
            for _ in range(options.restarts):
                xr = [int(rng.integers(len(g.values))) for g in space.resources]
                x, fx = yield from descend(sub, xr)
    except _BudgetExhausted:
        logger.info("autoccl: evaluation budget of %d reached", options.max_evaluations)
    start_time = cache[start] if start in cache else float("inf")
    best_config = min(cache, key=cache.__getitem__)
    return SearchResult(
        best_config=best_config,
        best_time=cache[best_config],
        start_config=start,
        start_time=start_time,
        evaluations=len(cache),
        history=tuple(history),
    )


def minimize(
    space: SearchSpace, measure: Callable[[Config], float], options: SearchOptions = SearchOptions()
) -> SearchResult:
    """Runs the search offline, calling ``measure(config) -> seconds`` for every new config.

    Args:
      space: the search space.
      measure: returns the (aggregated) time of one config; lower is better.
      options: search options.

    Returns:
      The ``SearchResult``.

    References:
      AutoCCL NSDI'25 §4.2.
    """
    gen = coordinate_descent(space, options)
    try:
        cfg = next(gen)
        while True:
            cfg = gen.send(measure(cfg))
    except StopIteration as stop:
        return stop.value
