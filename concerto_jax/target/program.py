"""``compile_for_target``: run the optimize pipeline on a step and compile the result for a target GPU, deviceless.

Stages (each checked with jax/jaxlib 0.10.2 and the CUDA plugin on a CPU machine)::

    jitted step + abstract args on a target_mesh
      | stock compile       lower + compile for the target with dumps at spmd-partitioning and
      |                     around latency-hiding-scheduler: the post-SPMD module (our input)
      |                     and XLA's final module of the original step (the baseline)
      | pipeline.run        parse -> passes (Options.passes; "pin" added after "schedule")
      |                     -> replicated rewrite -> print, checked by XLA's parser
      | emit                scheduled module with async start/done pairs (hlo_passes.emit), dump
      | replicated compile  HLO -> StableHLO -> compile for the target as n replicas
      |                     (num_partitions=1): XLA's GPU compiler fuses and runs its latency
      |                     hiding scheduler on OUR module; hlo_modules() is its final module
      | simulate            one cost model (concerto_jax.simulator) for planned, final, stock
      v
    TargetResult

The plan reaches XLA as data dependencies (``pin`` pass, DESIGN.md section 5):
each collective's window is tied with two ``opt-barrier``s. XLA still fuses and
orders the program; ``final_text`` is what it made of ours.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Sequence

from concerto_jax.target.compile import (
    CompileOptions,
    _read_dump,
    compile_lowered,
    require_gpu_plugin,
)

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
      emitted_text: the module we handed to XLA (replicated, pins included).
      scheduled_text: the same program as a scheduled module with explicit async
        start/done pairs at the planned positions (``hlo_passes.emit``), or None.
      planned_step_us: the plan on the graph XLA runs: XLA's final module of our program,
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
      pins: collectives whose window got opt-barriers.
      passes: the pass records of the pipeline (name, changed, seconds, stats).
      fallback_reason: why the optimised program was not compiled (None when it was).
      seconds: wall time per stage.
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


def _pipeline_options(options):
    """``options`` with ``pin`` run after ``schedule`` (the plan must reach XLA)."""
    passes = tuple(options.passes)
    if "schedule" in passes and "pin" not in passes:
        passes = passes + ("pin",)
    return dataclasses.replace(options, passes=passes)


def _copy_to_reshape(text: str) -> str:
    """Identity ``reshape`` in place of layout-preserving ``copy`` (the deviceless compile path
    refuses to legalise ``mhlo.copy``; DESIGN.md section 5)."""
    import hlo_passes
    from hlo_passes.ir import Instruction

    module = hlo_passes.parse_module(text, source="emitted")
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
    return hlo_passes.module_to_text(module) if n else text


def compile_replicated_for_target(hlo_text: str, devices: Sequence, compiler_options: dict | None = None):
    """Compile a replicated per-device module for the deviceless target of ``devices``.

    Returns:
      ``(final module text, before-LHS text or None, compile seconds)``.
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
        env.update({"xla_dump_to": d, "xla_dump_hlo_pass_re": "latency-hiding-scheduler"})
        opts.env_option_overrides = list(env.items())
        t0 = time.perf_counter()
        with jax_mlir.make_ir_context() as ctx:
            mod = ir.Module.parse(mlir, context=ctx)
            exe = devices[0].client.compile(mod, executable_devices=xc.DeviceList(devices),
                                            compile_options=opts)
        dt = time.perf_counter() - t0
        before = _read_dump(d, "before_latency-hiding-scheduler")
    final = exe.hlo_modules()[0].to_string()
    return final, before, dt


def _devices_of(compiled) -> tuple:
    """Devices in partition order (partition ``i`` runs on the ``i``-th)."""
    try:
        return tuple(compiled._executable._unloaded_executable.device_list)
    except AttributeError:  # another JAX layout: the shardings' device assignment
        import jax

        leaves = [s for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "_device_assignment")]
        return tuple(leaves[0]._device_assignment)


def compile_for_target(step, *abstract_args, target: str = "h100_sxm_8", options=None,
                       **abstract_kwargs) -> TargetResult:
    """Optimise ``step`` with ``options`` and compile it for ``target`` without a GPU.

    Args:
      step: a ``jax.jit``-wrapped step whose shardings are over a ``target_mesh(target, ...)``.
      *abstract_args: ``jax.ShapeDtypeStruct``s with shardings over that mesh (arrays accepted).
      target: a cluster name of ``concerto_jax.costmodel.CLUSTERS`` (2-host ones included).
      options: ``concerto_jax.Options`` (its ``passes`` run; ``pin`` is added after
        ``schedule``; ``compiler_options`` go to both compiles; ``dump_dir`` receives the
        captured, emitted, scheduled and final modules). None: ``Options(passes=("schedule",))``.
      **abstract_kwargs: keyword arguments of the step, abstract like the positional ones.

    Returns:
      A ``TargetResult``. If the optimised program cannot be compiled, it reports the stock
      program (``fallback_reason`` set) after one ``TargetFallbackWarning``.

    Raises:
      GpuPluginMissingError: the CUDA plugin is not installed.
      TypeError: ``step`` is not jitted.
      ValueError: unknown target.
    """
    from concerto_jax import pipeline
    from concerto_jax.capture import jit_info
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.options import Options
    from concerto_jax.target.fidelity import measure

    require_gpu_plugin()
    jit_info(step)
    options = Options(passes=("schedule",), target=target) if options is None else options
    if options.target != target:
        options = dataclasses.replace(options, target=target)
    cluster = get_cluster(target)
    cost_model = CostModel(cluster)
    seconds: dict = {}
    t0 = time.perf_counter()
    lowered = step.trace(*abstract_args, **abstract_kwargs).lower()
    seconds["lower"] = time.perf_counter() - t0
    xla_opts = tuple((k, v) for k, v in dict(options.compiler_options).items())
    stock = compile_lowered(lowered, cluster, CompileOptions(dump_lhs=False, dump_spmd=True, extra=xla_opts))
    seconds["stock_compile"] = stock.compile_s
    if stock.post_spmd_text is None:
        raise RuntimeError("XLA wrote no post-SPMD module for the target compile; is XLA_FLAGS "
                           "overriding --xla_dump_to?")
    stock_text = stock.final_text
    _dump(options.dump_dir, "captured.hlo", stock.post_spmd_text)
    _dump(options.dump_dir, "stock_final.hlo", stock_text)
    result = pipeline_result = None
    reason = None
    try:
        t0 = time.perf_counter()
        pipeline_result = pipeline.run(stock.post_spmd_text, _pipeline_options(options))
        seconds["pipeline"] = time.perf_counter() - t0
        _dump(options.dump_dir, "emitted.hlo", pipeline_result.text)
        scheduled = _scheduled(pipeline_result.text)
        _dump(options.dump_dir, "scheduled.hlo", scheduled)
        devices = _devices_of(stock.compiled)
        final, _, dt = compile_replicated_for_target(pipeline_result.text, devices, dict(options.compiler_options))
        seconds["compile"] = dt
        _dump(options.dump_dir, "final.hlo", final)
        result = (final, scheduled)
    except Exception as e:  # noqa: BLE001 - never stuck: report the stock program
        if not options.fallback:
            raise
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        warnings.warn(f"concerto_jax.compile_for_target: the optimised program could not be compiled "
                      f"for {target} ({reason}); reporting the stock program", TargetFallbackWarning,
                      stacklevel=2)
    t0 = time.perf_counter()
    final_text = result[0] if result else stock_text
    m = measure(final_text, stock_text, cost_model)
    seconds["simulate"] = time.perf_counter() - t0
    pins = 0
    for rec in (pipeline_result.passes if pipeline_result else ()):
        if rec.name == "pin":
            pins = int(rec.stats.get("pinned", 0))
    return TargetResult(
        target=target, final_text=final_text, stock_final_text=stock_text,
        emitted_text=pipeline_result.text if pipeline_result else None,
        scheduled_text=result[1] if result else None,
        planned_step_us=m.planned_step_us, final_step_us=m.final_step_us, stock_step_us=m.stock_step_us,
        planned_overlap_us=m.planned_overlap_us, final_overlap_us=m.final_overlap_us,
        overlap_kept=m.overlap_kept, pins=pins,
        passes=tuple(pipeline_result.passes) if pipeline_result else (),
        fallback_reason=reason, seconds={k: round(v, 2) for k, v in seconds.items()})


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
