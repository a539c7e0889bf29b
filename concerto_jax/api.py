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
from concerto_jax.options import Options, defaults_for_platform
from concerto_jax.report import Report

log = logging.getLogger(__name__)


class ConcertoFallbackWarning(UserWarning):
    """The optimised module could not be built for a signature; the original step runs."""


class FirstStepMismatch(RuntimeError):
    """The first-step check found a difference and ``Options.fallback`` is False."""


@dataclasses.dataclass
class _Entry:
    """One signature: what runs, its report, HLO texts, and the first-step check state.

    ``runner`` is our compiled executable, or None: JAX's own jitted step runs
    (identity pipeline, or a fallback). ``report`` is None until described: with
    no pass requested the step is not captured until ``report()`` asks for it.
    """

    runner: Any
    report: Report | None
    captured: str | None = None
    emitted: str | None = None
    abstract: tuple | None = None  # (args, kwargs) as ShapeDtypeStructs, for a lazy capture
    tolerance: float = 0.0  # largest tolerance the passes declared
    check_pending: bool = False  # compare the next call with the original step
    # set when the first-step check found a reassociating pass beyond its tolerance: the
    # next call rebuilds the signature with these options (those passes left out)
    rebuild: Options | None = None
    note: str = ""  # words the report's first-step check keeps (why passes were left out)
    built_with: Options | None = None  # the pipeline options this entry was built with
    # Options.first_step_reference="wider": builds the step in wider precision (the second
    # judge of a first step past the tolerance); None: no such judge
    wider: Callable[[], Any] | None = None


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


def _abstract(x: Any) -> Any:
    """A ShapeDtypeStruct standing for an array argument (keeps no buffer alive)."""
    if isinstance(x, jax.Array):  # an uncommitted array stays unplaced (jit places it)
        sharding = x.sharding if getattr(x, "_committed", True) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                    weak_type=getattr(x, "weak_type", False))
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


class OptimizedStep:
    """A jitted step with the concerto_jax pipeline in front of it.

    Call it like the original step. ``report()`` returns the ``Report`` of the
    most recently used signature (``reports()`` all of them).
    """

    def __init__(self, fn: Callable, options: Options | None = None):
        self._static = capture_lib.jit_info(fn)  # raises TypeError for a non-jitted fn
        functools.update_wrapper(self, fn, updated=())
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"options must be a concerto_jax.Options, got {type(options).__name__}")
        self._fn = fn
        self.options = options or Options()
        # No Options given: the backend decides (schedule + pin on GPUs, identity on CPU);
        # resolved at the first build, when the arguments say which devices run the step.
        self._platform_default = options is None
        self._cache: dict[tuple, _Entry] = {}
        self._last_key: tuple | None = None
        self._warned: set[str] = set()
        # passes whose first step differed beyond their declared tolerance: left out of
        # every later build of this step (one warning, one rebuild)
        self._left_out: set[str] = set()
        self._left_out_note = ""
        self._lock = threading.RLock()

    # -- public -----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        try:
            key = self._key(args, kwargs)
        except Exception as e:  # noqa: BLE001 - an argument we cannot key must not crash the step
            self._warn(f"its arguments could not be keyed ({type(e).__name__}: {e})",
                       getattr(self._fn, "__name__", "step"))
            return self._fn(*args, **kwargs)
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry = self._build(args, kwargs)
                    self._cache[key] = entry
        self._last_key = key
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
            return self._fn(*args, **kwargs)
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
        leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
        return (treedef, tuple(_leaf_signature(x) for x in leaves),
                self._static.static_values(args, kwargs))

    def _warn(self, reason: str, name: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"concerto_jax.optimize({name}): running the original step unchanged because "
                f"{reason}", ConcertoFallbackWarning, stacklevel=4)
        log.warning("fallback for %s: %s", name, reason)

    def _fallback(self, reason: str, name: str, n_dev: int, captured: str,
                  stats: dict | None = None) -> _Entry:
        self._warn(reason, name)
        stats = stats or {}
        report = Report(function=name, num_devices=n_dev, optimized=False,
                        fallback_reason=reason,
                        instructions=stats.get("instructions", 0),
                        collectives=stats.get("collectives", {}),
                        passes=stats.get("passes", ()),
                        stage_seconds=stats.get("stage_seconds", {}),
                        executable="original", first_step_check="not run (fell back)")
        return _Entry(None, report, captured, None)

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

    def _described(self, entry: _Entry) -> _Entry:
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
               note: str = "") -> _Entry:
        """Capture, run the pipeline and compile one signature. ``options``: the pipeline's
        (default ``self.options``; a rebuild passes them without the passes whose first
        step differed beyond their tolerance); ``note``: words appended to the report's
        first-step check."""
        name = getattr(self._fn, "__name__", "step")
        if self._platform_default:
            self.options = defaults_for_platform(_platform_of(args, kwargs))
            self._platform_default = False
        if options is None:  # passes that failed their first-step check elsewhere stay out
            options = dataclasses.replace(self.options, passes=tuple(
                p for p in self.options.passes if p not in self._left_out))
            note = note or self._left_out_note
        if not options.passes and not options.always_recompile:
            # Identity by construction: JAX's own executable, nothing captured until report().
            return _Entry(None, None, abstract=jax.tree.map(_abstract, (args, kwargs)))
        try:
            jax_compat.check_supported()  # internals of an unchecked JAX: never guess
        except jax_compat.UnsupportedJaxVersion as e:
            if not self.options.fallback:
                raise
            return self._fallback(str(e), name, len(jax.devices()), "")
        from concerto_jax.gpu_route import route

        backend = route.backend_for(_platform_of(args, kwargs))
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
        changed = failure is None and (options.always_recompile
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
            return _Entry(None, report, text, result.text)
        tolerance = max((p.tolerance for p in result.passes), default=0.0)
        check, why = self._check_decision(cap, args, kwargs, tolerance)
        wider = None
        if check and tolerance > 0 and self.options.first_step_reference == "wider":
            wider, words = self._wider_judge(cap, args, kwargs)
            why += words
        report = dataclasses.replace(report, first_step_check=why + unverified)
        log.info("%s", report)
        return _Entry(compiled, report, text, result.text, tolerance=tolerance,
                      check_pending=check, built_with=options, note=note, wider=wider)

    def _wider_judge(self, cap, args: tuple, kwargs: dict) -> tuple[Callable[[], Any] | None, str]:
        """The wider-precision judge of a reassociating signature's first step (built lazily:
        only a first step past the tolerance runs it), or None where its second copy of the
        inputs does not fit under "auto"; and the report's words."""
        if self.options.check_first_step == "auto":
            dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
            fits, why = first_step.fits_in_memory(
                jax.tree.leaves((dyn_args, dyn_kwargs)), cap.output_avals,
                cap.flat_output_shardings, copies=2)
            if not multiprocess.all_succeeded(fits):
                return None, (f"; no wider-precision judge: "
                              f"{why if not fits else 'another process has no room for it'}")

        def build():
            text, mapping = pipeline.wider_text(cap.hlo_text)
            executor.check_signature(cap.hlo_text, text)
            loaded, _ = executor.compile_replicated(
                text, cap.device_list, compiler_options=self.options.compiler_options,
                host_callbacks=cap.host_callbacks)
            return executor.swap_executable(cap.compiled, loaded), mapping

        return build, ""

    def _without_unverifiable(self, cap, result, timings: dict, args: tuple, kwargs: dict, name: str,
                              options: Options):
        """Passes that reassociate sums declare a tolerance that only the first-step check
        verifies (bf16 region splits can exceed it: docs/DECISIONS.md D6). Where the
        check cannot run (side effects, memory) and the user did not turn it off, the
        pipeline runs again without those passes, with one warning. Returns
        ``(cap, result, failure, timings, words for the report)``."""
        tolerance = max((p.tolerance for p in result.passes), default=0.0)
        if tolerance == 0 or self.options.check_first_step is False:
            return cap, result, None, timings, ""
        check, why = self._check_decision(cap, args, kwargs, tolerance)
        # every process must run the same program: leave them out everywhere or nowhere
        if multiprocess.all_succeeded(check):
            return cap, result, None, timings, ""
        if check:
            why = "another process cannot run it"
        dropped = sorted({p.name for p in result.passes if p.tolerance > 0})
        reason = (f"the passes {dropped} reassociate sums (declared relative tolerance "
                  f"{tolerance:g}) and the first-step check that verifies it cannot run "
                  f"({why}); they are left out")
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"concerto_jax.optimize({name}): {reason}", ConcertoFallbackWarning,
                          stacklevel=5)
        log.warning("%s: %s", name, reason)
        options = dataclasses.replace(options, passes=tuple(p for p in options.passes if p not in dropped))
        cap, result, failure, again = self._run_pipeline(
            args, kwargs, options, cap=cap, cache=plan_cache.open_step(self._fn, args, kwargs, options))
        timings = {**timings, **again}
        return cap, result, failure, timings, f"; {dropped} left out: they need the check"

    def _check_decision(self, cap, args: tuple, kwargs: dict,
                        tolerance: float = 0.0) -> tuple[bool, str]:
        """Whether to compare the first call with the original step, and the report's words.
        ``tolerance``: the passes' declared tolerance; a reassociating module is checked under
        "auto" even with compiler_options (against the original compiled with the same ones)."""
        mode = self.options.check_first_step
        if mode is False:
            return False, "off (Options.check_first_step=False)"
        if cap.has_effects:
            return False, ("skipped: the step has side effects (host callbacks) that a second "
                           "run would fire twice")
        if mode == "auto" and self.options.compiler_options and tolerance == 0:
            return False, ("skipped (auto): Options.compiler_options change XLA's compile of our "
                           "module only, so the original under JAX's defaults is no bitwise "
                           "reference (check_first_step=True compares with the original compiled "
                           "with the same options)")
        if mode == "auto":
            dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
            fits, why = first_step.fits_in_memory(
                jax.tree.leaves((dyn_args, dyn_kwargs)), cap.output_avals, cap.flat_output_shardings)
            if not fits:
                return False, f"skipped (auto): {why}"
            return True, f"pending (auto: {why})"
        return True, "pending"

    def _judged_wider(self, entry: _Entry, spare: tuple, reference: Any, got: Any) -> tuple[bool, str]:
        """Run the step in wider precision on ``spare`` (a copy of the inputs) and judge whether
        ``got`` is as accurate as ``reference`` against it. Returns (kept, the report's words);
        every process runs it and all must agree."""
        build, entry.wider = entry.wider, None
        worse, failure = None, ""
        try:
            runner, mapping = build()
            dyn_args, dyn_kwargs = self._static.dynamic(*spare)
            wider = runner(*dyn_args, **dyn_kwargs)
            worse = first_step.less_accurate(reference, got, wider, entry.tolerance)
        except Exception as e:  # noqa: BLE001 - no judge (memory, XLA): the plain verdict stands
            log.warning("the step could not run in wider precision: %s: %s", type(e).__name__, e)
            failure = f"{type(e).__name__}: {e}"
        if not multiprocess.all_succeeded(worse is not None):
            return False, ("the step could not run in wider precision ("
                           f"{failure or 'on another process'})")
        if multiprocess.all_succeeded(not worse):
            f = first_step.ACCURACY_FACTOR
            return True, (f"as close to the step run in wider precision ({_widened(mapping)}) as "
                          f"the original's (largest error within {f:g}x the original's, squared "
                          f"errors per leaf within {f * f:g}x plus {first_step.EXTRA_EVENTS} of "
                          f"its worst)")
        found = "; ".join(worse) if worse else "another process found a less accurate output"
        return False, f"less accurate than the original against the step in wider precision: {found}"

    def _failed_run(self, entry: _Entry, error: Exception, args: tuple, kwargs: dict):
        """An unchecked call whose executable raised at launch: the original from now on, with
        one warning; raised instead where the original cannot run in its place (``fallback``
        off, inputs donated to the failed launch, or several processes, which must agree)."""
        if not self.options.fallback or jax.process_count() > 1:
            raise error
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves((args, kwargs))):
            raise RuntimeError("concerto_jax: the optimised executable failed after its inputs were "
                               "donated, so the original step cannot run in its place; run with "
                               "Options(check_first_step=True) to check the first call") from error
        name = getattr(self._fn, "__name__", "step")
        why = (f"the optimised executable failed to run "
               f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]})")
        self._warn(why, name)
        entry.runner = None
        entry.report = dataclasses.replace(entry.report, optimized=False, fallback_reason=why,
                                           executable="original")
        return self._fn(*args, **kwargs)

    def _checked_call(self, entry: _Entry, args: tuple, kwargs: dict):
        """The first call of a recompiled signature, compared with the original step."""
        name = getattr(self._fn, "__name__", "step")
        copies_args, copies_kwargs = first_step.copy_arrays((args, kwargs))
        # the wider-precision judge's inputs: copied before either step may donate them
        spare = first_step.copy_arrays((args, kwargs)) if entry.wider is not None else None
        if self.options.compiler_options:  # the original compiled as ours was
            original = self._fn.lower(*copies_args, **copies_kwargs).compile(
                compiler_options=dict(self.options.compiler_options))
            ref_args, ref_kwargs = self._static.dynamic(copies_args, copies_kwargs)
            reference = original(*ref_args, **ref_kwargs)  # may donate the copies
        else:
            reference = self._fn(*copies_args, **copies_kwargs)  # may donate the copies
        jax.block_until_ready(reference)  # the original's own errors are the user's: raised here
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        failed = None
        try:
            got = entry.runner(*dyn_args, **dyn_kwargs)
            jax.block_until_ready(got)
        except Exception as e:  # noqa: BLE001 - our executable did not run: the original's outputs stand
            if not self.options.fallback:
                raise
            failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            got = None
        bad = ([f"the optimised step failed to run ({failed})"] if failed is not None
               else first_step.differences(reference, got, entry.tolerance))
        same = multiprocess.all_succeeded(not bad)
        entry.check_pending = False
        how = "bitwise" if entry.tolerance == 0 else f"within relative tolerance {entry.tolerance:g}"
        if same:
            entry.wider = None
            entry.report = dataclasses.replace(
                entry.report, first_step_check=f"ran: outputs equal the original's ({how})" + entry.note)
            return got
        found = "; ".join(bad) if bad else "another process found a difference"
        if spare is not None and failed is None:
            accurate, words = self._judged_wider(entry, spare, reference, got)
            if accurate:
                entry.report = dataclasses.replace(entry.report, first_step_check=(
                    f"ran: outputs differ from the original's beyond relative tolerance "
                    f"{entry.tolerance:g} ({found}) and are {words}") + entry.note)
                log.info("%s: first step kept: %s", name, entry.report.first_step_check)
                return got
            found += f"; {words}"
        beyond = "bitwise" if entry.tolerance == 0 else f"beyond relative tolerance {entry.tolerance:g}"
        reason = (f"the first optimised step failed to run ({failed})" if failed is not None else
                  f"the first optimised step differs from the original ({beyond}): {found}")
        differed = "FAILED TO RUN" if failed is not None else "DIFFERED"
        if not self.options.fallback:
            raise FirstStepMismatch(reason)
        entry.runner = None
        base = entry.built_with or self.options
        dropped = sorted({p.name for p in entry.report.passes if p.tolerance > 0})
        rest = tuple(p for p in base.passes if p not in dropped)
        if dropped and rest:
            # the passes that reassociate sums went past their declared tolerance: this call
            # returns the original's outputs, the next one runs the rest (checked bitwise)
            why = (f"{reason}; the passes {dropped} that reassociate sums are left out and the "
                   f"step is rebuilt with {list(rest)} at the next call")
            if self.options.first_step_reference == "original" and failed is None:
                why += (" (Options(first_step_reference='wider') keeps them where the outputs "
                        "are as accurate as the original's against the step in wider precision)")
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(f"concerto_jax.optimize({name}): {why}", ConcertoFallbackWarning, stacklevel=3)
            log.warning("%s: %s", name, why)
            entry.rebuild = dataclasses.replace(base, passes=rest)
            entry.note = self._left_out_note = (
                f"; {dropped} left out: the first step with them "
                + (f"failed to run ({failed})" if failed is not None else
                   f"differed beyond their tolerance ({found})"))
            self._left_out.update(dropped)
            entry.report = dataclasses.replace(
                entry.report, optimized=False, fallback_reason=reason, executable="original",
                first_step_check=f"ran: {differed} ({found}); this call fell back, the next rebuilds "
                                 f"without {dropped}")
            return reference
        self._warn(reason, name)
        entry.report = dataclasses.replace(
            entry.report, optimized=False, fallback_reason=reason, executable="original",
            first_step_check=f"ran: {differed} ({found}); fell back")
        return reference


def _widened(mapping: dict[str, str]) -> str:
    return ", ".join(f"{a} -> {b}" for a, b in mapping.items())


def _platform_of(args: tuple, kwargs: dict) -> str:
    """The platform of the devices holding the step's first array argument (JAX's default else)."""
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return jax.default_backend()


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
        from hlo_passes.emit import emit_scheduled

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
