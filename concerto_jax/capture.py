"""Capture: from a jitted step and example arguments, the per-device module after SPMD partitioning.

This is the first stage of the pipeline. It lowers and compiles the user's
jitted function once with XLA's HLO dump switched on for the
``spmd-partitioning`` pass, and keeps what later stages need:

* the post-SPMD per-device HLO text (explicit collectives, per-device shapes);
* the compiled executable of the *original* program, whose calling convention
  (pytree, kept arguments, donation, in/out shardings, weak types) the
  executor reuses so that an optimised step is called exactly like the
  original one;
* the device assignment (partition ``i`` runs on ``device_list[i]``).

The dump recipe was checked on jax 0.11.2 and 0.12.0.1 (pass names in
``concerto_jax.jax_compat``). From XLA 0.12 the post-partitioning module no longer carries
the entry parameters' ``sharding`` attributes; they are copied from the partitioner's input
(the same dump's ``before_spmd-partitioning`` module, :func:`restore_parameter_shardings`),
since what each device holds of a parameter is what ``hlo_passes.ir.uniformity`` proves
replication from.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from concerto_jax import jax_compat

log = logging.getLogger(__name__)

_SPMD_DUMP_GLOB = f"*after_{jax_compat.SPMD_PASS}*.txt"
_UNPARTITIONED_DUMP_GLOB = "*before_optimizations.txt"
_PARTITIONER_INPUT_GLOB = f"*before_{jax_compat.SPMD_PASS}*.txt"
_PARAMETER_RE = re.compile(r"^(\s*(?:ROOT\s+)?\S+ = .*? parameter\((\d+)\))(.*)$")


class CaptureError(RuntimeError):
    """XLA did not produce the module we expected (a dump is missing or ambiguous)."""


@dataclasses.dataclass(frozen=True)
class StaticSplit:
    """Which positional/keyword arguments of a jitted function are static."""

    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]

    def dynamic(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """The arguments a compiled executable is called with (static ones removed)."""
        n = len(args)
        drop = {i % n for i in self.static_argnums if -n <= i < n} if n else set()
        dyn_args = tuple(a for i, a in enumerate(args) if i not in drop)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return dyn_args, dyn_kwargs

    def static_values(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
        """The static argument values (they are part of the cache key)."""
        n = len(args)
        pos = tuple((i, args[i]) for i in sorted({i % n for i in self.static_argnums if -n <= i < n}))
        kw = tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
        return pos + kw


def jit_info(fn: Any) -> StaticSplit:
    """Static-argument information of a ``jax.jit``-wrapped function.

    Raises:
      TypeError: if ``fn`` is not a function wrapped by ``jax.jit``.
    """
    info = getattr(fn, "_jit_info", None)
    if info is None or not hasattr(fn, "lower"):
        raise TypeError(
            "concerto_jax.optimize expects a function wrapped by jax.jit (with in/out "
            f"shardings on a Mesh, or shard_map inside), got {fn!r} of type "
            f"{type(fn).__name__}. Wrap it first: optimize(jax.jit(step, in_shardings=..., "
            "out_shardings=...)), or put @concerto_jax.optimize above @jax.jit."
        )
    return StaticSplit(tuple(info.static_argnums), tuple(info.static_argnames))


@dataclasses.dataclass(frozen=True)
class Capture:
    """What the capture stage hands to the rest of the pipeline.

    Attributes:
      hlo_text: the per-device module after SPMD partitioning (or, for a program
        on one device, the module before optimisations).
      compiled: XLA's compiled executable of the original program (``jax.stages.Compiled``).
      device_list: devices in partition order (``device_list[i]`` runs partition ``i``).
      num_partitions: number of SPMD partitions (devices) of the program.
      seconds: wall time of lowering + compiling + reading the dump.
      reference: ``compiled`` was compiled as the original step is (JAX's defaults plus
        ``Options.compiler_options``, not the capture's reduced level): the first-step check may
        run it as the original instead of compiling the step again.
    """

    hlo_text: str
    compiled: Any
    device_list: tuple
    num_partitions: int
    seconds: float
    reference: bool = False

    @property
    def input_shardings(self):
        return self.compiled.input_shardings

    @property
    def output_shardings(self):
        return self.compiled.output_shardings

    @property
    def _unloaded(self):
        return jax_compat.unloaded_executable(self.compiled)

    @property
    def output_avals(self):
        """Global avals of the outputs (flat, in executable order)."""
        return self._unloaded.output_avals

    @property
    def flat_output_shardings(self):
        """Shardings of the outputs (flat, in executable order, like ``output_avals``)."""
        return self._unloaded.output_shardings

    @property
    def host_callbacks(self) -> tuple:
        """The Python callables that the module's host-callback custom calls index."""
        return tuple(self._unloaded.host_callbacks)

    @property
    def has_effects(self) -> bool:
        """Whether the step has side effects (debug.print, io_callback: ordered or not)."""
        return bool(self._unloaded.ordered_effects or self._unloaded.unordered_effects)


def _read_single(pattern: str, directory: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(directory, pattern)))
    if not paths:
        return None
    modules = {os.path.basename(p).split(".")[0] for p in paths}
    if len(modules) > 1:
        raise CaptureError(
            f"expected the dump of one module in {directory}, found {len(modules)} "
            f"({sorted(modules)}); does the function compile more than one program?"
        )
    with open(paths[-1]) as f:
        return f.read()


def _entry_lines(text: str) -> tuple[int, int] | None:
    """``[start, end)`` line indices of the ENTRY computation's body in a dumped module."""
    lines = text.split("\n")
    start = next((k for k, line in enumerate(lines) if line.startswith("ENTRY ")), None)
    if start is None:
        return None
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("}")), None)
    return None if end is None else (start + 1, end)


def _sharding_attr(attrs: str) -> str | None:
    """The ``sharding={...}`` attribute (braces balanced, quotes skipped) in the text after
    an instruction's operands, or None."""
    at = attrs.find(", sharding={")
    if at < 0:
        return None
    i = start = at + len(", ")
    i = attrs.index("{", i)
    depth, quote = 0, None
    while i < len(attrs):
        c = attrs[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return attrs[start:i + 1]
        i += 1
    return None


def restore_parameter_shardings(partitioned: str, unpartitioned: str | None) -> str:
    """``partitioned`` with each ENTRY parameter that has no ``sharding`` given the one the
    same parameter has in ``unpartitioned`` (the partitioner's input: the same parameters,
    by number, at their global shapes).

    XLA up to 0.11 printed the entry parameters' shardings in the module after
    ``spmd-partitioning``; XLA 0.12 drops them there (they are still on the module it
    partitioned). Returns ``partitioned`` unchanged when there is nothing to copy or the
    two modules' entry parameters do not correspond.
    """
    if not unpartitioned:
        return partitioned
    src_span, dst_span = _entry_lines(unpartitioned), _entry_lines(partitioned)
    if src_span is None or dst_span is None:
        return partitioned
    src_lines = unpartitioned.split("\n")[src_span[0]:src_span[1]]
    shardings: dict[int, str | None] = {}
    for line in src_lines:
        m = _PARAMETER_RE.match(line)
        if m is not None:
            shardings[int(m.group(2))] = _sharding_attr(m.group(3))
    lines = partitioned.split("\n")
    found, changed = {}, False
    for k in range(*dst_span):
        m = _PARAMETER_RE.match(lines[k])
        if m is not None:
            found[int(m.group(2))] = k
    if sorted(found) != sorted(shardings):
        return partitioned
    for number, k in found.items():
        m = _PARAMETER_RE.match(lines[k])
        if shardings[number] is None or _sharding_attr(m.group(3)) is not None:
            continue
        lines[k] = f"{m.group(1)}, {shardings[number]}{m.group(3)}"
        changed = True
    return "\n".join(lines) if changed else partitioned


def capture(fn: Any, args: tuple, kwargs: Mapping[str, Any] | None = None, *,
            compiler_options: Mapping[str, Any] | None = None,
            keep_dump_dir: str | None = None) -> Capture:
    """Lower and compile ``fn(*args, **kwargs)`` and return its post-SPMD module.

    Args:
      fn: a ``jax.jit``-wrapped function.
      args, kwargs: example arguments (arrays or ShapeDtypeStructs with shardings).
      compiler_options: extra XLA compiler options for the capture compile.
      keep_dump_dir: if given, XLA's dump is written there and kept (for debugging);
        otherwise a temporary directory is used and removed.

    Returns:
      A ``Capture``.

    Raises:
      TypeError: ``fn`` is not jitted (from ``jit_info``), or JAX rejects the arguments.
      CaptureError: XLA wrote no post-partitioning dump.
    """
    jit_info(fn)
    kwargs = dict(kwargs or {})
    t0 = time.perf_counter()
    dump_dir = keep_dump_dir or tempfile.mkdtemp(prefix="concerto_capture_")
    try:
        lowered = fn.lower(*args, **kwargs)
        options = {
            "xla_dump_to": dump_dir,
            "xla_dump_hlo_pass_re": jax_compat.SPMD_PASS,
            "xla_dump_hlo_as_text": True,
            "xla_dump_large_constants": True,
            # This executable is never run (only its calling convention is reused),
            # so skip the expensive LLVM work: about 35% less capture time on CPU.
            "xla_backend_optimization_level": 0,
            "xla_llvm_disable_expensive_passes": True,
        }
        options.update(compiler_options or {})
        with jax_compat.no_persistent_cache():  # a cache hit would dump nothing
            compiled = lowered.compile(compiler_options=options)
        text = _read_single(_SPMD_DUMP_GLOB, dump_dir)
        if text is not None:
            text = restore_parameter_shardings(text, _read_single(_PARTITIONER_INPUT_GLOB, dump_dir))
        if text is None:
            text = _read_single(_UNPARTITIONED_DUMP_GLOB, dump_dir)
        if text is None:
            raise CaptureError(
                f"XLA wrote no post-SPMD (or pre-optimisation) module into {dump_dir}; "
                "is the XLA_FLAGS environment variable overriding --xla_dump_to?"
            )
    finally:
        if keep_dump_dir is None:
            shutil.rmtree(dump_dir, ignore_errors=True)
    device_list = tuple(jax_compat.unloaded_executable(compiled).device_list)
    seconds = time.perf_counter() - t0
    log.info("captured %s: %d partitions, %d lines of HLO in %.2fs",
             getattr(fn, "__name__", "step"), len(device_list), text.count("\n"), seconds)
    return Capture(hlo_text=text, compiled=compiled, device_list=device_list,
                   num_partitions=len(device_list), seconds=seconds)
