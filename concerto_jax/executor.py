"""Executor: compile a per-device HLO module for the mesh and call it like the original step.

A post-SPMD module is a per-device program whose collectives name devices by
partition id. XLA's Python path (HLO -> StableHLO -> compile) would partition
it again if compiled as SPMD, so we compile it as a *replicated* program:
``num_replicas = n``, ``num_partitions = 1``, replica ``i`` on the device that
ran partition ``i``. ``partition-id`` must therefore have been rewritten to
``replica-id`` (``hlo_passes`` does this before printing; see
``prepare_for_replicas``).

The calling convention is borrowed from the original compiled step: we swap
our executable into JAX's own ``MeshExecutable`` machinery, so argument
flattening, unused-argument pruning, donation, output shardings and weak types
are handled by JAX exactly as for the original.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax._src import stages
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import _jax
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir

import hlo_passes
from concerto_jax.custom_calls import check_carryable
from hlo_passes.rewrites import cpu_divide_by_broadcast

log = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """XLA rejected a module we emitted (a bug in a pass: the caller falls back)."""


def parse_with_xla(hlo_text: str):
    """Parse HLO text with XLA's own parser (raises ``ExecutorError`` naming XLA's complaint)."""
    try:
        return xc.hlo.hlo_module_from_text(hlo_text)
    except Exception as e:  # XLA raises XlaRuntimeError / ValueError depending on the path
        raise ExecutorError(f"XLA's HLO parser rejected the emitted module: {e}") from e


_DONOR_RE = re.compile(r"buffer_donor=\{((?:[^{}]|\{[^{}]*\})*)\}")


def donated_parameters(hlo_text: str) -> list[int]:
    """Entry parameters that the module header lists in ``buffer_donor={ (p, {}), ... }``.

    The HLO -> StableHLO conversion keeps ``input_output_alias`` (donation with
    a chosen output) but drops ``buffer_donor`` (donation XLA may use for any
    output), so the executor puts the latter back as ``jax.buffer_donor``
    argument attributes. Aliased parameters are not listed: marking them as
    donors too is rejected by XLA's verifier.
    """
    header = hlo_text.split("\n", 1)[0]
    m = _DONOR_RE.search(header)
    if not m:
        return []
    return sorted({int(x) for x in re.findall(r"\(\s*(\d+)\s*,", m.group(1))})


def _mark_donors(mlir_bytes: bytes, params: list[int]) -> str | bytes:
    """Add ``jax.buffer_donor = true`` to the given arguments of ``@main``."""
    if not params:
        return mlir_bytes
    with jax_mlir.make_ir_context() as ctx:
        module = ir.Module.parse(mlir_bytes, context=ctx)
        for op in module.body.operations:
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                n_args = len(op.regions[0].blocks[0].arguments)
                old = op.attributes["arg_attrs"] if "arg_attrs" in op.attributes else None
                dicts = []
                for i in range(n_args):
                    entries = {}
                    if old is not None:
                        d = ir.DictAttr(ir.ArrayAttr(old)[i])
                        entries = {d[j].name: d[j].attr for j in range(len(d))}
                    if i in params:
                        entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
                    dicts.append(ir.DictAttr.get(entries))
                op.attributes["arg_attrs"] = ir.ArrayAttr.get(dicts)
                break
        return str(module)


def compensate_round_trip(hlo_text: str, platform: str) -> str:
    """The module to hand to XLA so that it optimises it as it did the jitted program.

    Our module reaches XLA through HLO -> StableHLO -> HLO, and the last step runs
    MLIR canonicalisation, which folds reshape/broadcast chains the SPMD
    partitioner left. XLA:CPU's ``A / broadcast(B)`` rewrite depends on those
    chains (see ``hlo_passes.rewrites.cpu_divide_by_broadcast``), so on CPU it is
    applied here, before the conversion. Returns ``hlo_text`` unchanged when
    there is nothing to do.
    """
    if platform != "cpu" or " divide(" not in hlo_text:
        return hlo_text
    module = hlo_passes.parse_module(hlo_text, source="emitted")
    if not cpu_divide_by_broadcast(module):
        return hlo_text
    return hlo_passes.module_to_text(module)


def replicated_compile_options(devices) -> xc.CompileOptions:
    """``CompileOptions`` of a per-device module run as ``len(devices)`` replicas, replica i on ``devices[i]``."""
    n = len(devices)
    opts = xc.CompileOptions()
    build = opts.executable_build_options
    build.num_replicas = n
    build.num_partitions = 1
    build.use_spmd_partitioning = False
    build.device_assignment = xc.DeviceAssignment.create(
        np.array([d.id for d in devices], dtype=np.int64).reshape(n, 1))
    return opts


def compile_replicated(hlo_text: str, device_list, *,
                       compiler_options: Mapping[str, Any] | None = None,
                       host_callbacks: Sequence[Any] = ()):
    """Compile a per-device module as a replicated program on ``device_list``.

    Args:
      hlo_text: HLO text of the per-device module (``partition-id`` already
        rewritten to ``replica-id``).
      device_list: devices in partition order.
      compiler_options: extra XLA options (values as Python bool/int/str).
      host_callbacks: the original executable's host callbacks (its
        ``host_callbacks`` list, in order: the module's callback custom calls
        index it), kept alive by the compiled executable.

    Returns:
      (loaded executable, compile seconds).

    Raises:
      UnsupportedCustomCall: a custom call that cannot be carried (see ``custom_calls``).
      ExecutorError: XLA rejected the module.
    """
    t0 = time.perf_counter()
    devices = tuple(device_list)
    if " custom-call(" in hlo_text:
        # Refuse what the recompile could not run (before XLA sees it: a missing host
        # callback is a segmentation fault at run time, not an error).
        check_carryable(hlo_passes.parse_module(hlo_text, source="emitted"),
                        n_callbacks=len(host_callbacks), platform=devices[0].platform)
    module = parse_with_xla(compensate_round_trip(hlo_text, devices[0].platform))
    mlir = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
    mlir = _mark_donors(mlir, donated_parameters(hlo_text))
    opts = replicated_compile_options(devices)
    for key, value in (compiler_options or {}).items():
        opts.env_option_overrides = list(opts.env_option_overrides) + [(key, value)]
    client = devices[0].client
    try:
        if host_callbacks:
            # Only the ir.Module overload takes host callbacks (as JAX's own compile does).
            with jax_mlir.make_ir_context() as ctx:
                module_ir = ir.Module.parse(mlir, context=ctx)
                exe = client.compile_and_load(
                    module_ir, executable_devices=xc.DeviceList(devices), compile_options=opts,
                    host_callbacks=list(host_callbacks))
        else:
            exe = client.compile_and_load(mlir, xc.DeviceList(devices), opts)
    except Exception as e:
        raise ExecutorError(f"XLA failed to compile the emitted module: {e}") from e
    return exe, time.perf_counter() - t0


def swap_executable(original: Any, loaded_executable: Any) -> Any:
    """A ``jax.stages.Compiled`` that calls ``loaded_executable`` with ``original``'s convention.

    Args:
      original: the ``Compiled`` object of the user's jitted step (from capture).
      loaded_executable: our compiled replicated program over the same devices.

    Returns:
      A ``Compiled`` whose ``__call__`` takes the same (dynamic) arguments as
      ``original`` and returns the same pytree with the same shardings.
    """
    mesh_exe = original._executable
    unloaded = mesh_exe._unloaded_executable
    ours = dataclasses.replace(unloaded, xla_executable=loaded_executable, pgle_profiler=None)
    loaded = ours.load()
    _assemble_outputs(loaded.unsafe_call)
    params = original._params
    compiled = stages.Compiled(loaded, params.const_args, original.args_info,
                               original.out_tree, original._no_kwargs,
                               params.in_types, params.out_types)
    # JAX's C++ dispatch of later calls builds the outputs itself, from the runtime's view
    # of them (see _assemble_outputs): every call goes through the Python path instead.
    compiled_params = compiled._params

    def call(*args, **kwargs):
        outs, _, _ = stages.Compiled.call(compiled_params, *args, **kwargs)
        return outs

    compiled._call = call
    return compiled


def _assemble_outputs(call) -> None:
    """Build each output of a replicated executable from its per-device buffers.

    The executable runs ``n`` replicas, so the runtime describes each output as one
    replicated array of the per-device shape. JAX's result handlers (C++) wrap that array
    as is under the step's global shape and sharding, and jaxlib >= 0.11 reads it whole
    (``np.asarray`` copies it in one go): "Shape mismatch during ToLiteral conversion".
    A Python handler receives the per-device buffers instead; they are assembled into
    the physical array of the step's global shape first, then handed to JAX's handler.
    """
    import jax
    from jax._src import core, dtypes
    from jax._src.interpreters import pxla
    from jax._src.sharding_impls import physical_sharding

    out = call.out_handler
    handlers = []
    for handler, aval, sharding in zip(out.handlers, out.out_avals, out.out_shardings, strict=True):
        phys_aval = core.physical_aval(aval)
        extended = dtypes.issubdtype(aval.dtype, dtypes.extended)
        phys_sharding = physical_sharding(aval, sharding) if extended else sharding

        def assemble(buffers, handler=handler, shape=phys_aval.shape, sharding=phys_sharding):
            return handler(jax.make_array_from_single_device_arrays(shape, sharding, buffers))

        handlers.append(assemble)
    call.out_handler = pxla.ResultsHandler(handlers, out.out_shardings, out.out_avals)
