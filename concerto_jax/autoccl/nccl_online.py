"""Online NCCL tuning on GPU: XLA combine thresholds, then (algorithm, protocol, channels) per collective.

Two stages, driven by measured step time, inside the training loop:

1. *Compile-time knobs* -- XLA's combine thresholds
   (``xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes``,
   i.e. bucket sizes: they trade launch count against overlap with the
   backward pass). Coordinate descent over one grid per collective kind the
   step has, starting at XLA's default. Every candidate is one compiled
   executable (cached). NCCL keeps its own choices meanwhile.
2. *Runtime knobs* -- with the thresholds frozen the step's collectives are
   fixed; each key (``collectives.py``: type x size class x communicator size
   x occurrence), largest traffic first, is tuned with the others held at
   their best: subspaces of (algorithm, protocol) ("nccl" = NCCL's own
   choice) x coordinate descent over the channel count, written into the
   plugin's *live* table between two steps (``plugin.write_table``); no
   recompilation, no restart.

While tuning, collectives are kept out of XLA's command buffers (CUDA
graphs): a captured collective keeps the configuration NCCL chose at capture
(``knobs.command_buffer_options``). At freeze, the user's command-buffer
setting is restored, which costs one more compilation of the step.

``NcclTuningLoop`` is the pure state machine (used by the JAX wrapper
``OnlineNccl`` in ``gpu_step.py`` and, against the NCCL cost model, by tests
and the bench): ``next_candidate()`` -> ``Candidate``; ``report(seconds)``.
Decisions go through ``OnlineTuner`` (process 0 decides under
``jax.distributed``, every process gets the same candidate).

References:
  AutoCCL NSDI'25 §4.1 (subspaces), §4.2 (coordinate descent), §4.3 (online, leader-worker).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from concerto_jax.autoccl import coordination, plugin
from concerto_jax.autoccl.collectives import CollectiveKey
from concerto_jax.autoccl.online import OnlineTuner, TunerOptions
from concerto_jax.autoccl.search import SearchOptions
from concerto_jax.autoccl.space import Choice, Config, IntGrid, SearchSpace

__all__ = [
    "ALGO_PROTOS",
    "CHANNEL_GRID",
    "Candidate",
    "NcclLoopOptions",
    "NcclTuningLoop",
    "XLA_DEFAULT_COMBINE_THRESHOLD",
    "key_space",
    "rows_for",
    "threshold_grid",
]

logger = logging.getLogger(__name__)

XLA_DEFAULT_COMBINE_THRESHOLD = 30 * 1024 * 1024  # XLA:GPU default for all three kinds
ALGO_PROTOS = (
    "nccl",
    "Ring/LL",
    "Ring/LL128",
    "Ring/Simple",
    "Tree/LL",
    "Tree/LL128",
    "Tree/Simple",
)
CHANNEL_GRID = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # 0 = NCCL's channel count


def threshold_grid(lo: int = 1 << 16, hi: int = 1 << 30) -> tuple[int, ...]:
    """Powers of two from ``lo`` to ``hi`` plus XLA's default (30 MiB)."""
    vals = {XLA_DEFAULT_COMBINE_THRESHOLD}
    v = lo
    while v <= hi:
        vals.add(v)
        v *= 2
    return tuple(sorted(vals))


def key_space(kind: str) -> SearchSpace:
    """(algorithm, protocol) subspaces x channels for one collective key (no Tree off all-reduce)."""
    aps = ALGO_PROTOS if kind == "all-reduce" else tuple(a for a in ALGO_PROTOS if "Tree" not in a)
    return SearchSpace(
        strategy=(Choice("algo_proto", aps),),
        resources=(IntGrid("nchannels", CHANNEL_GRID, default=0),),
    )


def rows_for(
    configs: dict[CollectiveKey, Config], keys: Sequence[CollectiveKey]
) -> list[plugin.TableRow]:
    """Table rules for tuned keys (keys with an occurrence first: the first match wins)."""
    rows = []
    ordered = sorted(keys, key=lambda k: k.occurrence is None)
    for key in dict.fromkeys(ordered):
        cfg = configs.get(key)
        if cfg is None or (cfg["algo_proto"] == "nccl" and cfg["nchannels"] == 0):
            continue
        algo, proto = (None, None) if cfg["algo_proto"] == "nccl" else cfg["algo_proto"].split("/")
        lo, hi = plugin.size_class_range(1 << key.size_class)
        rows.append(
            plugin.TableRow(
                key.kind, lo, hi, algo, proto, int(cfg["nchannels"]), key.nranks, key.occurrence
            )
        )
    return rows


@dataclasses.dataclass(frozen=True)
class NcclLoopOptions:
    """Options of the two-stage loop."""

    kinds: tuple[str, ...] = ("all-reduce",)  # collective kinds whose combine threshold is tuned
    thresholds: tuple[int, ...] = threshold_grid()  # grid of every threshold, bytes
    max_keys: int = 6  # keys tuned in stage 2 (largest traffic first); the rest keep NCCL's choice
    # per-occurrence keys only when there are at most max_keys of them; else one key per size class
    split_occurrences: bool = True
    tuner: TunerOptions = TunerOptions(warmup_steps=1, repeats=2)  # per-candidate measurement
    threshold_search: SearchOptions = SearchOptions(min_rel_improvement=0.02)  # stage 1
    key_search: SearchOptions = SearchOptions(subspace_top_k=2, min_rel_improvement=0.02)  # stage 2
    confirm_steps: int = 3  # final check: tuned vs XLA/NCCL defaults, this many steps each


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What the coming step runs with."""

    thresholds: dict[str, int]  # combine threshold per kind (compile-time)
    rows: tuple[plugin.TableRow, ...]  # plugin table (runtime)
    tuning: bool  # True: collectives must stay out of command buffers


class NcclTuningLoop:
    """State machine of the two stages; see the module docstring.

    Args:
      keys_for: thresholds -> the step's collective keys in schedule order (e.g. compile the
        step with those thresholds and ``assign_keys(collective_sites(text))``), plus the bytes
        moved per key (to order keys by traffic): ``(keys, {key: bytes})``.
      options: loop options.
    """

    def __init__(
        self,
        keys_for: Callable[[dict[str, int]], tuple[list[CollectiveKey], dict[CollectiveKey, int]]],
        options: NcclLoopOptions = NcclLoopOptions(),
    ):
        self.keys_for, self.options = keys_for, options
        default = XLA_DEFAULT_COMBINE_THRESHOLD
        if default not in options.thresholds:
            raise ValueError(
                f"NcclLoopOptions.thresholds must contain XLA's default {default} (the start); "
                f"got {options.thresholds[:3]}..."
            )
        space = SearchSpace(
            resources=tuple(IntGrid(k, options.thresholds, default=default) for k in options.kinds)
        )
        self._stage_tuner = OnlineTuner(space, options=self._opts(options.threshold_search))
        self.stage = "thresholds"
        self.thresholds: dict[str, int] = {k: default for k in options.kinds}
        self.keys: list[CollectiveKey] = []
        self.configs: dict[CollectiveKey, Config] = {}
        self._queue: list[CollectiveKey] = []
        self._key: CollectiveKey | None = None
        self.steps = 0
        self.history: list[tuple[str, float]] = []  # (stage, seconds) per step
        self._schedule: list[Candidate] = []
        self._confirm_times: list[float] = []
        self._keep_default = False
        self.confirmed: tuple[float, float] | None = None  # (tuned, default) medians, leader only
        self._coordinate = (
            coordination.multi_process()
            if options.tuner.coordinate is None
            else options.tuner.coordinate
        )
        self._leader = coordination.is_leader() or not self._coordinate

    def _opts(self, search: SearchOptions) -> TunerOptions:
        return dataclasses.replace(self.options.tuner, search=search, confirm=False)

    @property
    def frozen(self) -> bool:
        return self.stage == "frozen"

    def next_candidate(self) -> Candidate:
        """Candidate for the coming step (identical on every process)."""
        if self.stage == "thresholds":
            cfg = self._stage_tuner.next_config()
            if self._stage_tuner.frozen:
                self._enter_keys(dict(cfg))
            else:
                return Candidate(dict(cfg), (), True)
        if self.stage == "keys":
            cfg = self._stage_tuner.next_config()
            while self._stage_tuner.frozen:
                self.configs[self._key] = cfg
                if not self._next_key():
                    break
                cfg = self._stage_tuner.next_config()
            else:
                trial = dict(self.configs)
                trial[self._key] = cfg
                return Candidate(dict(self.thresholds), tuple(rows_for(trial, self.keys)), True)
        if self.stage == "confirm":
            if len(self._confirm_times) < len(self._schedule):
                return self._schedule[len(self._confirm_times)]
            self._finish_confirm()
        return self.final

    @property
    def final(self) -> Candidate:
        """The frozen candidate (meaningful once ``frozen``)."""
        if self._keep_default:
            return Candidate(
                {k: XLA_DEFAULT_COMBINE_THRESHOLD for k in self.options.kinds}, (), False
            )
        return Candidate(dict(self.thresholds), tuple(rows_for(self.configs, self.keys)), False)

    def _start_confirm(self) -> None:
        tuned = dataclasses.replace(self.final, tuning=True)
        default = Candidate(
            {k: XLA_DEFAULT_COMBINE_THRESHOLD for k in self.options.kinds}, (), True
        )
        if self.options.confirm_steps <= 0 or tuned == default:
            self.stage = "frozen"
            return
        self._schedule = [tuned, default] * (self.options.confirm_steps + 1)  # first pair: warm-up
        self._confirm_times = []
        self.stage = "confirm"

    def _finish_confirm(self) -> None:
        keep_default = False
        if self._leader:
            t = self._confirm_times[2:]
            tuned, default = float(np.median(t[0::2])), float(np.median(t[1::2]))
            keep_default = default < tuned
            self.confirmed = (tuned, default)
            logger.info(
                "autoccl: confirmation tuned %.4g s vs default %.4g s: keeping %s",
                tuned,
                default,
                "the default" if keep_default else "the tuned settings",
            )
        if self._coordinate:
            choice = SearchSpace(strategy=(Choice("keep_default", (False, True)),))
            cfg, _ = coordination.broadcast_decision(
                choice, Config(keep_default=keep_default), True
            )
            keep_default = cfg["keep_default"]
        self._keep_default = keep_default
        self.stage = "frozen"
        logger.info("autoccl: NCCL tuning frozen after %d steps", self.steps)

    def report(self, seconds: float) -> None:
        """Measured time of the step run with the last candidate (ignored once frozen)."""
        if self.frozen:
            return
        self.steps += 1
        self.history.append((self.stage, float(seconds)))
        if self.stage == "confirm":
            self._confirm_times.append(float(seconds))
        else:
            self._stage_tuner.report(seconds)

    def _enter_keys(self, thresholds: dict[str, int]) -> None:
        self.thresholds = thresholds
        keys, traffic = self.keys_for(thresholds)
        if not self.options.split_occurrences or len(set(keys)) > self.options.max_keys:
            merged: dict[CollectiveKey, int] = {}
            for k in set(keys):
                m = dataclasses.replace(k, occurrence=None)
                merged[m] = merged.get(m, 0) + traffic.get(k, 0)
            keys, traffic = [dataclasses.replace(k, occurrence=None) for k in keys], merged
        self.keys = list(keys)
        order = sorted(dict.fromkeys(keys), key=lambda k: -traffic.get(k, 0))
        self._queue = order[: self.options.max_keys]
        logger.info(
            "autoccl: thresholds frozen at %s after %d steps; tuning %d of %d collective keys",
            thresholds,
            self.steps,
            len(self._queue),
            len(order),
        )
        self.stage = "keys"
        if not self._next_key():
            self._start_confirm()

    def _next_key(self) -> bool:
        if not self._queue:
            self._start_confirm()
            return False
        self._key = self._queue.pop(0)
        space = key_space(self._key.kind)
        self._stage_tuner = OnlineTuner(space, options=self._opts(self.options.key_search))
        return True
