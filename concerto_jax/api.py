"""``concerto_jax.optimize``: the user-facing decorator.

    @concerto_jax.optimize
    @partial(jax.jit, in_shardings=..., out_shardings=..., donate_argnums=0)
    def train_step(state, batch): ...

Per input signature (pytree, shapes, dtypes, shardings, static values) the
step is captured once (post-SPMD module), run through the pass pipeline,
emitted, compiled for the same devices and cached; later calls go straight to
the cached executable. Internal failures never reach the user as a crash or a
wrong result: the signature falls back to the original step with one warning
that gives the reason. Bad input (a function that is not jitted, arguments the
step rejects) raises a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

from concerto_jax import capture as capture_lib
from concerto_jax import executor, multiprocess, pipeline
from concerto_jax.options import Options, defaults_for_platform
from concerto_jax.report import Report

log = logging.getLogger(__name__)


class ConcertoFallbackWarning(UserWarning):
    """The optimised module could not be built for a signature; the original step runs."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One compiled signature: our executable (None after a fallback), report, HLO texts."""

    compiled: Any
    report: Report
    captured: str
    emitted: str | None


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, jax.Array):
        return ("array", x.shape, str(x.dtype), x.weak_type, x.sharding)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy arrays, ShapeDtypeStructs
        return ("array", tuple(x.shape), str(x.dtype), False, getattr(x, "sharding", None))
    return ("py", type(x))


class OptimizedStep:
    """A jitted step with the concerto_jax pipeline in front of it.

    Call it like the original step. ``report()`` returns the ``Report`` of the
    most recently built signature (``reports()`` all of them).
    """

    def __init__(self, fn: Callable, options: Options | None = None):
        self._static = capture_lib.jit_info(fn)  # raises TypeError for a non-jitted fn
        functools.update_wrapper(self, fn, updated=())
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"options must be a concerto_jax.Options, got {type(options).__name__}")
        self._fn = fn
        self.options = options or Options()
        self._platform_default = options is None  # no Options given: defaults_for_platform decides
        self._cache: dict[tuple, _Entry] = {}
        self._last_key: tuple | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # -- public -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        key = self._key(args, kwargs)
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry = self._build(args, kwargs)
                    self._cache[key] = entry
        self._last_key = key
        compiled = entry.compiled
        if compiled is None:
            return self._fn(*args, **kwargs)
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        return compiled(*dyn_args, **dyn_kwargs)

    def report(self) -> Report:
        """The report of the signature used by the latest call."""
        if self._last_key is None:
            raise RuntimeError("report() is available after the first call of the optimised step")
        return self._cache[self._last_key].report

    def reports(self) -> list[Report]:
        """Reports of every compiled signature, in build order."""
        return [e.report for e in self._cache.values()]

    def hlo_texts(self) -> tuple[str, str | None]:
        """(captured post-SPMD module, emitted module or None after a fallback) of the latest call."""
        if self._last_key is None:
            raise RuntimeError("hlo_texts() is available after the first call of the optimised step")
        entry = self._cache[self._last_key]
        return entry.captured, entry.emitted

    def lower(self, *args, **kwargs):
        """The original step's ``lower`` (for inspection)."""
        return self._fn.lower(*args, **kwargs)

    # -- internals --------------------------------------------------------------
    def _key(self, args: tuple, kwargs: dict) -> tuple:
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
        return (treedef, tuple(_leaf_signature(x) for x in leaves),
                self._static.static_values(args, kwargs))

    def _fallback(self, reason: str, name: str, n_dev: int, captured: str,
                  stats: dict | None = None) -> _Entry:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"concerto_jax.optimize({name}): running the original step unchanged because "
                f"{reason}", ConcertoFallbackWarning, stacklevel=3)
        log.warning("fallback for %s: %s", name, reason)
        stats = stats or {}
        report = Report(function=name, num_devices=n_dev, optimized=False,
                        fallback_reason=reason,
                        instructions=stats.get("instructions", 0),
                        collectives=stats.get("collectives", {}),
                        stage_seconds=stats.get("stage_seconds", {}))
        return _Entry(None, report, captured, None)

    def _build(self, args: tuple, kwargs: dict):
        name = getattr(self._fn, "__name__", "step")
        # JAX rejecting the arguments is the user's error: it propagates from capture().
        try:
            cap = capture_lib.capture(self._fn, args, kwargs)
        except capture_lib.CaptureError as e:
            cap, capture_error = None, e
        text = cap.hlo_text if cap is not None else ""
        n_dev = cap.num_partitions if cap is not None else len(jax.devices())
        timings = {"capture": cap.seconds} if cap is not None else {}

        options = self.options
        if self._platform_default and cap is not None:
            options = defaults_for_platform(cap.device_list[0].platform)

        def plan() -> dict:
            if cap is None:
                raise capture_error
            return pipeline.run(text, options).to_json()

        compiled, failure = None, None
        try:
            # Process 0 decides; every process gets the same plan (or all fall back).
            result = pipeline.PipelineResult.from_json(multiprocess.leader_decides(text, plan))
            timings.update(result.stage_seconds)
            if self.options.dump_dir:
                _dump(self.options.dump_dir, name, text, result.text)
            t0 = time.perf_counter()
            loaded, _ = executor.compile_replicated(
                result.text, cap.device_list, compiler_options=self.options.compiler_options)
            compiled = executor.swap_executable(cap.compiled, loaded)
            timings["compile"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any internal failure must fall back
            failure = e
        # Every process must run the same program: use ours only if all processes built it.
        if not multiprocess.all_succeeded(failure is None) and failure is None:
            failure = multiprocess.LeaderPlanError("another process failed to build the plan")
        if failure is not None:
            if not self.options.fallback:
                raise failure
            return self._fallback(f"{type(failure).__name__}: {failure}", name, n_dev, text,
                                  {"stage_seconds": timings})
        report = Report(function=name, num_devices=n_dev, optimized=True,
                        instructions=result.instructions, collectives=result.collectives,
                        passes=result.passes, stage_seconds=timings)
        log.info("%s", report)
        return _Entry(compiled, report, text, result.text)


def _dump(directory: str, name: str, captured: str, emitted: str) -> None:
    os.makedirs(directory, exist_ok=True)
    stamp = f"{name}.{int(time.time() * 1000)}"
    with open(os.path.join(directory, f"{stamp}.captured.hlo.txt"), "w") as f:
        f.write(captured)
    with open(os.path.join(directory, f"{stamp}.emitted.hlo.txt"), "w") as f:
        f.write(emitted)


def optimize(fn: Callable | None = None, options: Options | None = None):
    """Optimise a jitted training step; use as ``@optimize`` or ``optimize(step, options)``.

    Args:
      fn: a ``jax.jit``-wrapped function (with in/out shardings on a Mesh, or a
        ``shard_map`` inside).
      options: ``concerto_jax.Options``; defaults are safe (results bitwise equal).

    Returns:
      An ``OptimizedStep``, called exactly like ``fn``.

    Raises:
      TypeError: ``fn`` is not a jitted function, or ``options`` has the wrong type.
    """
    if fn is None:
        return functools.partial(optimize, options=options)
    return OptimizedStep(fn, options)
