"""``OnlineNccl``: run a jitted GPU training step while tuning NCCL and XLA's combiners online.

Usage (three lines; the environment must be set before the first collective
runs, because NCCL loads the tuner plugin when it creates a communicator)::

    from concerto_jax import autoccl
    tuner = autoccl.OnlineNccl(train_step, store="autoccl.json")   # sets NCCL_TUNER_PLUGIN + table
    for batch in data: state, loss = tuner(state, batch)           # tunes, then runs frozen

Every call runs one step: it takes the loop's candidate (``nccl_online``),
compiles the step for its combine thresholds (cached; command buffers
without collectives while tuning), writes the candidate's rules into the live
plugin table (atomic rename; NCCL's next ``getCollInfo`` reads it), runs and
times the step (``block_until_ready``) and reports the time. Once frozen the
result is stored per step signature (HLO fingerprint x devices) and reused at
the next start without tuning; the step is compiled once more with the
user's own command-buffer setting.

Not exercised on a GPU yet: the CPU tests cover the loop, the plugin and the
keys (docs/DECISIONS.md D32; open points in WORKSPACE_NOTES.md).

References:
  AutoCCL NSDI'25 §4.3, §5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from concerto_jax.autoccl import knobs, plugin
from concerto_jax.autoccl.collectives import assign_keys, collective_sites
from concerto_jax.autoccl.nccl_online import Candidate, NcclLoopOptions, NcclTuningLoop
from concerto_jax.autoccl.store import Signature, TuningStore

__all__ = ["OnlineNccl", "enable_plugin"]

logger = logging.getLogger(__name__)


def enable_plugin(table: str | os.PathLike[str] | None = None) -> str:
    """Builds the plugin if needed and sets ``NCCL_TUNER_PLUGIN`` and the table path in ``os.environ``.

    Call before the first collective runs. Returns the table path (created with no rule:
    NCCL's own choices until the tuner writes one).
    """
    table = os.fspath(
        table or os.path.join(tempfile.gettempdir(), f"concerto-nccl-{os.getpid()}.txt")
    )
    if not os.path.exists(table):
        plugin.write_table([], table)
    os.environ.update(plugin.plugin_env(plugin.ensure_built(), table))
    return table


class OnlineNccl:
    """Callable wrapper of a jitted step; see the module docstring.

    Args:
      step: a ``jax.jit``-wrapped function.
      store: JSON file of results per step signature (None: no persistence).
      table: plugin table path (default: a per-process file under the temp dir).
      options: loop options.
      compiler_options: the user's own compiler options for the step (restored when frozen).
    """

    def __init__(
        self,
        step: Callable,
        store: str | os.PathLike[str] | None = None,
        table: str | os.PathLike[str] | None = None,
        options: NcclLoopOptions | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ):
        self.step, self.options = step, options or NcclLoopOptions()
        self.user_options = dict(compiler_options or {})
        self.table = enable_plugin(table)
        self.store = TuningStore(store) if store is not None else None
        self.loop: NcclTuningLoop | None = None
        self._lowered = None
        self._compiled: dict[tuple, Any] = {}
        self._final: Candidate | None = None

    def _compile(self, thresholds: Mapping[str, int], tuning: bool):
        key = (tuple(sorted(thresholds.items())), tuning)
        if key not in self._compiled:
            opts = knobs.command_buffer_options(self.user_options, tuning)
            opts.update(knobs.gpu_combine_threshold_options(thresholds))
            t0 = time.perf_counter()
            self._compiled[key] = self._lowered.compile(compiler_options=opts)
            logger.info("autoccl: compiled step %s in %.1f s", key, time.perf_counter() - t0)
        return self._compiled[key]

    def _keys_for(self, thresholds):
        sites = collective_sites(self._compile(thresholds, True).as_text())
        keys = assign_keys(sites)
        traffic: dict = {}
        for k, s in zip(keys, sites, strict=True):
            traffic[k] = traffic.get(k, 0) + s.nbytes
        return keys, traffic

    def _signature(self) -> Signature:
        text = self._lowered.as_text()
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return Signature(f"nccl-step:{digest}", len(text), f"{jax.device_count()} devices")

    def __call__(self, *args):
        if self._lowered is None:
            self._lowered = self.step.lower(*args)
            self.loop = NcclTuningLoop(self._keys_for, self.options)
            if self.store is not None and (rec := self.store.get_record(self._signature())):
                rows = tuple(
                    plugin.TableRow(
                        **{**r, "occurrence": r["occurrence"] and tuple(r["occurrence"])}
                    )
                    for r in rec["rows"]
                )
                self._final = Candidate(dict(rec["thresholds"]), rows, False)
                plugin.write_table(self._final.rows, self.table)
                logger.info("autoccl: reusing stored NCCL tuning for this step")
        if self._final is not None:
            return self._compile(self._final.thresholds, False)(*args)
        cand = self.loop.next_candidate()
        if self.loop.frozen:
            self._freeze(cand)
            return self._compile(cand.thresholds, False)(*args)
        exe = self._compile(cand.thresholds, True)
        plugin.write_table(cand.rows, self.table)
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(*args))
        self.loop.report(time.perf_counter() - t0)
        return out

    def _freeze(self, cand: Candidate) -> None:
        self._final = cand
        plugin.write_table(cand.rows, self.table)
        if self.store is not None and jax.process_index() == 0:
            self.store.put_record(
                self._signature(),
                {
                    "thresholds": cand.thresholds,
                    "rows": [dataclasses.asdict(r) for r in cand.rows],
                    "steps": self.loop.steps,
                },
            )
