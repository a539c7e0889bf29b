"""``compile_for_target``: run the optimize pipeline on a step and compile the result for a target GPU, deviceless.

Two ways to make XLA's GPU compiler run our order (``via``):

``"backend_only"`` (default; issue #9)::

    jitted step + abstract args on a target_mesh
      | stock compile       lower + compile for the target, dumps at spmd-partitioning and
      |                     before the post-scheduling pipelines: the post-SPMD module, XLA's
      |                     scheduled module of the original step (after LHS where LHS runs,
      |                     the memory scheduler's order elsewhere), its final module
      | rewriting passes    the passes of Options.passes other than "schedule"/"pin" (e.g.
      |                     decompose, fuse_collectives) on the post-SPMD module (decompose
      |                     judges with fusion-aware costs: XLA's scheduled module of the
      |                     original step is its DecomposeOptions.fused_reference); when one
      |                     changed it, XLA's pipeline runs on OUR module up to its scheduler
      |                     (replicated compile with the same dump) and that scheduled module
      |                     is used instead
      | schedule            our scheduler orders every computation of XLA's scheduled module
      |                     (deviceless.reschedule.reschedule_text: no opt-barrier, XLA fused and
      |                     combined as usual); memory limit: ScheduleOptions' (default: the
      |                     starting order's peak)
      | backend-only compile the PJRT C API (deviceless.pjrt_c) with run_backend_only: XLA keeps
      |                     the schedule and runs its backend; final_text is its module
      | simulate            one cost model for planned (the module we handed XLA, in its
      |                     order), final and stock
      v
    TargetResult

``"pin"`` (issue #9, first lever): the whole pipeline on the post-SPMD module, the ``pin``
pass ties each collective's window with two ``opt-barrier``s, XLA compiles the replicated
module with its full pipeline (barriers block fusion across them and the combiner).
Any failure of either path falls back to the stock program with one
``TargetFallbackWarning``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Sequence

from concerto_jax import jax_compat, plan_cache
from concerto_jax.autoccl.knobs import gpu_combine_threshold_options
from concerto_jax.deviceless.compile import (
    SCHEDULED_MARKER,
    SCHEDULED_PASS,
    CompileOptions,
    _read_dump,
    compile_lowered,
    lower_for_target,
    require_gpu_plugin,
)
from concerto_jax.deviceless.thresholds import COMBINED_KINDS, CombineProxy
from concerto_jax.judge.envelope import Envelope

log = logging.getLogger(__name__)


class TargetFallbackWarning(UserWarning):
    """The optimised program could not be compiled for the target; the stock program is reported."""


@dataclasses.dataclass(frozen=True)
class TargetResult:
    """What ``compile_for_target`` produced and measured (times: our simulator, microseconds).

    Attributes:
      target: the cluster name.
      final_text: XLA's final scheduled module of the optimised program (what the GPUs
        run); equals ``stock_final_text`` after a fallback.
      stock_final_text: XLA's final module of the original step, same target, stock options.
      emitted_text: the module we handed to XLA (backend-only: XLA's scheduled module in our
        order; pin: replicated, pins included).
      scheduled_text: the same program as a scheduled module with explicit async
        start/done pairs at the planned positions (``hlo_passes.emit``), or None.
      planned_step_us: backend-only path: the scheduled module we handed XLA, in its order.
        Pin path: the plan on the graph XLA runs: XLA's final module of our program,
        with every async collective started as soon as its operands allow and waited for
        right before its first reader (the window the pins ask for).
      final_step_us: XLA's final module of our program in XLA's order.
      stock_step_us: XLA's final module of the original step in XLA's order.
      planned_overlap_us: communication time hidden behind compute in the plan (per
        collective, the part of its transfer that overlaps a running kernel, summed).
      final_overlap_us: the same per-collective overlap in XLA's order, each collective
        counted at most up to its planned overlap.
      overlap_kept: ``final_overlap_us / planned_overlap_us`` (1.0 when nothing was planned
        to overlap): the share of the planned overlapped communication time that XLA's
        final module keeps overlapped.
      pins: collectives whose window got opt-barriers (0 on the backend-only path).
      passes: the pass records of the pipeline (name, changed, seconds, stats).
      fallback_reason: why the stock program is reported instead of ours (None when ours is):
        ours could not be compiled, or XLA's final module of it simulates slower than stock's.
      seconds: wall time per stage.
      via: how the plan reached XLA: ``"backend_only"``, ``"pin"``, or ``"stock"`` after a fallback.
      input_peak_bytes: peak live bytes of XLA's order of the entry under the scheduler's memory
        model (backend-only path; None otherwise).
      peak_bytes: the same for our order (never above ``memory_limit_bytes``).
      memory_limit_bytes: the limit the scheduler applied to the entry (None: none).
      robust: the decisions judged over the plausible cost models (``Options.robust``;
        ``costmodel.envelope.RobustVerdict``: nominal and worst-case gain, per-model figures),
        in the order they were taken: the rewrite guard's, the combine-threshold search's,
        the final-module guard's (ours vs stock). Empty when ``Options.robust`` is ().
      cut: what ``Options.time_budget_s`` left out, one line each (empty: nothing).
    """

    target: str
    final_text: str
    stock_final_text: str
    emitted_text: str | None
    scheduled_text: str | None
    planned_step_us: float
    final_step_us: float
    stock_step_us: float
    planned_overlap_us: float
    final_overlap_us: float
    overlap_kept: float
    pins: int
    passes: tuple
    fallback_reason: str | None
    seconds: dict
    via: str = "pin"
    input_peak_bytes: int | None = None
    peak_bytes: int | None = None
    memory_limit_bytes: int | None = None
    robust: tuple = ()
    cut: tuple = ()


AUTO_BUDGET_FACTOR = 5.0
"""``Options.time_budget_s="auto"``: the budget is this many times stock XLA's compile of the step
(the compile-time goal: a first compile within 3x stock's, none above 5x)."""
AUTO_BUDGET_MIN_S = 60.0
"""... and never below this (a small step's compile is seconds; its search is too)."""


@dataclasses.dataclass
class TimeBudget:
    """What is left of ``Options.time_budget_s`` in one ``compile_for_target`` call, and what the
    budget cut (``TargetResult.cut``)."""

    deadline: float | None = None  # time.perf_counter(); None: no bound
    compile_s: float = 0.0  # stock XLA's compile of the step: what one more compile may take
    cut: list = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, options, t0: float, stock_compile_s: float) -> TimeBudget:
        """The budget of a call that began at ``t0`` (``time.perf_counter()``)."""
        b = getattr(options, "time_budget_s", None)
        if b is None:
            return cls(compile_s=stock_compile_s)
        if b == "auto":
            b = max(AUTO_BUDGET_MIN_S, AUTO_BUDGET_FACTOR * stock_compile_s)
        return cls(t0 + float(b), stock_compile_s)

    def left(self) -> float:
        """Seconds left (inf without a bound)."""
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def allows(self, seconds: float, what: str) -> bool:
        """Whether a step expected to take ``seconds`` fits; if not, ``what`` is recorded as cut."""
        if self.left() >= seconds:
            return True
        self.cut.append(what)
        log.info("compile_for_target: time budget: %s (%.0f s left, about %.0f s needed)", what,
                 max(self.left(), 0.0), seconds)
        return False


def _pipeline_options(options):
    """``options`` with ``pin`` run after ``schedule`` (the plan must reach XLA)."""
    passes = tuple(options.passes)
    if "schedule" in passes and "pin" not in passes:
        passes = passes + ("pin",)
    return dataclasses.replace(options, passes=passes)


def _with_fused_reference(options, reference: str | None, budget: int | None = None):
    """``options`` whose decompose pass costs the post-SPMD module by XLA's fusion of the same
    step (``DecomposeOptions.fused_reference`` = ``reference``, XLA's scheduled module of the
    stock compile) and plans loop rotations within the program's memory budget
    (``DecomposeOptions.memory_budget_bytes`` = ``budget``, ``_memory_budget``); unchanged
    when decompose does not run or there is no reference."""
    if reference is None or "decompose" not in options.passes:
        return options
    return dataclasses.replace(options, decompose=dataclasses.replace(
        options.decompose, fused_reference=reference, memory_budget_bytes=budget))


def _copy_to_reshape(text: str) -> str:
    """Identity ``reshape`` in place of layout-preserving ``copy`` (the deviceless compile path
    refuses to legalise ``mhlo.copy``; docs/ARCHITECTURE.md F3)."""
    from hlo_passes.ir import Instruction, module_to_text, parse_module

    module = parse_module(text, source="emitted")
    n = 0
    for comp in module.computations:
        for inst in [i for i in comp.instructions if i.opcode == "copy"]:
            (src,) = inst.operands
            if not inst.shape.is_array or src.shape != inst.shape:
                continue
            new = Instruction(module.unique_name("copy_reshape"), "reshape", inst.shape, [src],
                              {k: v for k, v in inst.attrs.items() if k in ("metadata",)})
            comp.replace_instruction(inst, new)
            n += 1
    return module_to_text(module) if n else text


def compile_replicated_for_target(hlo_text: str, devices: Sequence, compiler_options: dict | None = None,
                                  *, after_lhs: bool = False):
    """Compile a replicated per-device module for the deviceless target of ``devices``.

    Returns:
      ``(final module text, before-LHS text or None, compile seconds)``; with ``after_lhs``
      a fourth item, the scheduled module XLA's post-scheduling pipelines received (after
      LHS where it ran; None when XLA wrote none).
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    from concerto_jax.executor import parse_with_xla, replicated_compile_options

    devices = tuple(devices)
    module = parse_with_xla(_copy_to_reshape(hlo_text))
    mlir = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
    opts = replicated_compile_options(devices)
    with tempfile.TemporaryDirectory(prefix="concerto_target_") as d:
        env = dict(compiler_options or {})
        env.update({"xla_dump_to": d, "xla_dump_hlo_pass_re": f"latency-hiding-scheduler|{SCHEDULED_PASS}"})
        opts.env_option_overrides = list(env.items())
        t0 = time.perf_counter()
        with jax_mlir.make_ir_context() as ctx:
            mod = ir.Module.parse(mlir, context=ctx)
            exe = devices[0].client.compile(mod, executable_devices=xc.DeviceList(devices),
                                            compile_options=opts)
        dt = time.perf_counter() - t0
        before = _read_dump(d, "before_latency-hiding-scheduler")
        after = _read_dump(d, SCHEDULED_MARKER) or _read_dump(d, "after_latency-hiding-scheduler")
    final = exe.hlo_modules()[0].to_string()
    return (final, before, dt, after) if after_lhs else (final, before, dt)


def _devices_of(compiled) -> tuple:
    """Devices in partition order (partition ``i`` runs on the ``i``-th)."""
    try:
        return tuple(compiled._executable._unloaded_executable.device_list)
    except AttributeError:  # another JAX layout: the shardings' device assignment
        import jax

        leaves = [s for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "_device_assignment")]
        return tuple(leaves[0]._device_assignment)


def compile_for_target(step, *abstract_args, target: str = "h100_sxm_8", options=None,
                       via: str = "backend_only", guard_rewrites: bool = True,
                       **abstract_kwargs) -> TargetResult:
    """Optimise ``step`` with ``options`` and compile it for ``target`` without a GPU.

    Args:
      step: a ``jax.jit``-wrapped step whose shardings are over a ``target_mesh(target, ...)``.
      *abstract_args: ``jax.ShapeDtypeStruct``s with shardings over that mesh (arrays accepted).
      target: a cluster name of ``concerto_jax.costmodel.CLUSTERS`` (2-host ones included).
      options: ``concerto_jax.Options`` (its ``passes`` run; ``compiler_options`` go to every
        compile; ``dump_dir`` receives the captured, handed and final modules, and
        ``dropped_rewrite_xla_scheduled.hlo`` when the rewrite guard drops a rewrite).
        None: ``Options(passes=("schedule",))``.
      via: ``"backend_only"`` (default): "schedule" orders XLA's own scheduled module and XLA's
        backend compiles it as is (PJRT C API, ``run_backend_only``); the other passes run on
        the post-SPMD module first. ``"pin"``: every pass on the post-SPMD module, ``pin``
        added after ``schedule``, XLA's full pipeline on the pinned module. See the module
        docstring.
      guard_rewrites: backend-only path: keep a program rewritten by the passes that run
        before XLA (decompose, fuse_collectives, pipeline_loops) only if its plan on XLA's
        scheduled module beats the plan without the rewrite (one more reschedule, no extra
        compile); the dropped rewrite's pass records say so (``final_module_guard``). Both
        paths: report the stock program where XLA's final module of ours simulates slower
        than stock's. False: report what the passes made, whatever it costs (ablations).
      **abstract_kwargs: keyword arguments of the step, abstract like the positional ones.

    Returns:
      A ``TargetResult``. If the optimised program cannot be compiled, it reports the stock
      program (``fallback_reason`` set, ``via="stock"``) after one ``TargetFallbackWarning``;
      if XLA's final module of it simulates slower than stock's (and ``guard_rewrites``), it
      reports the stock program too (``fallback_reason`` says so; no warning: a decision, not
      a failure), so the result is never slower than stock by this simulator.

    Raises:
      UnsupportedJaxVersion: the installed JAX is outside the checked range (``jax_compat``).
      GpuPluginMissingError: the CUDA plugin is not installed.
      TypeError: ``step`` is not jitted.
      ValueError: unknown target or ``via``; a step sharded over this machine's (cpu)
        devices instead of the target's (``target_mesh``).
      RuntimeError: the step calls a cuDNN kernel and this machine has no cuDNN (JAX checks
        its version when tracing; the message says what to do).
    """
    from concerto_jax.capture import jit_info
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.judge.fidelity import measure
    from concerto_jax.options import Options

    if via not in ("backend_only", "pin"):
        raise ValueError(f"via must be 'backend_only' or 'pin', got {via!r}")
    jax_compat.check_supported()  # dump names, compile options, the PJRT C API: never guess
    require_gpu_plugin()
    jit_info(step)
    options = Options(passes=("schedule",), target=target) if options is None else options
    if options.target != target:
        options = dataclasses.replace(options, target=target)
    cluster = get_cluster(target)
    cost_model = CostModel(cluster)
    envelope = Envelope(cluster, options.robust) if options.robust and guard_rewrites else None
    seconds: dict = {}
    t0 = t_call = time.perf_counter()
    lowered = lower_for_target(_trace(step, abstract_args, abstract_kwargs))
    seconds["lower"] = time.perf_counter() - t0
    cache = plan_cache.open_target(lowered, cluster, options, via=via, guard_rewrites=guard_rewrites)
    hit = cache.lookup(seconds) if cache is not None else None
    if hit is not None:  # verified: every module parses, the handed one passes the verifier
        return TargetResult(**hit)
    xla_opts = tuple((k, v) for k, v in dict(options.compiler_options).items())
    stock = compile_lowered(lowered, cluster, CompileOptions(
        dump_lhs=via == "backend_only", dump_spmd=True, dump_scheduled=via == "backend_only", extra=xla_opts))
    seconds["stock_compile"] = stock.compile_s
    clock = TimeBudget.start(options, t_call, stock.compile_s)
    _check_target_devices(target, _devices_of(stock.compiled))
    if stock.post_spmd_text is None:
        raise RuntimeError("XLA wrote no post-SPMD module for the target compile; is XLA_FLAGS "
                           "overriding --xla_dump_to?")
    stock_text = stock.final_text
    _dump(options.dump_dir, "captured.hlo", stock.post_spmd_text)
    _dump(options.dump_dir, "stock_final.hlo", stock_text)
    run = (functools.partial(_backend_only, guard_rewrites=guard_rewrites, lowered=lowered,
                             envelope=envelope, clock=clock)
           if via == "backend_only" else _pinned)
    try:
        out = run(stock, options, cluster, cost_model, seconds)
    except Exception as e:  # noqa: BLE001 - never stuck: report the stock program
        if not options.fallback:
            raise
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        warnings.warn(f"concerto_jax.compile_for_target: the optimised program could not be compiled "
                      f"for {target} ({reason}); reporting the stock program", TargetFallbackWarning,
                      stacklevel=2)
        out = dict(final=stock_text, emitted=None, scheduled=None, passes=(), pins=0, via="stock",
                   fallback_reason=reason, failed=True)
    t0 = time.perf_counter()
    m = measure(out["final"], stock_text, cost_model, planned_text=out.get("planned"),
                planned_judged=out.get("planned_judged"))
    slower = guard_rewrites and out["via"] != "stock" and m.final_step_us > m.stock_step_us
    reason = (f"XLA's final module of the optimised program simulates slower than stock's "
              f"({m.final_step_us:.1f} vs {m.stock_step_us:.1f} us; planned "
              f"{m.planned_step_us:.1f}): the stock program is kept")
    if envelope is not None and out["via"] != "stock" and not slower:
        # ... under every plausible cost model (costmodel.envelope), not only the nominal one
        t1 = time.perf_counter()
        verdict = envelope.compare("final_module_guard", out["final"], stock_text, candidate="ours",
                                   baseline="stock", nominal_us=(m.final_step_us, m.stock_step_us),
                                   ties_keep=True)
        envelope.forget_modules()
        seconds["robust"] = seconds.get("robust", 0.0) + time.perf_counter() - t1
        if not verdict.keep:
            slower = True
            reason = (f"XLA's final module of the optimised program simulates slower than stock's "
                      f"under the {verdict.worst_variant} cost model (gain {verdict.worst_gain:.4f}x; "
                      f"nominal {verdict.nominal_gain:.4f}x): the stock program is kept")
    if slower:
        # never slower than stock: XLA's backend can undo part of a plan (its module of our
        # order simulates slower than the plan), and below stock our program has no reason to run
        log.info("compile_for_target(%s): %s", target, reason)
        out = dict(final=stock_text, emitted=None, scheduled=None, passes=out["passes"], pins=0,
                   via="stock", fallback_reason=reason)
        m = measure(stock_text, stock_text, cost_model)
    seconds["simulate"] = time.perf_counter() - t0
    result = TargetResult(
        target=target, final_text=out["final"], stock_final_text=stock_text,
        emitted_text=out["emitted"], scheduled_text=out["scheduled"],
        planned_step_us=m.planned_step_us, final_step_us=m.final_step_us, stock_step_us=m.stock_step_us,
        planned_overlap_us=m.planned_overlap_us, final_overlap_us=m.final_overlap_us,
        overlap_kept=m.overlap_kept, pins=out["pins"], passes=tuple(out["passes"]),
        fallback_reason=out.get("fallback_reason"), seconds={k: round(v, 2) for k, v in seconds.items()},
        via=out["via"], input_peak_bytes=out.get("input_peak_bytes"), peak_bytes=out.get("peak_bytes"),
        memory_limit_bytes=out.get("memory_limit_bytes"),
        robust=tuple(envelope.verdicts) if envelope is not None else (), cut=tuple(clock.cut))
    if cache is not None:
        cache.save(result, failed=out.get("failed", False))
    return result


def _trace(step, args: tuple, kwargs: dict):
    """``step.trace(*args, **kwargs)``; JAX's bare "cuDNN is not detected" (raised when it traces a
    cuDNN kernel on a machine without cuDNN) becomes an error that says what to do."""
    try:
        return step.trace(*args, **kwargs)
    except RuntimeError as e:
        if "cudnn is not detected" not in str(e).lower():
            raise
        raise RuntimeError(
            "compile_for_target: the step calls a cuDNN kernel (e.g. jax.nn.dot_product_attention("
            "implementation='cudnn')), and JAX checks the cuDNN library's version when it traces one; "
            "this machine has no cuDNN. For the deviceless compile, trace the step with XLA's own "
            "kernel (implementation=None or 'xla'), or compile on a machine with cuDNN "
            "installed") from e


def _check_target_devices(target: str, devices) -> None:
    """Raise a ValueError that says what to do when the step is placed on this machine's
    devices (cpu) instead of the target's deviceless ones (``target_mesh``)."""
    local = sorted({d.platform for d in devices if d.platform not in ("gpu", "cuda", "rocm")})
    if local:
        raise ValueError(
            f"compile_for_target: the step is sharded over {local[0]} devices of this machine; "
            f"expected the target's deviceless devices. Build the mesh with "
            f"concerto_jax.target_mesh({target!r}, mesh_shape, axis_names), jit the step with "
            "shardings over it, and pass jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
            "arguments (README: 'Compile for a target GPU cluster')")


GUARD_RETUNE_MARGIN = 0.02
"""When the rewrite's plan loses to the original's at the given combine thresholds, or wins
by less than this fraction of the original's, the rewrite guard does not decide there: with
``Options.combine_thresholds`` on, both programs get the threshold search and the faster
searched plan is kept (``_backend_only``; evoformer_dap8: dropped by 0.3 % at the defaults,
3 % faster than the original after both searches; a held-out DP x TP Llama step: 16 % slower
at XLA's default thresholds, where its combiners merged collectives of different chunks,
5 % faster than the original after both searches)."""


def search_original_too(rewritten_us: float, plain_us: float, searched_rewritten_us: float) -> bool:
    """Whether the rewrite guard also searches the original program's combine thresholds after
    the rewrite won at the given ones (by more than ``GUARD_RETUNE_MARGIN``): yes where the
    rewrite's own search moved its plan by more than its lead (``plain_us - rewritten_us``),
    since the original's search may move it as far."""
    return rewritten_us - searched_rewritten_us > plain_us - rewritten_us


def _robust_keep(envelope, decision: str, candidate: dict, baseline: dict, record: dict, keep: bool,
                 seconds: dict, key: str = "robust", stock_final: str | None = None,
                 names: tuple[str, str] = ("rewrite", "original"), ties_keep: bool = False) -> bool:
    """``keep`` (the nominal comparison of two plans, ``{"handed", "judged"}``) judged again over
    the envelope's cost models when there is one: the candidate's plan is kept only if its
    worst-case gain over stock XLA's final module ``stock_final`` is higher than the baseline
    plan's (``Envelope.compare``'s maximin rule; without ``stock_final``: only if it is faster
    under every model). ``record[key]``: the ``RobustVerdict`` as a dict; ``names``: the
    candidate's and the baseline's names in it; ``ties_keep``: a nominal tie keeps the
    candidate (as the caller's nominal rule does)."""
    if envelope is None:
        return keep
    t0 = time.perf_counter()
    verdict = envelope.compare(decision, candidate["handed"], baseline["handed"], candidate=names[0],
                               baseline=names[1], ties_keep=ties_keep,
                               nominal_us=(candidate["judged"].us, baseline["judged"].us),
                               reference_text=stock_final, reference="stock")
    seconds["robust"] = seconds.get("robust", 0.0) + time.perf_counter() - t0
    record[key] = verdict.as_dict()
    return verdict.keep


PLAN_PASSES = frozenset({"schedule", "pin"})
"""Passes that only order the program: on the backend-only path "schedule" runs on XLA's
scheduled module and "pin" is not used; every other pass rewrites the post-SPMD module first."""


def _backend_only(stock, options, cluster, cost_model, seconds: dict, guard_rewrites: bool = True,
                  lowered=None, envelope=None, clock: TimeBudget | None = None) -> dict:
    """The backend-only path (module docstring); raises on any failure (the caller falls back).

    ``clock`` (``Options.time_budget_s``): the threshold searches and the replicated-only
    alternative run only as far as it allows.

    With ``guard_rewrites``, a program rewritten by the passes before XLA (decompose,
    fuse_collectives, ...) is kept only if its plan on XLA's scheduled module of it is faster
    than the plan on XLA's scheduled module of the original step (both judged by
    ``judge.judge_module``, the figure ``planned_step_us`` reports; the backend keeps the
    plan, so this is also the final module's figure); when the rewrite loses there or wins
    by less than ``GUARD_RETUNE_MARGIN``, both programs get the combine-threshold search (if
    on) and the searched plans decide; so do they where the rewrite wins by more but its own
    search moves its plan by more than that lead. The rewriting passes' records get a
    ``final_module_guard`` entry (and ``changed=False`` if the rewrite is dropped). With an
    ``envelope`` (``costmodel.envelope.Envelope``), each keep-or-drop comparison of the guard
    keeps the rewrite only where its worst-case gain over stock XLA's final module across the
    envelope's models is higher than the program's without it (maximin; the entry's
    ``robust``, ``robust_after_combine_thresholds``, ``without_split.robust``), and a rewrite
    the nominal model keeps by more than the margin but the maximin rule drops gets both
    searches too. The kept plan's ``Judged`` is returned as ``planned_judged`` for
    ``judge.measure``, which then does not simulate the plan a second time.
    """
    from concerto_jax import pipeline
    from concerto_jax.deviceless import pjrt_c
    from concerto_jax.executor import replicated_compile_options

    devices = _devices_of(stock.compiled)
    env = dict(options.compiler_options)
    records: list = []
    rewriting = tuple(p for p in options.passes if p not in PLAN_PASSES)
    # The module XLA's post-scheduling pipelines receive (= after LHS where LHS runs; the
    # memory scheduler's order where it does not, e.g. the A100 targets).
    stock_src = scheduled_src = stock.scheduled_text or stock.after_lhs_text
    stock_compile_options = compile_options = pjrt_c.spmd_compile_options(
        len(devices), env, device_ids=[d.id for d in devices])
    rewritten, planned = False, None
    # XLA's own scheduler limit for this program (parameters and outputs: the same for
    # every rewrite and threshold candidate), or None (Options.memory_budget="input")
    budget = _memory_budget(stock_src, options, cost_model)
    if rewriting:
        t0 = time.perf_counter()
        pre_opts = _with_fused_reference(dataclasses.replace(options, passes=rewriting), scheduled_src,
                                         budget)
        pre = pipeline.run(stock.post_spmd_text, pre_opts)
        seconds["pipeline"] = time.perf_counter() - t0
        if any(r.changed for r in pre.passes):
            # XLA's pipeline up to (and through) its scheduler on OUR program.
            _, _, dt, scheduled_src = compile_replicated_for_target(pre.text, devices, env, after_lhs=True)
            seconds["xla_passes_compile"] = dt
            pre, scheduled_src, planned = _rotation_guard(
                pre, pre_opts, scheduled_src, stock.post_spmd_text, devices, env, options, cost_model,
                seconds, budget, envelope=envelope, stock_final=stock.final_text)
            opts = replicated_compile_options(devices)
            if env:
                opts.env_option_overrides = list(env.items())
            compile_options = opts.SerializeAsString()
            rewritten = True
        records += pre.passes
    if scheduled_src is None:
        raise RuntimeError("XLA wrote no scheduled module (no dump before its post-scheduling "
                           "pipelines nor after its latency hiding scheduler; XLA_FLAGS overriding "
                           "--xla_dump_to?)")
    plan = planned or _plan_on(scheduled_src, options, cost_model, seconds, budget)
    tune = bool(options.combine_thresholds and options.passes)

    def scheduled_at_program(text):  # a rewritten program: XLA's pipeline on the per-device module
        def at(env_t):
            _, _, _, src = compile_replicated_for_target(text, devices, env_t, after_lhs=True)
            opts = replicated_compile_options(devices)
            opts.env_option_overrides = list(env_t.items())
            return src, opts.SerializeAsString()
        return at

    def scheduled_at_rewritten(env_t):  # our program
        return scheduled_at_program(pre.text)(env_t)

    def scheduled_at_step(env_t):  # the step itself: XLA's SPMD compile of it, as the stock
        again = compile_lowered(lowered, cluster, CompileOptions(
            dump_lhs=True, dump_spmd=False, dump_scheduled=True, extra=tuple(env_t.items())))
        return (again.scheduled_text or again.after_lhs_text, pjrt_c.spmd_compile_options(
            len(devices), env_t, device_ids=[d.id for d in devices]))

    def tuned(scheduled_at, plan, src, copts) -> tuple:
        """(plan, scheduled module, compile options, record) after the threshold search."""
        t = _tune_combiners(scheduled_at, env, options, cost_model, plan["judged"].us, src, budget,
                            envelope=envelope, current_plan=plan, stock_final=stock.final_text,
                            clock=clock)
        if t["plan"] is not None:
            return t["plan"], t["scheduled"], t["compile_options"], t["record"]
        return plan, src, copts, t["record"]

    tuned_record = None
    if rewritten and guard_rewrites and stock_src is not None:
        t0 = time.perf_counter()
        rewritten_src = scheduled_src  # XLA's scheduled module of the rewritten program (dumped if dropped)
        plain = _plan_on(stock_src, options, cost_model, {}, budget)
        rewritten_us, plain_us = plan["judged"].us, plain["judged"].us
        keep = rewritten_us < plain_us
        guard = {"rewritten_planned_us": round(rewritten_us, 1), "without_rewrite_planned_us": round(plain_us, 1),
                 "kept": keep}
        keep = _robust_keep(envelope, "rewrite_guard", plan, plain, guard, keep, seconds,
                            stock_final=stock.final_text)
        guard["kept"] = keep
        seconds["rewrite_guard"] = time.perf_counter() - t0
        if tune:
            # The combine thresholds can decide what the given ones do not. Where the rewrite
            # lost or nearly tied there (a split program's best thresholds differ from the
            # original's; at XLA's default ones its combiners can merge collectives of
            # different chunks, which are independent, and the split then overlaps little),
            # both are searched and the faster searched plan is kept. Where it won by more
            # than the margin, its own search runs here (it would run below anyway); if that
            # search moves its plan by more than its lead, the original's search can move the
            # original as far and the lead says nothing, so the original is searched too
            # (gpt_zero3_16: the split led by 2.3 % at XLA's thresholds and its search gained
            # 18 %; the original's search gained 27 % and beat it by 10 %).
            t0 = time.perf_counter()
            near_tie = not keep or abs(rewritten_us - plain_us) <= plain_us * GUARD_RETUNE_MARGIN
            a = tuned(scheduled_at_rewritten, plan, scheduled_src, compile_options)
            if not near_tie:
                guard["rewrite_search_moved_us"] = round(rewritten_us - a[0]["judged"].us, 1)
            if near_tie or search_original_too(rewritten_us, plain_us, a[0]["judged"].us):
                b = tuned(scheduled_at_step, plain, stock_src, stock_compile_options)
                keep = a[0]["judged"].us < b[0]["judged"].us
                after = {"rewritten_planned_us": round(a[0]["judged"].us, 1),
                         "without_rewrite_planned_us": round(b[0]["judged"].us, 1)}
                keep = _robust_keep(envelope, "rewrite_guard_after_combine_thresholds", a[0], b[0], guard,
                                    keep, seconds, key="robust_after_combine_thresholds",
                                    stock_final=stock.final_text)
                guard.update(kept=keep, after_combine_thresholds=after)
                log.info("compile_for_target: %s, both combine-threshold searches: the rewrite "
                         "(%s) plans %.1f us, the original %.1f us",
                         "near tie" if near_tie else "the rewrite's search outran its lead",
                         ",".join(rewriting), a[0]["judged"].us, b[0]["judged"].us)
                a = a if keep else b
            plan, scheduled_src, compile_options, tuned_record = a
            seconds["combine_thresholds"] = time.perf_counter() - t0
        records = [dataclasses.replace(r, stats={**r.stats, "final_module_guard": guard},
                                       changed=r.changed and keep) if r.name in rewriting else r
                   for r in records]
        if not keep:
            log.info("compile_for_target: the rewrite (%s) plans %.1f us on XLA's scheduled module vs "
                     "%.1f us without it: dropped", ",".join(rewriting), rewritten_us, plain_us)
            _dump(options.dump_dir, "dropped_rewrite_xla_scheduled.hlo", rewritten_src)
            if tuned_record is None:
                plan, scheduled_src, compile_options = plain, stock_src, stock_compile_options
            rewritten = False
            dec = next((r for r in records if r.name == "decompose"), None)
            if (dec is not None and dec.stats.get("replicated") and dec.stats.get("split_changed")
                    and (clock is None or clock.allows(clock.compile_s, "the replicated-only "
                                                       "alternative of the dropped split: not compiled"))):
                # the split lost, but the replicated-operand collectives may pay alone (a 3-D
                # dp x fsdp x tp step: its embedding's gather over the data groups, 1.121x ->
                # 1.133x; docs/DECISIONS.md D23)
                t0 = time.perf_counter()
                alt = _without_split(pre_opts, stock.post_spmd_text, devices, options, cost_model,
                                     budget, scheduled_at_program, tuned if tune else None)
                seconds["rewrite_guard_without_split"] = time.perf_counter() - t0
                kept_alt = alt["plan"]["judged"].us < plan["judged"].us
                guard["without_split"] = {"planned_us": round(alt["plan"]["judged"].us, 1),
                                          "kept": kept_alt}
                kept_alt = _robust_keep(envelope, "rewrite_guard_without_split", alt["plan"], plan,
                                        guard["without_split"], kept_alt, seconds,
                                        stock_final=stock.final_text)
                guard["without_split"]["kept"] = kept_alt
                if kept_alt:
                    plan, scheduled_src, compile_options = alt["plan"], alt["src"], alt["copts"]
                    if alt["record"] is not None:
                        tuned_record = alt["record"]
                    records = [dataclasses.replace(r, stats={**r.stats, "final_module_guard": guard})
                               if r.name in rewriting else r for r in alt["passes"]]
                    rewritten = True
    if tune and tuned_record is None:
        t0 = time.perf_counter()
        plan, scheduled_src, compile_options, tuned_record = tuned(
            scheduled_at_rewritten if rewritten else scheduled_at_step, plan, scheduled_src,
            compile_options)
        seconds["combine_thresholds"] = time.perf_counter() - t0
    if tuned_record is not None:
        records.append(tuned_record)
    _dump(options.dump_dir, "xla_scheduled.hlo", scheduled_src)
    if plan["record"] is not None:
        records.append(plan["record"])
    handed = plan["handed"]
    _dump(options.dump_dir, "emitted.hlo", handed)
    t0 = time.perf_counter()
    final = pjrt_c.compile_hlo(handed, cluster, compile_options, backend_only=True)
    seconds["compile"] = time.perf_counter() - t0
    _dump(options.dump_dir, "final.hlo", final)
    return dict(final=final, planned=handed, planned_judged=plan["judged"], emitted=handed,
                scheduled=handed, passes=records, pins=0, via="backend_only", **plan["memory"])


def _without_split(pre_opts, post_spmd: str, devices, options, cost_model, budget,
                   scheduled_at_program, tuned) -> dict:
    """The rewriting passes again with ``DecomposeOptions.split=False`` (only the collectives
    of replicated operands), XLA's scheduled module of that program and its plan (after the
    combine-threshold search when ``tuned`` is given): ``{"plan", "src", "copts", "record",
    "passes"}``."""
    from concerto_jax import pipeline

    opts = dataclasses.replace(pre_opts, decompose=dataclasses.replace(pre_opts.decompose, split=False))
    pre = pipeline.run(post_spmd, opts)
    at = scheduled_at_program(pre.text)
    src, copts = at(dict(options.compiler_options))
    plan = _plan_on(src, options, cost_model, {}, budget)
    record = None
    if tuned is not None:
        plan, src, copts, record = tuned(at, plan, src, copts)
    log.info("compile_for_target: the rewrite without the split plans %.1f us", plan["judged"].us)
    return {"plan": plan, "src": src, "copts": copts, "record": record, "passes": list(pre.passes)}


def _rotation_guard(pre, pre_opts, scheduled_src: str, post_spmd: str, devices, env, options,
                    cost_model, seconds: dict, budget, envelope=None, stock_final: str | None = None):
    """Keep each loop rotation of the decompose pass only where XLA's module of the program
    plans faster with it: ``(pipeline result, XLA's scheduled module, its plan or None)``.

    A rotation is decided on the post-SPMD graph, which does not see what XLA's passes make
    of the rotated loop (fusion across the cut, all-reduce pairs its reassociation merges,
    its own loop pipelining). So the program with every
    rotation is planned on XLA's scheduled module against the same program with one rotated
    loop left as it was, for each rotated loop (one more decompose + XLA compile + plan
    each); the fastest is kept, and the decompose record gets ``rotation_guard``. With an
    ``envelope`` (``Options.robust``), each comparison keeps the program with the rotation
    only where its worst-case gain over stock XLA's final module ``stock_final`` across the
    plausible cost models is at least the other's (maximin, as the rewrite guard;
    ``rotation_guard["robust"]`` holds each verdict).
    """
    from concerto_jax import pipeline

    rec = next((r for r in pre.passes if r.name == "decompose"), None)
    rotated = [r["body"] for r in (rec.stats.get("rotations") or []) if r.get("rotated")] if rec else []
    if not rotated:
        return pre, scheduled_src, None
    t0 = time.perf_counter()
    plan = _plan_on(scheduled_src, options, cost_model, {}, budget)
    best = (plan["judged"].us, pre, scheduled_src, (), plan)
    tried = {"all": round(best[0], 1)}
    verdicts: dict = {}
    for body in rotated:
        dopts = dataclasses.replace(pre_opts.decompose, rotate_skip=(body,))
        alt = pipeline.run(post_spmd, dataclasses.replace(pre_opts, decompose=dopts))
        _, _, _, src = compile_replicated_for_target(alt.text, devices, env, after_lhs=True)
        plan = _plan_on(src, options, cost_model, {}, budget)
        us = plan["judged"].us
        tried[f"without {body}"] = round(us, 1)
        # the kept program so far (with this loop rotated) against the one without its rotation
        keep = _robust_keep(envelope, "rotation_guard", best[4], plan, verdicts, best[0] <= us, seconds,
                            key=f"without {body}", stock_final=stock_final,
                            names=("rotated", "not rotated"), ties_keep=True)
        if not keep:
            best = (us, alt, src, (body,), plan)
    _, pre, scheduled_src, skipped, plan = best
    seconds["rotation_guard"] = time.perf_counter() - t0
    guard = {"planned_us": tried, "not_rotated": list(skipped)}
    if verdicts:
        guard["robust"] = verdicts
    log.info("compile_for_target: rotation guard %s", guard)
    passes = tuple(dataclasses.replace(r, stats={**r.stats, "rotation_guard": guard})
                   if r.name == "decompose" else r for r in pre.passes)
    return dataclasses.replace(pre, passes=passes), scheduled_src, plan


def combine_threshold_options(nbytes: int) -> dict[str, int]:
    """XLA compiler options setting every combiner of ``COMBINED_KINDS`` to ``nbytes``."""
    from concerto_jax.autoccl.knobs import gpu_combine_threshold_options

    return gpu_combine_threshold_options(dict.fromkeys(COMBINED_KINDS, int(nbytes)))


def _collectives_by_kind(text: str) -> tuple[dict[str, int], dict[str, tuple]]:
    """``(bytes, buckets)`` of the collectives of each ``COMBINED_KINDS`` kind in the module
    ``text`` (sync ops and async starts, sugared or generic, and collective kernel fusions):
    bytes in all (of the op carrying the collective: a sugared start's tuple counts operands
    and results, an over-estimate) and the sorted shapes of its collectives, which say how
    XLA combined them. Only the computations that run as sequences of ops are read: the
    collective inside an ``async-start``'s computation or a collective kernel's fused
    computation is counted once, through its wrapper."""
    from hlo_passes.ir.loops import schedulable_computations
    from hlo_passes.ir.parser import parse_module

    nbytes = dict.fromkeys(COMBINED_KINDS, 0)
    shapes: dict[str, list] = {k: [] for k in COMBINED_KINDS}
    for comp in schedulable_computations(parse_module(text)):
        for inst in comp.instructions:
            kind = inst.collective_kind
            if kind in nbytes and inst.async_role in (None, "start"):
                op = inst.collective_op or inst
                nbytes[kind] += op.shape.byte_size
                shapes[kind].append(str(op.shape))
    return nbytes, {k: tuple(sorted(v)) for k, v in shapes.items()}


PARALLEL_COMPILE_COST = 0.6
"""The threshold search compiles its estimated candidates side by side (threads; XLA's compile
releases the GIL): each candidate beyond the first adds this fraction of one compile to the
batch's wall time where the time budget decides how many fit (two compiles of the held-out
DP x TP step on 2 cores: 33 s side by side, 43 s one after the other)."""

ROBUST_COMBINE_CHECKS = 3
"""With an envelope, the combine-threshold search checks at most this many of its candidates that
plan faster than the given settings (fastest first) against the current plan over the envelope's
cost models, and keeps the first one ``Envelope.compare`` keeps (none: the given settings)."""


def _tune_combiners(scheduled_at, env: dict, options, cost_model, current_us: float,
                    current_src: str, budget: int | None = None, envelope=None,
                    current_plan: dict | None = None, stock_final: str | None = None,
                    clock: TimeBudget | None = None) -> dict:
    """Plan the program at other XLA combine thresholds and keep the fastest plan if it beats
    ``current_us`` (the plan at the user's settings, of XLA's scheduled module ``current_src``).

    Two stages, each candidate one XLA compile (``scheduled_at(env) -> (XLA's scheduled module,
    serialized compile options of the backend compile)``) and one reschedule, judged as the
    rewrite guard judges (``judge.judge_module``):

    1. uniform: XLA's all-reduce, all-gather and reduce-scatter thresholds all set to each
       size of ``options.combine_thresholds``;
    2. per kind (``options.combine_per_kind``, where two or more kinds are present): one round
       of coordinate descent from the best so far, each kind in turn at every size and at the
       given setting, the others held. A kind whose collectives hold no more bytes in all
       than the smallest size is left as it is (every size combines it alike), and a size
       at which stage 1 (or the given settings) combined that kind into the same buckets as
       the size held now is skipped (XLA's combiner of one kind groups by that kind's
       threshold: same buckets, same module), listed under ``skipped``.

    XLA merges small collectives of one kind into buckets up to its threshold, so that a step
    pays fewer launches and latencies; but a bucket waits for its last member, and the last
    gradients of a step (or the first weights of a ZeRO-3 step) then leave the whole bucket
    exposed. The best size differs per kind (a ZeRO-3 step's forward weight gathers want few
    big buckets, its backward reduce-scatters small ones) and is not monotonic in the size
    (bucket boundaries against layer boundaries), so it is judged by the plan. AutoCCL
    (NSDI'25) tunes such settings online on the GPU; without a GPU the plan is the
    measurement. A candidate that fails (compile, memory limit) is skipped and recorded.

    The smallest size is compiled first; every candidate is estimated on its module
    (``_estimate_candidates``: the record's ``estimates`` and each candidate's
    ``estimated_us``), and with ``options.combine_compiles`` only that many of the
    best-estimated ones are compiled (instead of stages 1 and 2). With a ``clock``
    (``TimeBudget``), a candidate whose compile (as long as the slowest so far, or stock's)
    does not fit in what is left is not compiled (``cut_by_time_budget``).

    With an ``envelope`` and the ``current_plan`` (``{"handed", "judged"}``), the candidates that
    plan faster than the current plan are checked fastest first (at most
    ``ROBUST_COMBINE_CHECKS``) against it over the envelope's cost models; the first kept by
    ``Envelope.compare`` (maximin over stock XLA's final module ``stock_final``: a worst-case
    gain above the current plan's; without it: faster under every model) is kept (the
    record's ``robust``: each check's verdict).

    Returns:
      ``{"record": PassRecord("combine_thresholds", ...), "plan" (judged: ``plan["judged"]``),
      "scheduled", "compile_options"}``; the last three None when no candidate beats the
      current plan. The record's ``chosen`` is ``{kind: bytes}`` for the kinds set (absent
      kinds: the given setting), None when nothing beat the current plan.
    """
    from concerto_jax.report import PassRecord
    from concerto_jax.scheduler.progress import Progress

    t0 = time.perf_counter()
    progress = Progress(log, "compile_for_target: combine thresholds")
    sizes = tuple(int(b) for b in options.combine_thresholds)
    given, given_buckets = _collectives_by_kind(current_src)
    present = [k for k in COMBINED_KINDS if given[k] > 0]
    tried: list[dict] = []
    skipped: list[dict] = []
    seen: set = set()
    buckets_at: dict = {None: given_buckets}  # uniform size (None: given) -> buckets per kind
    best = None  # (judged, plan, src, compile_options, setting)
    faster: list = []  # every candidate that beat current_us, as best's tuples
    estimates: dict = {}  # candidate key -> the pruning model's estimate (thresholds.CombineProxy)
    durations: list[float] = []  # seconds per compiled candidate
    cut: list[dict] = []  # candidates the time budget left out

    def key_of(setting: dict[str, int]) -> tuple:
        return tuple(sorted((k, v) for k, v in setting.items() if k in present))

    def compile_at(setting: dict[str, int]):
        return scheduled_at({**env, **gpu_combine_threshold_options(setting)})

    def attempt(setting: dict[str, int], compiled=None) -> str | None:
        """Compile (unless ``compiled``: a future of ``compile_at``), plan and record one candidate."""
        nonlocal best
        key = key_of(setting)
        if not key or key in seen:  # nothing set on a present kind: the current plan
            return None
        seen.add(key)
        entry = {"thresholds": dict(key)}
        if key in estimates:
            entry["estimated_us"] = round(estimates[key], 1)
        if compiled is None and clock is not None and clock.left() < max(durations, default=clock.compile_s):
            cut.append(dict(key))
            return None
        t_attempt = time.perf_counter()
        try:
            src, compile_options = compile_at(setting) if compiled is None else compiled.result()
            if src is None:
                raise RuntimeError("XLA wrote no scheduled module")
            plan = _plan_on(src, options, cost_model, {}, budget)
            judged = plan["judged"]
        except Exception as e:  # noqa: BLE001 - one candidate; the others and the current plan stand
            tried.append({**entry, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        durations.append(time.perf_counter() - t_attempt)
        tried.append({**entry, "planned_us": round(judged.us, 1)})
        if judged.us < current_us:
            faster.append((judged, plan, src, compile_options, dict(key)))
        if judged.us < current_us and (best is None or judged.us < best[0].us):
            best = (judged, plan, src, compile_options, dict(key))
        progress.update(candidates=len(tried), given_us=current_us,
                        best_us=current_us if best is None else best[0].us)
        return src

    varied = [k for k in present if sizes and given[k] > min(sizes)]
    per_kind = options.combine_per_kind and len(varied) >= 2
    proxy_stats: dict = {}
    if len(sizes) > 1 and present:
        # the smallest size first: its module is what the others are estimated on
        src = attempt(dict.fromkeys(COMBINED_KINDS, min(sizes)))
        if src is not None:
            buckets_at[min(sizes)] = _collectives_by_kind(src)[1]
            proxy_stats = _estimate_candidates(src, cost_model, sizes, present, varied, per_kind, given,
                                               estimates, progress)
            for t in tried:  # the smallest size's own estimate, beside its plan
                k = tuple(sorted(t["thresholds"].items()))
                if k in estimates:
                    t["estimated_us"] = round(estimates[k], 1)
    ranked = proxy_stats.get("ranked")
    if options.combine_compiles is not None and ranked is not None:
        batch = [c for c in ranked[:options.combine_compiles] if key_of(c) and key_of(c) not in seen]
        fits = len(batch)
        if clock is not None:  # as many as fit, compiled side by side (PARALLEL_COMPILE_COST)
            one = max(durations, default=clock.compile_s)
            while fits and clock.left() < one * (1 + PARALLEL_COMPILE_COST * (fits - 1)):
                fits -= 1
        workers = max(1, min(fits, os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="threshold-compile") as pool:
            futures = [pool.submit(compile_at, c) for c in batch[:fits]]
            for c, f in zip(batch[:fits], futures, strict=True):
                attempt(c, compiled=f)
        for c in batch[fits:]:
            seen.add(key_of(c))
            cut.append(dict(key_of(c)))
        per_kind = False
    else:
        for size in sizes:
            src = attempt(dict.fromkeys(COMBINED_KINDS, size))
            if src is not None:
                buckets_at[size] = _collectives_by_kind(src)[1]
    if per_kind:
        for kind in sorted(varied, key=lambda k: -given[k]):
            for size in (*sizes, None):
                base = dict(best[4]) if best is not None else {}
                held = base.get(kind)
                if (size != held and size in buckets_at and held in buckets_at
                        and buckets_at[size][kind] == buckets_at[held][kind]):
                    skipped.append({"kind": kind, "bytes": size, "same_buckets_as": held})
                    continue
                if size is None:
                    base.pop(kind, None)
                else:
                    base[kind] = size
                attempt(base)
    checks = []
    if envelope is not None and current_plan is not None and best is not None:
        # the nominal choice, then the next fastest, must beat the given settings under every model
        t1 = time.perf_counter()
        best = None
        for cand in sorted(faster, key=lambda c: c[0].us)[:ROBUST_COMBINE_CHECKS]:
            verdict = envelope.compare("combine_thresholds", cand[1]["handed"], current_plan["handed"],
                                       candidate=f"thresholds {cand[4]}", baseline="given thresholds",
                                       nominal_us=(cand[0].us, current_us), reference_text=stock_final,
                                       reference="stock")
            checks.append(verdict.as_dict())
            if verdict.keep:
                best = cand
                break
        log.info("compile_for_target: combine thresholds over the envelope: %s (%.1f s)",
                 "none kept" if best is None else best[4], time.perf_counter() - t1)
    chosen = None if best is None else best[4]
    stats = {"target": options.target, "current_planned_us": round(current_us, 1),
             "kind_bytes": given, "varied_kinds": varied, "per_kind_round": per_kind,
             "candidates": tried, "skipped": skipped,
             # how many collectives of each kind XLA left at each uniform size (bytes as a
             # string; "given": the given settings)
             "collectives_at": {("given" if b is None else str(b)): {k: len(v[k]) for k in present}
                                for b, v in buckets_at.items()},
             "flags": sorted(combine_threshold_options(0)),
             "chosen": chosen}
    if proxy_stats:
        stats["estimates"] = {k: v for k, v in proxy_stats.items() if k != "ranked"}
        stats["compiled"] = sum("error" not in t for t in tried)
    if cut:
        stats["cut_by_time_budget"] = cut
        clock.cut.append(f"combine thresholds: {len(cut)} candidate(s) not compiled "
                         f"({', '.join(str(c) for c in cut[:3])}{', ...' if len(cut) > 3 else ''})")
    if checks:
        stats["robust"] = checks
    if best is not None:
        log.info("compile_for_target: combine thresholds %s plan %.1f us vs %.1f us at the given "
                 "settings: kept", chosen, best[0].us, current_us)
    record = PassRecord("combine_thresholds", best is not None, time.perf_counter() - t0, stats)
    if best is None:
        return {"record": record, "plan": None, "scheduled": None, "compile_options": None}
    _, plan, src, compile_options, _ = best
    return {"record": record, "plan": plan, "scheduled": src, "compile_options": compile_options}


def _estimate_candidates(src: str, cost_model, sizes, present, varied, per_kind: bool, given: dict,
                         estimates: dict, progress) -> dict:
    """Estimate every candidate of the threshold search on XLA's module at the smallest size
    (``thresholds.CombineProxy``) and rank them: the uniform sizes, then (``per_kind``) one round
    of coordinate descent over the ``varied`` kinds from the best estimated so far. Candidates
    whose emulated buckets equal the smallest size's, or an earlier-ranked candidate's, are
    dropped (the same module). Fills ``estimates`` (candidate key -> µs).

    Returns:
      ``{"ranked": [setting, ...] best first, "model_us": the estimate at the smallest size,
      "best": the first five ranked with their estimates, "candidates": how many were
      estimated, "same_buckets": how many dropped, "cycles", "seconds"}``; ``{}`` when the
      model cannot be built (the search then compiles them all).
    """
    t0 = time.perf_counter()
    try:
        proxy = CombineProxy(src, cost_model)
    except Exception as e:  # noqa: BLE001 - the model prunes; without it every candidate compiles
        log.warning("compile_for_target: combine thresholds: no pruning model (%s: %s); every "
                    "candidate is compiled", type(e).__name__, str(e)[:200])
        return {}
    uniform = {b: dict.fromkeys(COMBINED_KINDS, b) for b in sizes}
    found: dict = {}  # key -> (us, setting, signature)

    def estimate(setting: dict) -> float:
        key = tuple(sorted((k, v) for k, v in setting.items() if k in present))
        if key not in found:
            found[key] = (proxy.us(setting), dict(setting), proxy.signature(setting))
            estimates[key] = found[key][0]
            progress.update(estimated=len(found))
        return found[key][0]

    for b in sizes:
        estimate(uniform[b])
    if per_kind:
        base = dict(uniform[min(sizes, key=lambda b: estimate(uniform[b]))])
        for kind in sorted(varied, key=lambda k: -given[k]):
            base = min(({**base, kind: b} for b in sizes), key=estimate)
    smallest = found[tuple(sorted((k, min(sizes)) for k in present))]
    ranked, signatures, best = [], {smallest[2]}, []
    for us, setting, sig in sorted(found.values(), key=lambda f: f[0]):
        if sig not in signatures:
            signatures.add(sig)
            ranked.append(setting)
            best.append({"thresholds": {k: v for k, v in setting.items() if k in present},
                         "estimated_us": round(us, 1)})
    stats = {"model_us": round(smallest[0], 1), "best": best[:5], "candidates": len(found),
             "same_buckets": len(found) - 1 - len(ranked), "cycles": proxy.cycles,
             "seconds": round(time.perf_counter() - t0, 2)}
    log.info("compile_for_target: combine thresholds estimated: %s", stats)
    return {"ranked": ranked, **stats}


def xla_scheduler_memory_limit(module, gpu, compiler_options=None) -> int:
    """The memory limit XLA's GPU latency hiding scheduler holds a module to on ``gpu``.

    XLA (``gpu_hlo_schedule.cc``, ``GetSchedulerMemoryLimit``): 80 % of the device's memory,
    minus the bytes of the entry's parameters and outputs (assumed live throughout), times
    ``xla_gpu_memory_limit_slop_factor`` % (95 by default; read from ``compiler_options``
    where set). Aliased outputs are counted twice here (XLA subtracts them): a lower, safer
    limit. ``module``: an ``hlo_passes`` module; ``gpu``: a ``costmodel.specs.GpuSpec``.
    """
    slop = int(dict(compiler_options or {}).get("xla_gpu_memory_limit_slop_factor", 95))
    entry = module.entry
    io = sum(p.shape.byte_size for p in entry.parameters)
    if entry.root is not None:
        io += entry.root.shape.byte_size
    return max(0, (gpu.memory_bytes * 80 // 100 - io) * slop // 100)


def _memory_budget(scheduled_src: str | None, options, cost_model) -> int | None:
    """XLA's own scheduler memory limit for the program of ``scheduled_src`` on the target
    (``xla_scheduler_memory_limit``) when ``_plan_on`` should plan within it too; None where
    it should not (``Options.memory_budget="input"``, no "schedule" pass, or a scheduler
    limit the user set in bytes or turned off)."""
    if (scheduled_src is None or options.memory_budget != "xla" or "schedule" not in options.passes
            or options.scheduler.memory_limit_bytes is not None
            or options.scheduler.memory_limit_ratio is None):
        return None
    from hlo_passes.ir import parse_module

    return xla_scheduler_memory_limit(parse_module(scheduled_src, source="xla-after-lhs"),
                                      cost_model.gpu, options.compiler_options)


def _plan_on(scheduled_src: str, options, cost_model, seconds: dict,
             budget: int | None = None) -> dict:
    """Our order of XLA's scheduled module ``scheduled_src`` when "schedule" runs (else as is),
    judged (``judge.judge_module``).

    With a ``budget`` (``_memory_budget``) the module is planned twice, held to the peak
    of XLA's order (``options.scheduler``'s limit) and within that budget, the limit XLA's
    own scheduler has on the target; the faster plan by the judge is kept (the first on a
    tie). The scheduler's own objective has no overlap
    slowdown, so more memory (more overlap) does not always judge faster.

    Returns:
      ``{"handed": module text for the backend, "judged": its Judged, "record": the
      schedule PassRecord or None, "memory": input_peak_bytes / peak_bytes /
      memory_limit_bytes (empty without schedule)}``.

    Raises:
      RuntimeError: our order's peak exceeds the memory limit.
    """
    from concerto_jax.judge.fidelity import judge_module

    if "schedule" not in options.passes:
        return {"handed": scheduled_src, "judged": judge_module(scheduled_src, cost_model),
                "record": None, "memory": {}}
    plan = _plan_once(scheduled_src, options, cost_model, seconds)
    if budget is None:
        return plan
    limit = plan["memory"].get("memory_limit_bytes")
    tried = [{"memory_limit_bytes": limit, "planned_us": round(plan["judged"].us, 1),
              "peak_bytes": plan["memory"].get("peak_bytes")}]
    if limit is not None and budget > limit:
        wide = _plan_once(scheduled_src, dataclasses.replace(options, scheduler=dataclasses.replace(
            options.scheduler, memory_budget_bytes=budget)), cost_model, seconds,
            same_as=plan)
        tried.append({"memory_limit_bytes": wide["memory"].get("memory_limit_bytes"),
                      "planned_us": round(wide["judged"].us, 1),
                      "peak_bytes": wide["memory"].get("peak_bytes")})
        if wide["judged"].us < plan["judged"].us:
            plan = wide
    rec = plan["record"]
    plan["record"] = dataclasses.replace(rec, stats={
        **rec.stats, "memory_budget": "xla", "xla_memory_limit_bytes": budget,
        "memory_candidates": tried})
    return plan


def _plan_once(scheduled_src: str, options, cost_model, seconds: dict, same_as=None) -> dict:
    """One run of the schedule pass over ``scheduled_src`` (``_plan_on``), judged (the judge of
    ``same_as``, an earlier plan, reused when the order is the same)."""
    from concerto_jax.deviceless import reschedule
    from concerto_jax.judge.fidelity import judge_module
    from concerto_jax.report import PassRecord

    t0 = time.perf_counter()
    r = reschedule.reschedule_text(scheduled_src, cost_model, options)
    dt = time.perf_counter() - t0
    seconds["schedule"] = seconds.get("schedule", 0.0) + dt
    entry = r.computations[-1]
    stats = {"target": options.target, "computations": len(r.computations), "changed": list(r.changed),
             "tasks": sum(c.tasks for c in r.computations),
             "collectives": sum(c.collectives for c in r.computations),
             "program_order_us": round(r.input_us, 1), "scheduled_us": round(r.scheduled_us, 1),
             "gain": round(r.input_us / r.scheduled_us, 4) if r.scheduled_us > 0 else 1.0,
             "source": entry.source, "input_peak_bytes": entry.input_peak_bytes,
             "peak_bytes": entry.peak_bytes, "memory_limit_bytes": entry.memory_limit_bytes,
             "on": "xla_scheduled"}
    if (entry.memory_limit_bytes is not None and entry.peak_bytes is not None
            and entry.peak_bytes > entry.memory_limit_bytes):
        raise RuntimeError(f"our order's peak {entry.peak_bytes} B exceeds the memory limit "
                           f"{entry.memory_limit_bytes} B")
    same = same_as is not None and same_as["handed"] == r.text
    return {"handed": r.text, "judged": same_as["judged"] if same else judge_module(r.text, cost_model),
            "record": PassRecord("schedule", bool(r.changed), dt, stats),
            "memory": dict(input_peak_bytes=entry.input_peak_bytes, peak_bytes=entry.peak_bytes,
                           memory_limit_bytes=entry.memory_limit_bytes)}


def _pinned(stock, options, cluster, cost_model, seconds: dict) -> dict:
    """The pin path (module docstring); raises on any failure (the caller falls back)."""
    from concerto_jax import pipeline

    t0 = time.perf_counter()
    pipeline_result = pipeline.run(stock.post_spmd_text, _with_fused_reference(
        _pipeline_options(options), stock.scheduled_text or stock.after_lhs_text))
    seconds["pipeline"] = time.perf_counter() - t0
    _dump(options.dump_dir, "emitted.hlo", pipeline_result.text)
    scheduled = _scheduled(pipeline_result.text)
    _dump(options.dump_dir, "scheduled.hlo", scheduled)
    devices = _devices_of(stock.compiled)
    final, _, dt = compile_replicated_for_target(pipeline_result.text, devices, dict(options.compiler_options))
    seconds["compile"] = dt
    _dump(options.dump_dir, "final.hlo", final)
    pins = sum(int(rec.stats.get("pinned", 0)) for rec in pipeline_result.passes if rec.name == "pin")
    return dict(final=final, emitted=pipeline_result.text, scheduled=scheduled, passes=pipeline_result.passes,
                pins=pins, via="pin")


def _scheduled(text: str) -> str | None:
    """The emitted module as a scheduled module with async pairs (None if the emitter cannot)."""
    try:
        from hlo_passes.emit import emit_scheduled

        return emit_scheduled(text)
    except Exception as e:  # noqa: BLE001 - an artifact; its failure must not stop the compile
        log.warning("scheduled emission failed: %s", e)
        return None


def _dump(directory: str | None, name: str, text: str | None) -> None:
    if directory is None or text is None:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w") as f:
        f.write(text)
