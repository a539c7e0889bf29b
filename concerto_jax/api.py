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
import numpy as np

from concerto_jax import capture as capture_lib
from concerto_jax import executor, first_step, jax_compat, multiprocess, pipeline, plan_cache
from concerto_jax.first_step_policy import FirstStepPolicy, StepEntry
from concerto_jax.gpu_route import route
from concerto_jax.options import Options, defaults_for_platform
from concerto_jax.report import Report
from hlo_passes.emit import emit_scheduled

log = logging.getLogger(__name__)


class ConcertoFallbackWarning(UserWarning):
    """The optimised module could not be built for a signature; the original step runs."""


def _leaf_signature(x: Any) -> tuple:
    # every call keys its arguments, so this stays cheap: the array's aval (shape, dtype, weak
    # type) as an object, not names (``str(dtype)`` alone cost ~5 us a leaf: on a GPU, the
    # wrapper's keying made a 0.8 ms step 1.5x slower)
    if isinstance(x, jax.Array):  # typed PRNG key arrays included
        # equivalent shardings key alike: a step's outputs often carry P() where its inputs had
        # P(None, None, None), and a second key meant a second build of the whole step
        return ("array", x.aval, jax_compat.sharding_identity(x.sharding, x.ndim))
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy arrays, ShapeDtypeStructs
        return ("array", tuple(x.shape), x.dtype, False, getattr(x, "sharding", None))
    return ("py", type(x))


def _dynamic_key(dyn_args: tuple, dyn_kwargs: dict) -> tuple:
    """The key of a call's dynamic arguments: tree structure and each leaf's signature."""
    leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
    return (treedef, tuple(_leaf_signature(x) for x in leaves))


KEY_EVERY = 64
"""Where the latest signature runs the original step (no pass changed it, or a fallback),
``optimize`` keys one call in this many, and every call whose signature jit had not compiled
before (our key costs ~1 us a leaf on the CPU here, measured at a sixth of a 0.7 ms GPU step);
the others go straight to JAX's own dispatch, which is right for any arguments."""


class _OtherSignature(Exception):
    """Raised by the C++ dispatch's guard: this call's arguments key another entry."""


def _abstract(x: Any) -> Any:
    """A ShapeDtypeStruct standing for an array argument (keeps no buffer alive)."""
    if isinstance(x, jax.Array):  # an uncommitted array stays unplaced (jit places it)
        sharding = x.sharding if getattr(x, "_committed", True) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                    weak_type=getattr(x, "weak_type", False))
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


class OptimizedStep(FirstStepPolicy):
    """A jitted step with the concerto_jax pipeline in front of it.

    Call it like the original step. ``report()`` returns the ``Report`` of the
    most recently used signature (``reports()`` all of them).
    """

    def __init__(self, fn: Callable, options: Options | None = None):
        self._static = capture_lib.jit_info(fn)  # raises TypeError for a non-jitted fn
        self._no_static = not (self._static.static_argnums or self._static.static_argnames)
        self._jit_cache_size = getattr(fn, "_cache_size", None)  # jax.jit's C++ cache (entries)
        functools.update_wrapper(self, fn, updated=())
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"options must be a concerto_jax.Options, got {type(options).__name__}")
        self._fn = fn
        self.options = options or Options()
        # No Options given: the backend decides (GPU_DEFAULT_PASSES on GPUs, identity on CPU);
        # resolved at the first build, when the arguments say which devices run the step.
        self._platform_default = options is None
        self._cache: dict[tuple, StepEntry] = {}
        self._last_key: tuple | None = None
        # the latest settled signature: (entry, static values, its C++ call (``_settled``), or
        # None where the original step runs it); calls since our last key of such a signature
        self._fast: tuple | None = None
        self._unkeyed = 0
        self._warned: set[str] = set()
        # passes whose first step differed beyond their declared tolerance: left out of
        # every later build of this step (one warning, one rebuild)
        self._left_out: set[str] = set()
        self._left_out_note = ""
        self._lock = threading.RLock()

    # -- public -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        fast = self._fast  # the settled signature of the latest call: JAX's C++ dispatch
        if fast is not None and fast[2] is None:
            # that signature runs the original step: JAX's own jit dispatches the call unkeyed
            # where jit had compiled its signature already (its cache did not grow); a signature
            # new to jit (it ran the original too) is keyed at its next call, and every
            # KEY_EVERY-th call is keyed regardless
            entry = fast[0]
            size = self._jit_cache_size
            if size is not None and entry.runner is None and entry.rebuild is None and \
                    self._unkeyed < KEY_EVERY:
                before = size()
                out = self._fn(*args, **kwargs)
                if size() == before:
                    self._unkeyed += 1
                else:
                    self._fast = None
                    if not self.options.passes and not self.options.optimize.always_recompile:
                        self._keyed_after_the_call(args, kwargs)
                return out
            self._fast, self._unkeyed = None, 0
        elif fast is not None and fast[0].runner is not None:
            entry, static, call = fast
            if self._no_static or self._static.static_values(args, kwargs) == static:
                dyn_args, dyn_kwargs = (args, kwargs) if self._no_static else \
                    self._static.dynamic(args, kwargs)
                try:
                    return call(*dyn_args, **dyn_kwargs)
                except _OtherSignature:
                    pass  # keyed below: another entry, or a new build
                except Exception as e:  # noqa: BLE001 - our executable refused to run
                    return self._failed_run(entry, e, args, kwargs)
        try:
            key = self._key(args, kwargs)
        except Exception as e:  # noqa: BLE001 - an argument we cannot key must not crash the step
            self._warn(f"its arguments could not be keyed ({type(e).__name__}: {e})",
                       getattr(self._fn, "__name__", "step"))
            return self._fn(*args, **kwargs)
        entry = self._entry(key, args, kwargs)
        if entry.rebuild is not None:  # the first step differed: rebuild without the passes
            with self._lock:
                entry = self._cache[key]
                if entry.rebuild is not None:
                    entry = self._cache[key] = self._build(args, kwargs, entry.rebuild, entry.note)
        if entry.check_pending:
            with self._lock:
                if entry.check_pending:
                    return self._checked_call(entry, args, kwargs)
        runner = entry.runner
        if runner is None:
            self._fast = (entry, key[2], None)
            return self._fn(*args, **kwargs)
        self._fast = self._settled(entry, key)
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        try:
            return runner(*dyn_args, **dyn_kwargs)
        except Exception as e:  # noqa: BLE001 - our executable refused to run (unchecked call)
            return self._failed_run(entry, e, args, kwargs)

    def report(self) -> Report:
        """The report of the signature used by the latest call.

        With the identity pipeline (no pass requested) the step runs JAX's own
        executable and is captured only now, on the first ``report()`` or
        ``hlo_texts()`` of a signature (one extra lowering and compile).
        """
        if self._last_key is None:
            raise RuntimeError("report() is available after the first call of the optimised step")
        return self._described(self._cache[self._last_key]).report

    def reports(self) -> list[Report]:
        """Reports of every compiled signature, in build order."""
        return [self._described(e).report for e in list(self._cache.values())]

    def hlo_texts(self) -> tuple[str, str | None]:
        """(captured post-SPMD module, emitted module or None) of the latest call's signature."""
        if self._last_key is None:
            raise RuntimeError("hlo_texts() is available after the first call of the optimised step")
        entry = self._described(self._cache[self._last_key])
        return entry.captured or "", entry.emitted

    def lower(self, *args, **kwargs):
        """The original step's ``lower`` (for inspection)."""
        return self._fn.lower(*args, **kwargs)

    # -- internals --------------------------------------------------------------
    def _key(self, args: tuple, kwargs: dict) -> tuple:
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        return (*_dynamic_key(dyn_args, dyn_kwargs), self._static.static_values(args, kwargs))

    def _keyed_after_the_call(self, args: tuple, kwargs: dict) -> None:
        """Keys a call that the original step ran unkeyed, under the identity pipeline (whose
        entries need only the arguments' shapes, dtypes and shardings, which donated arrays
        keep): ``report()`` and ``reports()`` then know its signature at once."""
        try:
            key = self._key(args, kwargs)
        except Exception:  # noqa: BLE001 - keyed at the next call instead
            return
        self._entry(key, args, kwargs)

    def _entry(self, key: tuple, args: tuple, kwargs: dict) -> StepEntry:
        """The signature's entry, built on its first call; it becomes the latest signature."""
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry = self._cache[key] = self._build(args, kwargs)
        self._last_key = key
        return entry

    def _settled(self, entry: StepEntry, key: tuple) -> tuple | None:
        """``(entry, static values, C++ call)`` for the fast path of ``__call__``, or None.

        JAX's C++ dispatch runs the entry's executable for every call whose signature it has
        seen; a call it has not seen reaches ``guard``, which lets it through only where our
        key is this entry's (a signature JAX would also accept but we key apart, a weak type
        say, goes the keyed way and gets its own entry)."""
        if entry.fast is None:
            want = key[:2]

            def guard(*dyn_args, **dyn_kwargs):
                if _dynamic_key(dyn_args, dyn_kwargs) != want:
                    raise _OtherSignature
            entry.fast = jax_compat.guarded_cpp_call(entry.runner, guard) or False
        return (entry, key[2], entry.fast) if entry.fast else None

    def _warn(self, reason: str, name: str) -> None:
        self._warn_once(f"concerto_jax.optimize({name}): running the original step unchanged because "
                        f"{reason}", reason, stacklevel=4)
        log.warning("fallback for %s: %s", name, reason)

    def _warn_once(self, message: str, key: str, stacklevel: int) -> None:
        """``message`` as one ``ConcertoFallbackWarning`` per ``key`` for this step."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ConcertoFallbackWarning, stacklevel=stacklevel + 1)

    def _fallback(self, reason: str, name: str, n_dev: int, captured: str,
                  stats: dict | None = None) -> StepEntry:
        self._warn(reason, name)
        stats = stats or {}
        report = Report(function=name, num_devices=n_dev, optimized=False,
                        fallback_reason=reason,
                        instructions=stats.get("instructions", 0),
                        collectives=stats.get("collectives", {}),
                        passes=stats.get("passes", ()),
                        stage_seconds=stats.get("stage_seconds", {}),
                        executable="original", first_step_check="not run (fell back)")
        return StepEntry(None, report, captured, None)

    def _run_pipeline(self, args: tuple, kwargs: dict, options: Options | None = None, cap=None,
                      cache: plan_cache.StepCache | None = None):
        """Capture + (leader-decided) pipeline: (capture or None, result or None, failure, timings).
        ``options``: the pipeline's options (default ``self.options``); ``cap``: a capture of
        these arguments already made (not made again); ``cache``: the signature's plan cache
        (``plan_cache.open_step``), or None."""
        options = self.options if options is None else options
        if cap is None and cache is not None:
            cap = cache.capture()  # a hit: the stored module, the step compiled without dumps
        # JAX rejecting the arguments is the user's error: it propagates from capture().
        if cap is None:
            try:
                cap = capture_lib.capture(self._fn, args, kwargs)
            except capture_lib.CaptureError as e:
                cap, capture_error = None, e
        text = cap.hlo_text if cap is not None else ""
        timings = {"capture": cap.seconds} if cap is not None else {}

        def plan() -> dict:
            if cap is None:
                raise capture_error
            return pipeline.run(text, options).to_json()

        try:
            # Process 0 decides (reading and writing the plan cache); every process gets the
            # same plan (or all fall back).
            decided = plan_cache.decide(cache, cap, plan)
            result = pipeline.PipelineResult.from_json(decided)
        except Exception as e:  # noqa: BLE001 - any internal failure must fall back
            return cap, None, e, timings
        timings.update(result.stage_seconds)
        return cap, result, None, timings

    def _described(self, entry: StepEntry) -> StepEntry:
        """Fill in the report of an identity signature (capture on abstract arguments)."""
        if entry.report is not None:
            return entry
        with self._lock:
            if entry.report is not None:
                return entry
            name = getattr(self._fn, "__name__", "step")
            args, kwargs = entry.abstract
            cap, result, failure, timings = self._run_pipeline(args, kwargs)
            n_dev = cap.num_partitions if cap is not None else len(jax.devices())
            text = cap.hlo_text if cap is not None else ""
            if failure is not None:
                fb = self._fallback(f"the program could not be described ({type(failure).__name__}: "
                                    f"{failure})", name, n_dev, text, {"stage_seconds": timings})
                entry.report, entry.captured = fb.report, fb.captured
            else:
                entry.report = Report(
                    function=name, num_devices=n_dev, optimized=True,
                    instructions=result.instructions, collectives=result.collectives,
                    passes=result.passes, stage_seconds=timings, executable="original",
                    first_step_check="not needed (JAX's own executable runs)")
                entry.captured, entry.emitted = text, result.text
            entry.abstract = None
            return entry

    def _build(self, args: tuple, kwargs: dict, options: Options | None = None,
               note: str = "") -> StepEntry:
        """Capture, run the pipeline and compile one signature. ``options``: the pipeline's
        (default ``self.options``; a rebuild passes them without the passes whose first
        step differed beyond their tolerance); ``note``: words appended to the report's
        first-step check."""
        name = getattr(self._fn, "__name__", "step")
        if self._platform_default:
            self.options = defaults_for_platform(first_step.platform_of((args, kwargs)))
            self._platform_default = False
        if options is None:  # passes that failed their first-step check elsewhere stay out
            options = dataclasses.replace(self.options, passes=tuple(
                p for p in self.options.passes if p not in self._left_out))
            note = note or self._left_out_note
        if not options.passes and not options.optimize.always_recompile:
            # Identity by construction: JAX's own executable, nothing captured until report().
            return StepEntry(None, None, abstract=jax.tree.map(_abstract, (args, kwargs)))
        try:
            jax_compat.check_supported()  # internals of an unchecked JAX: never guess
        except jax_compat.UnsupportedJaxVersion as e:
            if not self.options.fallback:
                raise
            return self._fallback(str(e), name, len(jax.devices()), "")
        backend = route.backend_for(first_step.platform_of((args, kwargs)))
        if backend is not None:  # GPUs: our order compiled by XLA's backend only, loaded into JAX
            return route.build_entry(self, args, kwargs, options, note, backend)
        cache = plan_cache.open_step(self._fn, args, kwargs, options)
        cap, result, failure, timings = self._run_pipeline(args, kwargs, options, cache=cache)
        unverified = ""
        if failure is None:
            cap, result, failure, timings, unverified = self._without_unverifiable(
                cap, result, timings, args, kwargs, name, options)
        unverified += note
        text = cap.hlo_text if cap is not None else ""
        n_dev = cap.num_partitions if cap is not None else len(jax.devices())
        changed = failure is None and (options.optimize.always_recompile
                                       or any(p.changed for p in result.passes))
        compiled = None
        if changed:
            try:
                if self.options.dump_dir:
                    _dump(self.options.dump_dir, name, text, result.text)
                t0 = time.perf_counter()
                callbacks = cap.host_callbacks
                executor.check_signature(text, result.text)
                copts = self.options.compiler_options
                compiled = cache.load(cap, result.text, copts) if cache is not None else None
                if compiled is None:
                    loaded, _ = executor.compile_replicated(
                        result.text, cap.device_list, compiler_options=copts,
                        host_callbacks=callbacks)
                    compiled = executor.swap_executable(cap.compiled, loaded)
                    if cache is not None:
                        cache.save(cap, result.text, copts, loaded)
                timings["compile"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - any internal failure must fall back
                failure = e
        # Every process must run the same program: use ours only if all processes built it.
        if not multiprocess.all_succeeded(failure is None) and failure is None:
            failure = multiprocess.LeaderPlanError("another process failed to build the plan")
        if failure is not None:
            if not self.options.fallback:
                raise failure
            stats = {"stage_seconds": timings}
            if result is not None:
                stats.update(instructions=result.instructions, collectives=result.collectives,
                             passes=result.passes)
            return self._fallback(f"{type(failure).__name__}: {failure}", name, n_dev, text, stats)
        report = Report(function=name, num_devices=n_dev, optimized=True,
                        instructions=result.instructions, collectives=result.collectives,
                        passes=result.passes, stage_seconds=timings,
                        executable="recompiled" if changed else "original")
        if not changed:
            # Every pass left the module as it was: JAX's own executable is the identity.
            report = dataclasses.replace(
                report, first_step_check="not needed (no pass changed the module: JAX's own "
                                         "executable runs)" + unverified)
            log.info("%s", report)
            return StepEntry(None, report, text, result.text)
        tolerance = max((p.tolerance for p in result.passes), default=0.0)
        check, why = self._check_decision(cap, args, kwargs, tolerance)
        wider = None
        if check and tolerance > 0 and self.options.optimize.first_step_reference == "wider":
            wider, words = self._wider_judge(cap, args, kwargs)
            why += words
        report = dataclasses.replace(report, first_step_check=why + unverified)
        log.info("%s", report)
        # a plan-cache hit compiled the step as the original compiles (Capture.reference): the
        # first-step check runs that compile instead of compiling the original again
        return StepEntry(compiled, report, text, result.text, tolerance=tolerance,
                      check_pending=check, built_with=options, note=note, wider=wider,
                      reference=cap.compiled if check and cap.reference else None)


def _dump(directory: str, name: str, captured: str, emitted: str) -> None:
    """Write the captured module, the emitted one and its scheduled form (async start/done pairs).

    The scheduled form (``hlo_passes.emit.emit_scheduled``: ``is_scheduled=true``, each
    computation's order is its schedule, every collective a start/done pair at its planned
    position) is what a GPU compiler is handed; XLA:CPU runs the emitted module, which has
    no async collectives. A scheduled form that cannot be made is logged, not raised: the
    dump is a diagnostic and must not fail the step.
    """
    os.makedirs(directory, exist_ok=True)
    stamp = f"{name}.{int(time.time() * 1000)}"
    with open(os.path.join(directory, f"{stamp}.captured.hlo.txt"), "w") as f:
        f.write(captured)
    with open(os.path.join(directory, f"{stamp}.emitted.hlo.txt"), "w") as f:
        f.write(emitted)
    try:
        scheduled = emit_scheduled(emitted)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        log.warning("dump_dir: no scheduled form of %s: %s", name, e)
        return
    with open(os.path.join(directory, f"{stamp}.scheduled.hlo.txt"), "w") as f:
        f.write(scheduled)


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
