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

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from concerto_jax import jax_compat
from concerto_jax.custom_calls import check_carryable
from hlo_passes.cpu_compensation import cpu_divide_by_broadcast, cpu_widen_mixed_dots
from hlo_passes.ir import module_to_text, parse_module

log = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """XLA rejected a module we emitted (a bug in a pass: the caller falls back)."""


def parse_with_xla(hlo_text: str):
    """Parse HLO text with XLA's own parser (raises ``ExecutorError`` naming XLA's complaint)."""
    try:
        return jax_compat.hlo_module_from_text(hlo_text)
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
    ir = jax_compat.mlir_ir()
    with jax_compat.mlir_module(mlir_bytes) as module:
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
    chains (see ``hlo_passes.cpu_compensation.cpu_divide_by_broadcast``), so on CPU it is
    applied here, before the conversion. So is the widening of f32 dots of half-precision
    operands, some of which XLA:CPU's runtime refuses (``cpu_widen_mixed_dots``). Returns
    ``hlo_text`` unchanged when there is nothing to do.
    """
    if platform != "cpu" or (" divide(" not in hlo_text and " dot(" not in hlo_text):
        return hlo_text
    module = parse_module(hlo_text, source="emitted")
    changed = cpu_divide_by_broadcast(module) if " divide(" in hlo_text else 0
    # XLA:CPU's runtime refuses some f32 dots of bf16 operands (decompose's partial chunks)
    changed += cpu_widen_mixed_dots(module)
    if not changed:
        return hlo_text
    return module_to_text(module)


def replicated_compile_options(devices, env: Mapping[str, Any] | None = None):
    """``CompileOptions`` of a per-device module run as ``len(devices)`` replicas, replica i
    on ``devices[i]``, with XLA option overrides ``env``."""
    return jax_compat.compile_options([d.id for d in devices], num_replicas=len(devices),
                                      num_partitions=1, spmd=False, env=dict(env or {}))


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
        check_carryable(parse_module(hlo_text, source="emitted"),
                        n_callbacks=len(host_callbacks), platform=devices[0].platform)
    module = parse_with_xla(compensate_round_trip(hlo_text, devices[0].platform))
    mlir = jax_compat.hlo_to_stablehlo(module)
    mlir = _mark_donors(mlir, donated_parameters(hlo_text))
    opts = replicated_compile_options(devices, compiler_options)
    client = devices[0].client
    try:
        if host_callbacks:
            # Only the ir.Module overload takes host callbacks (as JAX's own compile does).
            with jax_compat.mlir_module(mlir) as module_ir:
                exe = client.compile_and_load(
                    module_ir, executable_devices=jax_compat.device_list(devices),
                    compile_options=opts, host_callbacks=list(host_callbacks))
        else:
            exe = client.compile_and_load(mlir, jax_compat.device_list(devices), opts)
    except Exception as e:
        raise ExecutorError(f"XLA failed to compile the emitted module: {e}") from e
    return exe, time.perf_counter() - t0


def check_signature(captured_text: str, module_text: str) -> None:
    """Raise ``ExecutorError`` unless ``module_text``'s entry takes and returns per-device
    shapes (layouts included) equal to the captured module's.

    The runtime loads an executable behind the original step's header without comparing the
    two (a wrong output shape runs, and fails only when the output is read), so a pass that
    changed the signature must be caught here.
    """
    def signature(text: str, source: str):
        entry = parse_module(text, source=source).entry
        return [str(p.shape) for p in entry.parameters], str(entry.root.shape)

    want, got = signature(captured_text, "captured"), signature(module_text, "emitted")
    if want != got:
        what = "parameters" if want[0] != got[0] else "results"
        raise ExecutorError(f"the emitted module's entry {what} differ from the step's "
                            f"(expected {want[0] if what == 'parameters' else want[1]}, found "
                            f"{got[0] if what == 'parameters' else got[1]})")


_NO_FAST_PATH: set[str] = set()
"""Reasons (per process) why an executable was swapped in without JAX's C++ dispatch."""


def swap_executable(original: Any, loaded_executable: Any) -> Any:
    """A ``jax.stages.Compiled`` that calls ``loaded_executable`` with ``original``'s convention.

    Our executable runs ``n`` replicas, so the runtime describes its outputs per device.
    It is reloaded behind the original step's serialization header
    (``jax_compat.behind_header``): the runtime then describes the outputs as the step's
    global arrays and JAX's C++ dispatch serves every call, at plain ``jit`` cost. Where
    the client cannot serialize, every output is assembled from its per-device buffers
    instead, through JAX's Python dispatch (logged once).

    Args:
      original: the ``Compiled`` object of the user's jitted step (from capture).
      loaded_executable: our compiled replicated program over the same devices, whose
        signature ``check_signature`` accepted.

    Returns:
      A ``Compiled`` whose ``__call__`` takes the same (dynamic) arguments as
      ``original`` and returns the same pytree with the same shardings.
    """
    unloaded = jax_compat.unloaded_executable(original)
    try:
        reloaded = jax_compat.behind_header(
            jax_compat.xla_executable(original), jax_compat.pjrt_payload(loaded_executable),
            unloaded.device_list, unloaded.host_callbacks)
    except Exception as e:  # noqa: BLE001 - a client without serialization: assemble instead
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if reason not in _NO_FAST_PATH:
            _NO_FAST_PATH.add(reason)
            log.warning("our executable could not be reloaded behind the step's header (%s); its "
                        "outputs are assembled per call, through JAX's Python dispatch", reason)
        return jax_compat.swapped_step(original, loaded_executable, assemble_outputs=True)
    return jax_compat.swapped_step(original, reloaded, assemble_outputs=False)
