"""Compile a jitted step for a target GPU cluster on a machine without a GPU (deviceless).

Recipe (``docs/ARCHITECTURE.md`` F3, checked with jax/jaxlib 0.10.2): the CUDA PJRT
plugin describes a topology from a shipped ``GpuTargetConfigProto``
(``concerto_jax/gpu_configs/*.txtpb``); a mesh over that topology's devices
gives shardings; ``jit(...).trace(*abstract).lower().compile(options)`` runs
XLA's GPU compiler (ptxas from ``nvidia-cuda-nvcc``) and ``as_text()`` is the
final scheduled module. The run must have ``JAX_PLATFORMS=cpu`` (set by the
caller before JAX starts; this module reads no environment).

Variants: stock (latency hiding scheduler on), with a PGLE profile written
from our cost model (``pgle.write_profile``; XLA's LHS then uses our costs),
and with windowed einsum (``xla_gpu_threshold_for_windowed_einsum_mib``). The
modules just before and after LHS come from an ``xla_dump_to`` dump.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from concerto_jax import jax_compat
from concerto_jax.capture import restore_parameter_shardings
from concerto_jax.costmodel.cluster import Cluster, get_cluster
from concerto_jax.deviceless import cuda_plugin
from concerto_jax.executor import parse_with_xla, replicated_compile_options
from hlo_passes.ir import Instruction, module_to_text, parse_module

log = logging.getLogger(__name__)


class GpuPluginMissingError(ImportError):
    """The CUDA PJRT plugin (deviceless GPU compile) is not installed."""


def require_gpu_plugin() -> None:
    """Raise ``GpuPluginMissingError`` unless the CUDA plugin can be imported.

    Raises:
      GpuPluginMissingError: with the command that installs it.
    """
    if not cuda_plugin.ensure_registered():  # site-packages install, or our private directory
        raise GpuPluginMissingError(
            "deviceless GPU compile needs the CUDA PJRT plugin, ptxas and libdevice: "
            "install them with `pip install -e .[gpu]` (nvidia-cuda-nvcc, nvidia-nvvm) and "
            "`python -m concerto_jax.deviceless.cuda_plugin install` (jax-cuda13-pjrt and "
            "jax-cuda13-plugin at the jax version, outside JAX's plugin discovery)")


def gpu_plugin_available() -> bool:
    """Whether ``require_gpu_plugin`` would pass."""
    try:
        require_gpu_plugin()
    except GpuPluginMissingError:
        return False
    return True


@functools.cache
def topology(cluster: Cluster):
    """The deviceless ``TopologyDescription`` of ``cluster`` (devices 0..n-1, host-major)."""
    require_gpu_plugin()
    return topologies.get_topology_desc(
        platform="cuda", topology_name=cluster.topology_name, topology=cluster.topology,
        target_config=cluster.target_config_text())


def target_mesh(cluster: Cluster | str, shape: Sequence[int], axis_names: Sequence[str],
                axis_types: Sequence[AxisType] | None = None):
    """A ``Mesh`` of a cluster's deviceless devices (row-major: the last axis is innermost).

    Args:
      cluster: a ``Cluster`` or its name in ``concerto_jax.costmodel.CLUSTERS`` (e.g.
        ``"h100_sxm_8"``, ``"h100_sxm_2x8"``).
      shape: mesh shape; its product must be the cluster's device count.
      axis_names: one name per mesh axis.
      axis_types: one ``jax.sharding.AxisType`` per axis, as ``jax.make_mesh`` takes them
        (e.g. ``AxisType.Explicit`` for a step written with explicit sharding). None: Auto.

    Raises:
      ValueError: unknown cluster name, a shape that does not cover the cluster, or
        ``axis_types`` of another length than ``shape``.
    """
    if isinstance(cluster, str):
        cluster = get_cluster(cluster)
    devices = sorted(topology(cluster).devices, key=lambda d: d.id)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} has {int(np.prod(shape))} devices; "
                         f"cluster {cluster.name!r} has {len(devices)}")
    axis_types = (AxisType.Auto,) * len(shape) if axis_types is None else tuple(axis_types)
    if len(axis_types) != len(shape):
        raise ValueError(f"target_mesh: {len(axis_types)} axis_types for a {len(shape)}-axis shape "
                         f"{tuple(shape)}; give one jax.sharding.AxisType per axis")
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names), axis_types=axis_types)


SCHEDULED_PASS = "apply-xla-transforms"
"""First pass of XLA's GPU post-scheduling pipelines (jaxlib 0.10.2); its ``before`` dump in
the pipeline ``SCHEDULED_MARKER`` names is the scheduled module ``RunPostSchedulingPipelines``
receives."""
SCHEDULED_MARKER = "post-scheduler-xla-transforms.after_pipeline-start.before_apply-xla-transforms"


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """One compile variant.

    Attributes:
      pgle_profile: path of a ``ProfiledInstructionsProto`` text file (see ``pgle``)
        for XLA's latency hiding scheduler; None for stock.
      windowed_einsum_mib: enable windowed einsum (collective matmul) for
        operands above this size in MiB; None leaves it off (XLA default).
      dump_lhs: also return the modules just before and after the latency hiding scheduler.
      dump_spmd: also return the per-device module right after SPMD partitioning.
      dump_scheduled: also return the module XLA's post-scheduling pipelines receive (the
        schedule of ``ScheduleGpuModule``: LHS's where it runs, the memory scheduler's where it
        does not, e.g. the A100 targets).
      extra: more XLA options (values must be Python bools where boolean).
    """

    pgle_profile: str | None = None
    windowed_einsum_mib: float | None = None
    dump_lhs: bool = True
    dump_spmd: bool = False
    dump_scheduled: bool = False
    extra: tuple[tuple[str, object], ...] = ()

    def compiler_options(self, dump_dir: str | None) -> dict[str, object]:
        opts: dict[str, object] = dict(self.extra)
        if self.pgle_profile is not None:
            opts["xla_gpu_pgle_profile_file_or_directory_path"] = os.fspath(self.pgle_profile)
        if self.windowed_einsum_mib is not None:
            opts["xla_gpu_threshold_for_windowed_einsum_mib"] = int(self.windowed_einsum_mib)
        if dump_dir is not None:
            opts["xla_dump_to"] = dump_dir
            # constants of more than a few elements are written "{...}" otherwise (a
            # partition-offset table of a 16-device mesh, a model's constant arrays), and
            # a module parsed back from the dump would hold other values
            opts["xla_dump_large_constants"] = True
            opts["xla_dump_hlo_pass_re"] = "|".join(
                (["spmd-partitioning"] if self.dump_spmd else []) + ["latency-hiding-scheduler"]
                + ([SCHEDULED_PASS] if self.dump_scheduled else []))
        return opts


@dataclasses.dataclass(frozen=True)
class TargetCompile:
    """Result of a deviceless compile.

    Attributes:
      cluster: the target.
      final_text: XLA's final scheduled module (``compiled.as_text()``).
      before_lhs_text: the module the latency hiding scheduler received (None if not dumped).
      after_lhs_text: the module right after it.
      compile_s: wall time of ``compile``.
      options: the XLA options used.
      post_spmd_text: the module right after SPMD partitioning (None unless ``dump_spmd``).
      compiled: JAX's ``Compiled`` object (None where the module was compiled outside JAX's jit).
      scheduled_text: the module XLA's post-scheduling pipelines received (None unless
        ``dump_scheduled``, or when XLA wrote no such dump).
    """

    cluster: Cluster
    final_text: str
    before_lhs_text: str | None
    after_lhs_text: str | None
    compile_s: float
    options: dict[str, object]
    post_spmd_text: str | None = None
    compiled: object = None
    scheduled_text: str | None = None


def _read_dump(dump_dir: str, marker: str) -> str | None:
    """The last dump whose name contains ``marker`` of the first module XLA compiled into
    ``dump_dir`` (on a GPU, autotuning may compile and dump candidate modules of its own, with
    higher module numbers)."""
    files = [f for f in glob.glob(os.path.join(dump_dir, "*.txt")) if marker in os.path.basename(f)]
    if not files:
        return None

    def module_number(path: str) -> int:
        m = re.match(r"module_(\d+)\.", os.path.basename(path))
        return int(m.group(1)) if m else -1

    first = min(module_number(f) for f in files)
    with open(sorted(f for f in files if module_number(f) == first)[-1]) as f:
        return f.read()


def lower_for_target(traced):
    """``traced.lower()`` for a deviceless target, host callbacks included.

    A step with ``jax.debug.print``, ``jax.debug.callback``, ``io_callback`` or
    ``pure_callback`` needs the target platform's client to lower its callbacks; without a
    GPU here it is lowered again with ``jax_compat.lowering_without_local_backend`` (the callbacks are
    never run: a deviceless executable cannot be executed).

    Raises:
      ValueError: the step still cannot be lowered for the target; says what to do.
    """
    try:
        return traced.lower()
    except RuntimeError as e:
        if "Unknown backend" not in str(e):
            raise
        first = e
    log.info("lowering again with host callbacks for a platform without a local client (%s)",
             str(first).splitlines()[0][:200])
    try:
        with jax_compat.lowering_without_local_backend():
            return traced.lower()
    except Exception as e:  # noqa: BLE001 - one clear error with both causes
        raise ValueError(
            f"compile_for_target: the step could not be lowered for the target without a local "
            f"GPU ({type(first).__name__}: {str(first).splitlines()[0][:200]}; again without the "
            f"platform's client: {type(e).__name__}: {str(e).splitlines()[0][:200]}). Host "
            "callbacks (jax.debug.print, io_callback, pure_callback) are the usual cause: compile "
            "a step without them for the target, or optimize() it on a machine with the GPU"
        ) from e


def compile_lowered(lowered, cluster: Cluster, options: CompileOptions = CompileOptions()) -> TargetCompile:
    """Compile a ``jax.stages.Lowered`` (traced on a mesh of ``target_mesh``) for ``cluster``.

    Args:
      lowered: ``jax.jit(f, in_shardings=...).trace(*abstract).lower()``.
      cluster: the target cluster (only used for the record; the mesh fixes the target).
      options: the compile variant.

    Returns:
      A ``TargetCompile`` with XLA's final module and, if asked, the LHS before/after pair.
    """
    require_gpu_plugin()
    dropped = jax_compat.drop_host_callbacks(lowered)
    if dropped:  # the compile-only client of a deviceless target takes none; it never runs them
        log.info("deviceless compile: %d host callback(s) not handed to the compile-only client", dropped)
    with tempfile.TemporaryDirectory(prefix="concerto_lhs_") as d:
        opts = options.compiler_options(d if options.dump_lhs or options.dump_spmd or options.dump_scheduled
                                        else None)
        t0 = time.perf_counter()
        with jax_compat.no_persistent_cache():  # a cache hit would dump nothing
            compiled = lowered.compile(compiler_options=opts)
        dt = time.perf_counter() - t0
        before = _read_dump(d, "before_latency-hiding-scheduler") if options.dump_lhs else None
        after = _read_dump(d, "after_latency-hiding-scheduler") if options.dump_lhs else None
        spmd = _read_dump(d, "after_spmd-partitioning") if options.dump_spmd else None
        if spmd is not None:  # XLA 0.12 drops the entry parameters' shardings after partitioning
            spmd = restore_parameter_shardings(spmd, _read_dump(d, "before_spmd-partitioning"))
        scheduled = _read_dump(d, SCHEDULED_MARKER) if options.dump_scheduled else None
    opts.pop("xla_dump_to", None)
    log.info("compiled for %s in %.1fs (options %s)", cluster.name, dt, opts)
    return TargetCompile(cluster, compiled.as_text(), before, after, dt, opts, spmd, compiled, scheduled)


def compile_fn(fn, abstract_args: Sequence, cluster: Cluster, *, in_shardings=None,
                       out_shardings=None, options: CompileOptions = CompileOptions()) -> TargetCompile:
    """``jax.jit(fn, in_shardings, out_shardings)`` traced on ``abstract_args`` and compiled for ``cluster``.

    The shardings must be over a mesh from ``target_mesh(cluster, ...)``.
    """
    kwargs = {}
    if in_shardings is not None:
        kwargs["in_shardings"] = in_shardings
    if out_shardings is not None:
        kwargs["out_shardings"] = out_shardings
    lowered = lower_for_target(jax.jit(fn, **kwargs).trace(*abstract_args))
    return compile_lowered(lowered, cluster, options)


def _copy_to_reshape(text: str) -> str:
    """A ``reshape`` to the same dimensions in place of every array ``copy`` (the deviceless
    compile path refuses to legalise ``mhlo.copy``; docs/ARCHITECTURE.md F3). A copy only ever
    changes the layout, never the values; the reshape keeps the copy's result layout, and XLA's
    layout assignment places the physical copy where it is still needed (the partitioner writes
    sharding constraints as layout-changing copies: an MoE step's dispatched tokens)."""
    module = parse_module(text, source="emitted")
    n = 0
    for comp in module.computations:
        for inst in [i for i in comp.instructions if i.opcode == "copy"]:
            (src,) = inst.operands
            if not inst.shape.is_array or src.shape.without_layout() != inst.shape.without_layout():
                continue
            new = Instruction(module.unique_name("copy_reshape"), "reshape", inst.shape, [src],
                              {k: v for k, v in inst.attrs.items() if k in ("metadata",)})
            comp.replace_instruction(inst, new)
            n += 1
    return module_to_text(module) if n else text


def own_compile_options(compiler_options=(), kernel_cache: str | None = None) -> dict:
    """The XLA options of a deviceless compile that ``compile_for_target`` runs for itself:
    ``jax_compat.deviceless_own_compile_options()`` under the user's ``compiler_options`` (a
    user's setting of the same option wins).

    ``kernel_cache``: a file for XLA's kernel cache (``xla_gpu_kernel_cache_file``), shared by
    the compiles of one call and deleted after it. XLA keys each kernel by its fused
    computation's text (constants included) and its arguments, never by name, and reuses the
    compiled binary; the entries are not keyed by target or compile options, so one file must
    never outlive the call (one target, one set of options)."""
    own = dict(jax_compat.deviceless_own_compile_options())
    if kernel_cache is not None:
        own[jax_compat.KERNEL_CACHE_OPTION] = kernel_cache
    return {**own, **dict(compiler_options)}


def compile_replicated_for_target(hlo_text: str, devices: Sequence, compiler_options: dict | None = None,
                                  *, after_lhs: bool = False):
    """Compile a replicated per-device module for the deviceless target of ``devices``.

    Returns:
      ``(final module text, before-LHS text or None, compile seconds)``; with ``after_lhs``
      a fourth item, the scheduled module XLA's post-scheduling pipelines received (after
      LHS where it ran; None when XLA wrote none).
    """
    devices = tuple(devices)
    module = parse_with_xla(_copy_to_reshape(hlo_text))
    mlir = jax_compat.hlo_to_stablehlo(module)
    opts = replicated_compile_options(devices)
    with tempfile.TemporaryDirectory(prefix="concerto_target_") as d:
        env = dict(compiler_options or {})
        env.update({"xla_dump_to": d, "xla_dump_hlo_pass_re": f"latency-hiding-scheduler|{SCHEDULED_PASS}"})
        opts.env_option_overrides = list(env.items())
        t0 = time.perf_counter()
        with jax_compat.mlir_module(mlir) as mod:
            exe = devices[0].client.compile(mod, executable_devices=jax_compat.device_list(devices),
                                            compile_options=opts)
        dt = time.perf_counter() - t0
        before = _read_dump(d, "before_latency-hiding-scheduler")
        after = _read_dump(d, SCHEDULED_MARKER) or _read_dump(d, "after_latency-hiding-scheduler")
    final = exe.hlo_modules()[0].to_string()
    return (final, before, dt, after) if after_lhs else (final, before, dt)


def devices_of(compiled) -> tuple:
    """Devices in partition order (partition ``i`` runs on the ``i``-th)."""
    try:
        return tuple(jax_compat.unloaded_executable(compiled).device_list)
    except AttributeError:  # another JAX layout: the shardings' device assignment
        leaves = [s for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "_device_assignment")]
        return tuple(leaves[0]._device_assignment)
