"""Custom calls: which ones a recompiled post-SPMD module can carry, decided before compiling.

A custom call names code that lives outside the HLO module. Recompiling the
post-SPMD module (``concerto_jax.executor.compile_replicated``) keeps the call
but not always what it points to:

* JAX's host callbacks (``jax.debug.print``, ``jax.pure_callback``,
  ``jax.experimental.io_callback``; ordered or not) lower to the typed-FFI
  targets ``xla_ffi_python_{cpu,gpu}_callback`` (and ``_partitioned_`` forms)
  whose ``backend_config={index = i : ui64}`` indexes the list of Python
  callables handed to XLA at compile time. The executor passes the original
  executable's list (``host_callbacks``), so index ``i`` names the same callable;
  an index past that list would make XLA call through a missing entry (the
  segmentation fault this module exists to prevent);
* older descriptor-based callbacks (``xla_python_{cpu,gpu}_callback``) embed a
  host pointer in the module: never carried;
* any other target is carried only if it is registered for the platform
  (``xla_client.custom_call_targets``: LAPACK, cuSOLVER, user FFI kernels...);
  an unregistered one is refused before XLA sees it.

``check_carryable`` raises ``UnsupportedCustomCall`` (the caller falls back to
the original step with one warning) instead of letting XLA compile a module it
cannot run safely.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from concerto_jax import jax_compat
from hlo_passes.ir import HloModule

__all__ = ["CustomCallInfo", "UnsupportedCustomCall", "check_carryable", "custom_calls"]


class UnsupportedCustomCall(RuntimeError):
    """The module holds a custom call the recompiled program could not run safely."""


@dataclasses.dataclass(frozen=True)
class CustomCallInfo:
    """One custom-call instruction: its name, target and callback index (if any)."""

    name: str
    target: str
    callback_index: int | None
    has_side_effect: bool


_INDEX_RE = re.compile(r"\bindex\s*=\s*(\d+)")


def custom_calls(module: HloModule) -> list[CustomCallInfo]:
    """Every custom call of ``module`` (all computations), in program order."""
    out = []
    for inst in module.instructions():
        if inst.opcode != "custom-call":
            continue
        target = str(inst.attr("custom_call_target", "")).strip('"')
        m = _INDEX_RE.search(str(inst.attr("backend_config", "")))
        out.append(CustomCallInfo(
            name=inst.name, target=target,
            callback_index=int(m.group(1)) if m else None,
            has_side_effect=str(inst.attr("custom_call_has_side_effect", "false")) == "true"))
    return out


# -- rules, keyed by target ---------------------------------------------------------
# A rule returns None when the call can be carried, else the reason it cannot.
Rule = Callable[[CustomCallInfo, int, str], "str | None"]


def _python_ffi_callback(call: CustomCallInfo, n_callbacks: int, platform: str) -> str | None:
    if call.callback_index is None:
        return f"host callback {call.name} has no callback index in its backend_config"
    if call.callback_index >= n_callbacks:
        return (f"host callback {call.name} refers to callback #{call.callback_index} but the "
                f"original executable holds {n_callbacks}")
    return None


def _never(call: CustomCallInfo, n_callbacks: int, platform: str) -> str | None:
    return (f"custom call {call.name} ({call.target}) embeds a host pointer that a recompiled "
            "module cannot carry")


def _registered(call: CustomCallInfo, n_callbacks: int, platform: str) -> str | None:
    """Default rule: targets registered with XLA for the platform compile to the same kernel."""
    if call.target in jax_compat.custom_call_targets(platform):
        return None
    return (f"custom call {call.name} targets {call.target!r}, which is not registered for "
            f"platform {platform!r}")


RULES: dict[str, Rule] = {
    "xla_ffi_python_cpu_callback": _python_ffi_callback,
    "xla_ffi_python_gpu_callback": _python_ffi_callback,
    "xla_ffi_partitioned_python_cpu_callback": _python_ffi_callback,
    "xla_ffi_partitioned_python_gpu_callback": _python_ffi_callback,
    "xla_python_cpu_callback": _never,
    "xla_python_gpu_callback": _never,
}
"""Rules by custom-call target; targets not listed get ``_registered``."""


def check_carryable(module: HloModule, *, n_callbacks: int, platform: str) -> int:
    """Check that every custom call of ``module`` can be carried into a recompile.

    Args:
      module: the module about to be compiled.
      n_callbacks: length of the host-callback list the compile will receive.
      platform: the devices' platform (``"cpu"``, ``"cuda"``...).

    Returns:
      The number of custom calls found.

    Raises:
      UnsupportedCustomCall: naming the first call that cannot be carried and why.
    """
    calls = custom_calls(module)
    for call in calls:
        reason = RULES.get(call.target, _registered)(call, n_callbacks, platform)
        if reason is not None:
            raise UnsupportedCustomCall(
                f"{reason}; the recompiled module could not run it safely")
    return len(calls)
