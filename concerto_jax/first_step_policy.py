"""The first-step policy of ``optimize``: whether a signature's first call is compared with the
original step and how (bitwise, or within the passes' declared tolerance, with a wider-precision
judge where asked), and what follows a difference (the passes that reassociate sums left out and
the step rebuilt at the next call, or the original step from then on). ``OptimizedStep``
(``api.py``) mixes it in; the comparisons themselves (copies, differences, accuracy) are
``first_step.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax

from concerto_jax import executor, first_step, multiprocess, pipeline, plan_cache
from concerto_jax.options import Options
from concerto_jax.report import Report

log = logging.getLogger(__name__)


class FirstStepMismatch(RuntimeError):
    """The first-step check found a difference and ``Options.fallback`` is False."""



@dataclasses.dataclass
class StepEntry:
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
    # Options.optimize.first_step_reference="wider": builds the step in wider precision (the second
    # judge of a first step past the tolerance); None: no such judge
    wider: Callable[[], Any] | None = None
    # JAX's C++ dispatch of ``runner`` once the signature is settled (``jax_compat.
    # guarded_cpp_call``): None until made, False where the runner has none
    fast: Any = None
    # the original step's own compiled executable where the build made one (the GPU route's
    # stock compile; a CPU-path plan-cache hit's compile of the step, ``Capture.reference``: the
    # step at JAX's defaults plus Options.compiler_options): the first-step check runs it
    # instead of compiling the original again; dropped once the check ran
    reference: Any = None



def widened_names(mapping: dict[str, str]) -> str:
    return ", ".join(f"{a} -> {b}" for a, b in mapping.items())


class FirstStepPolicy:
    """The first-step methods of ``api.OptimizedStep``. They use its ``_fn``, ``_static``,
    ``options``, ``_warned``, ``_left_out``, ``_left_out_note``, ``_run_pipeline``, ``_warn`` and
    ``_warn_once``."""

    def _wider_judge(self, cap, args: tuple, kwargs: dict) -> tuple[Callable[[], Any] | None, str]:
        """The wider-precision judge of a reassociating signature's first step (built lazily:
        only a first step past the tolerance runs it), or None where its second copy of the
        inputs does not fit under "auto"; and the report's words."""
        if self.options.optimize.check_first_step == "auto":
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
        if tolerance == 0 or self.options.optimize.check_first_step is False:
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
        self._warn_once(f"concerto_jax.optimize({name}): {reason}", reason, stacklevel=5)
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
        mode = self.options.optimize.check_first_step
        if mode is False:
            return False, "off (OptimizeOptions.check_first_step=False)"
        if cap.has_effects:
            return False, ("skipped: the step has side effects (host callbacks) that a second "
                           "run would fire twice")
        if mode == "auto" and self.options.compiler_options and tolerance == 0:
            return False, ("skipped (auto): Options.compiler_options change XLA's compile of our "
                           "module only, so the original under JAX's defaults is no bitwise "
                           "reference (OptimizeOptions.check_first_step=True compares with the original compiled "
                           "with the same options)")
        if mode == "auto":
            dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
            fits, why = first_step.fits_in_memory(
                jax.tree.leaves((dyn_args, dyn_kwargs)), cap.output_avals, cap.flat_output_shardings)
            if not fits:
                return False, f"skipped (auto): {why}"
            return True, f"pending (auto: {why})"
        return True, "pending"

    def _second_reference_inputs(self, entry: StepEntry, args: tuple, kwargs: dict):
        """Copies of the inputs for more runs of the original, or None: only for an order-only
        signature (tolerance 0) whose original may not reproduce itself bitwise
        (``first_step.may_vary_between_runs``). A list of one or two copies: the second run's,
        and a third run's where it fits (``first_step.SPREAD_REPEATS``); under "auto" only what fits."""
        if entry.tolerance != 0 or not first_step.may_vary_between_runs(
                entry.captured, first_step.platform_of((args, kwargs))):
            return None
        dyn_args, dyn_kwargs = self._static.dynamic(args, kwargs)
        leaves = jax.tree.leaves((dyn_args, dyn_kwargs))
        copies = []
        for extra in range(first_step.SPREAD_REPEATS):
            if self.options.optimize.check_first_step == "auto":
                # the check's copies and outputs so far and this run's, outputs counted as large
                # as the inputs: 4 for the second run, 6 for the third
                fits, _ = first_step.fits_in_memory(leaves, (), (), copies=4 + 2 * extra)
                if not fits:
                    break
            copies.append(first_step.copy_arrays((args, kwargs)))
        return copies or None

    def _judged_by_spread(self, reference: Any, again: list, got: Any,
                          bad: list[str]) -> tuple[list[str], str]:
        """Runs the original again (on each of ``again``'s copies of the inputs, one at a time);
        where its runs do not reproduce the first, judges ``got`` by their spread
        (``first_step.within_spread``), elsewhere the bitwise verdict ``bad`` stands. A third run
        is made only where the judge on two runs fails: the largest difference of one repeat is
        a noisy bar where few elements vary (an atomic scatter's gradient rows after an
        optimizer's update), so one draw should not decide a fallback. Every process calls it
        (some process found a difference) and all take the same runs and must agree. Returns
        the differences that stand and the report's words (empty where the original
        reproduced itself)."""
        runs, spread_bad, words, more, reproduced = [reference], list(bad), "", False, True
        for i, inputs in enumerate(again):
            # another run only where some process's spread judge failed, and all have its copy
            if i and (multiprocess.all_succeeded(not more)
                      or not multiprocess.all_succeeded(len(again) > i)):
                break
            run = self._fn(*inputs[0], **inputs[1])  # every process runs it (one SPMD program)
            jax.block_until_ready(run)
            runs.append(run)
            reproduced = reproduced and not first_step.differences(reference, run, 0.0, limit=1)
            if got is None or reproduced:
                # reproduced here (or ours did not run): the bitwise verdict stands
                spread_bad, words, more = list(bad), "", False
            else:
                ok, found, words = first_step.within_spread(runs, got)
                spread_bad, more = (found + [f"({words})"] if not ok else []), not ok
        if not multiprocess.all_succeeded(not spread_bad):
            return spread_bad or ["another process found a difference beyond the spread"], ""
        return [], words

    def _judged_wider(self, entry: StepEntry, spare: tuple, reference: Any, got: Any) -> tuple[bool, str]:
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
            return True, (f"as close to the step run in wider precision ({widened_names(mapping)}) as "
                          f"the original's (largest error within {f:g}x the original's, squared "
                          f"errors per leaf within {f * f:g}x plus {first_step.EXTRA_EVENTS} of "
                          f"its worst)")
        found = "; ".join(worse) if worse else "another process found a less accurate output"
        return False, f"less accurate than the original against the step in wider precision: {found}"

    def _failed_run(self, entry: StepEntry, error: Exception, args: tuple, kwargs: dict):
        """An unchecked call whose executable raised at launch: the original from now on, with
        one warning; raised instead where the original cannot run in its place (``fallback``
        off, inputs donated to the failed launch, or several processes, which must agree)."""
        if not self.options.fallback or jax.process_count() > 1:
            raise error
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves((args, kwargs))):
            raise RuntimeError("concerto_jax: the optimised executable failed after its inputs were "
                               "donated, so the original step cannot run in its place; run with "
                               "Options(optimize=OptimizeOptions(check_first_step=True)) to check the first call") from error
        name = getattr(self._fn, "__name__", "step")
        why = (f"the optimised executable failed to run "
               f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]})")
        self._warn(why, name)
        entry.runner = None
        entry.report = dataclasses.replace(entry.report, optimized=False, fallback_reason=why,
                                           executable="original")
        return self._fn(*args, **kwargs)

    def _checked_call(self, entry: StepEntry, args: tuple, kwargs: dict):
        """The first call of a recompiled signature, compared with the original step."""
        name = getattr(self._fn, "__name__", "step")
        copies_args, copies_kwargs = first_step.copy_arrays((args, kwargs))
        # the wider-precision judge's inputs: copied before either step may donate them
        spare = first_step.copy_arrays((args, kwargs)) if entry.wider is not None else None
        # more runs of the original, where it may not reproduce itself (atomic scatters on a
        # GPU): only a first step that differs bitwise runs them
        again = self._second_reference_inputs(entry, args, kwargs)
        original, entry.reference = entry.reference, None
        if original is None and self.options.compiler_options:  # the original compiled as ours was
            original = self._fn.lower(*copies_args, **copies_kwargs).compile(
                compiler_options=dict(self.options.compiler_options))
        if original is not None:
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
        spread_words = ""
        # every process takes these branches together: each runs the original again or none does
        if multiprocess.all_succeeded(again is not None) and not multiprocess.all_succeeded(not bad):
            bad, spread_words = self._judged_by_spread(reference, again, got, bad)
        same = multiprocess.all_succeeded(not bad)
        entry.check_pending = False
        how = "bitwise" if entry.tolerance == 0 else f"within relative tolerance {entry.tolerance:g}"
        if same:
            entry.wider = None
            verdict = (f"ran: outputs equal the original's ({how})" if not spread_words else
                       f"ran: outputs within the original's own run-to-run spread ({spread_words})")
            entry.report = dataclasses.replace(entry.report, first_step_check=verdict + entry.note)
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
            if self.options.optimize.first_step_reference == "original" and failed is None:
                why += (" (Options(optimize=OptimizeOptions(first_step_reference='wider')) keeps them where the outputs "
                        "are as accurate as the original's against the step in wider precision)")
            self._warn_once(f"concerto_jax.optimize({name}): {why}", why, stacklevel=3)
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
