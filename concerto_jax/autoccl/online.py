"""Online tuner: runs the search inside the user's training loop, then freezes.

Usage (every process runs the same loop)::

    tuner = OnlineTuner(space, signature=sig, store=TuningStore("autoccl.json"))
    for step in range(num_steps):
        config = tuner.next_config()          # same config on every process
        t0 = time.perf_counter()
        state = run_step(config, state)       # e.g. pick the executable for this bucket size
        jax.block_until_ready(state)
        tuner.report(time.perf_counter() - t0)

Each candidate config is run for ``warmup_steps + repeats`` consecutive
steps; the warm-up samples (compilation, cold caches) are discarded and the
rest reduced by ``robust_time`` (median after outlier rejection). The
aggregated time drives ``coordinate_descent``. When the search ends, an
optional confirmation round re-measures the winner and the starting config
(same number of steps each) and keeps the faster (so the tuner does not end slower than it started
because of one lucky sample); then the tuner freezes, stores the result and
returns the same config forever at no cost.

Only the leader (process 0) measures and decides. Because the number of
steps per candidate is fixed, all processes know when a decision is due and
meet in ``broadcast_decision`` at exactly those steps; nothing is exchanged
once frozen.

References:
  AutoCCL NSDI'25 §4.3 (online tuning in the first iterations, leader-worker).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from concerto_jax.autoccl import coordination
from concerto_jax.autoccl.measurement import robust_time
from concerto_jax.autoccl.search import SearchOptions, SearchResult, coordinate_descent
from concerto_jax.autoccl.space import Config, SearchSpace
from concerto_jax.autoccl.store import Signature, TuningStore

__all__ = ["OnlineTuner", "TunerOptions", "TuningEvent", "TuningResult"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TunerOptions:
    """Options of the online tuner."""

    warmup_steps: int = 1  # samples discarded after every config change (compile, caches)
    repeats: int = 3  # samples kept per config, reduced by median after outlier rejection
    outlier_mads: float = 3.0  # rejection threshold in robust standard deviations
    confirm: bool = True  # re-measure winner and start at the end and keep the faster
    search: SearchOptions = SearchOptions()  # coordinate-descent options
    coordinate: bool | None = None  # broadcast decisions from process 0 (None: iff multi-process)

    def __post_init__(self):
        if self.repeats < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"need repeats >= 1 and warmup_steps >= 0; got {self.repeats}, {self.warmup_steps}."
            )


@dataclasses.dataclass(frozen=True)
class TuningEvent:
    """Progress report passed to the ``progress`` callback after every measured candidate."""

    step: int  # training steps seen so far
    phase: str  # "search", "confirm" or "frozen"
    config: Config  # candidate just measured (or the final config when frozen)
    time: float  # its aggregated time, seconds (nan on workers and for stored results)
    best_config: Config  # best so far
    best_time: float  # its time, seconds
    evaluations: int  # distinct configs measured so far


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """What the tuner settled on (times are the leader's measurements; nan on workers)."""

    config: Config  # the frozen config
    time: float  # its measured time, seconds
    start_config: Config  # the starting config
    start_time: float  # its measured time, seconds
    evaluations: int  # distinct configs measured by the search
    steps: int  # training steps spent tuning (including warm-up and confirmation)
    from_store: bool  # reused from the store instead of tuned
    search: SearchResult | None  # the search's own record (leader only)

    @property
    def speedup(self) -> float:
        """start_time / time."""
        return self.start_time / self.time


class OnlineTuner:
    """Step-by-step tuner for a training loop; see the module docstring.

    Args:
      space: the search space.
      signature: what is tuned (key of the store); required with ``store``.
      options: tuner options.
      store: where results are reused from and saved to (leader writes).
      progress: optional callback receiving a ``TuningEvent`` per measured candidate.
      start: starting config (default: ``options.search.start`` or the space defaults).
    """

    def __init__(
        self,
        space: SearchSpace,
        signature: Signature | None = None,
        options: TunerOptions = TunerOptions(),
        store: TuningStore | None = None,
        progress: Callable[[TuningEvent], None] | None = None,
        start: Config | None = None,
    ):
        if store is not None and signature is None:
            raise ValueError(
                "OnlineTuner: a store needs a signature to key the result; pass signature=."
            )
        self.space, self.signature, self.options = space, signature, options
        self.store, self.progress = store, progress
        self._coordinate = (
            coordination.multi_process() if options.coordinate is None else options.coordinate
        )
        self._leader = coordination.is_leader() or not self._coordinate
        search_opts = options.search
        if start is not None:
            search_opts = dataclasses.replace(search_opts, start=start)
        self._start = search_opts.start or space.default_config()
        self._gen = coordinate_descent(space, search_opts) if self._leader else None
        self._stored = store.get(signature, space) if (store is not None and self._leader) else None
        self._phase = "search"
        self._current: Config | None = None
        self._samples: list[float] = []
        self._steps = 0
        self._pending = False  # next_config issued, report not yet received
        self._search_result: SearchResult | None = None
        self._confirm: list[Config] = []
        self._confirm_times: dict[Config, float] = {}
        self._result: TuningResult | None = None
        self._best: tuple[Config, float] = (self._start, float("nan"))
        self._measured: set[Config] = set()

    # ------------------------------------------------------------------ public
    @property
    def frozen(self) -> bool:
        """True once tuning is over; ``next_config`` then returns ``result.config``."""
        return self._phase == "frozen"

    @property
    def result(self) -> TuningResult | None:
        """The final ``TuningResult`` once frozen, else None."""
        return self._result

    def next_config(self) -> Config:
        """Config to run the coming step with (identical on every process)."""
        if self._pending or self.frozen:
            return self._current
        per_config = self.options.warmup_steps + self.options.repeats
        if self._current is None or len(self._samples) >= per_config:
            self._decide()
        self._pending = not self.frozen
        return self._current

    def report(self, seconds: float) -> None:
        """Measured time of the step run with the last ``next_config`` (ignored once frozen)."""
        if self.frozen:
            return
        if not self._pending:
            raise RuntimeError("OnlineTuner.report() called without a preceding next_config().")
        self._pending = False
        self._steps += 1
        self._samples.append(float(seconds))

    # ----------------------------------------------------------------- private
    def _aggregate(self) -> float:
        kept = self._samples[self.options.warmup_steps :]
        stats = robust_time(kept, self.options.outlier_mads)
        if stats.rejected:
            logger.debug(
                "autoccl: %d outlier sample(s) rejected for %s", stats.rejected, self._current
            )
        return stats.time

    def _decide(self) -> None:
        """Leader computes the next (config, frozen); all processes then agree on it."""
        config, frozen = None, False
        if self._leader:
            config, frozen = self._leader_step()
        if self._coordinate:
            config, frozen = coordination.broadcast_decision(self.space, config, frozen)
        self._current, self._samples = config, []
        if frozen:
            self._freeze(config)

    def _leader_step(self) -> tuple[Config, bool]:
        if self._current is None:  # first call
            if self._stored is not None:
                logger.info(
                    "autoccl: reusing stored config for %s: %s",
                    self.signature.key,
                    self._stored["config"],
                )
                return self._stored["config"], True
            return next(self._gen), False
        t = self._aggregate()
        if self._phase == "search":
            self._note(t)
            try:
                return self._gen.send(t), False
            except StopIteration as stop:
                self._search_result = stop.value
            res = self._search_result
            if self.options.confirm and res.best_config != res.start_config:
                self._phase = "confirm"
                self._confirm = [res.best_config, res.start_config]
                return self._confirm[0], False
            return res.best_config, True
        # confirmation round: [winner, start]
        self._confirm_times[self._current] = t
        self._emit("confirm", self._current, t)
        if len(self._confirm_times) < len(self._confirm):
            return self._confirm[len(self._confirm_times)], False
        winner = min(self._confirm, key=lambda c: self._confirm_times[c])
        return winner, True

    def _note(self, t: float) -> None:
        self._measured.add(self._current)
        if not (t >= self._best[1]):  # also true while best is nan
            self._best = (self._current, t)
        self._emit("search", self._current, t)

    def _emit(self, phase: str, config: Config, t: float) -> None:
        n = len(self._measured)
        event = TuningEvent(self._steps, phase, config, t, self._best[0], self._best[1], n)
        logger.info(
            "autoccl[%s] step %d: %s -> %.4g s (best %.4g s, %d evaluated)",
            phase,
            self._steps,
            dict(config),
            t,
            self._best[1],
            n,
        )
        if self.progress is not None:
            self.progress(event)

    def _freeze(self, config: Config) -> None:
        self._phase = "frozen"
        nan = float("nan")
        res = self._search_result
        if self._leader and self._stored is not None:
            self._result = TuningResult(
                config, float(self._stored.get("time", nan)), config, nan, 0, 0, True, None
            )
        elif self._leader and res is not None:
            t = self._confirm_times.get(
                config, res.best_time if config == res.best_config else res.start_time
            )
            t0 = self._confirm_times.get(res.start_config, res.start_time)
            self._result = TuningResult(
                config, t, res.start_config, t0, res.evaluations, self._steps, False, res
            )
            if self.store is not None:
                self.store.put(
                    self.signature,
                    self.space,
                    config,
                    time=t,
                    start_time=t0,
                    evaluations=res.evaluations,
                    steps=self._steps,
                )
        else:  # worker: knows the decision, not the measurements
            self._result = TuningResult(config, nan, self._start, nan, 0, self._steps, False, None)
        self._best = (config, self._result.time)
        logger.info("autoccl: frozen on %s after %d steps", dict(config), self._steps)
        if self.progress is not None:
            r = self._result
            self.progress(
                TuningEvent(self._steps, "frozen", config, r.time, config, r.time, r.evaluations)
            )
