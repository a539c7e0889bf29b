"""The plan cache's key: what determines a plan, in canonical JSON (``concerto_jax.plan_cache``).

Every part is known before any XLA compile runs::

    program   SHA-256 of the lowered StableHLO text (shardings, donation and constants are in
              it), its devices (platform, kind, id, process, in the assignment's order), the
              jit's compiler options, the number of processes
    options   every Options field that can change the plan; PLAN_NEUTRAL ones are left out
    code      jax / jaxlib versions, XLA_FLAGS (dump flags left out), this package's version and
              the SHA-256 of its source (concerto_jax/, hlo_passes/: the version string does not
              change between commits)

A pass registered at run time is code the key cannot see: ``registered_passes`` says so.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from concerto_jax import jax_compat
from hlo_passes.registry import PASS_TABLE, PASSES, load

PLAN_NEUTRAL = frozenset({"dump_dir", "fallback", "cache_dir", "optimize"})
"""Options fields left out of the key: where the modules are dumped, what a failure does, where
the cache is, and ``optimize``'s group: the first-step check (it decides whether a
reassociating pass runs, and that reaches the key through ``passes``) and whether an unchanged
module is recompiled (the plan is the same; the executable has its own key)."""
SOURCE_PACKAGES = ("concerto_jax", "hlo_passes")
"""The packages whose source is part of the key."""
_SOURCE_SUFFIXES = (".py", ".txtpb", ".c", ".h")


def canonical(value: Any) -> Any:
    """A JSON value standing for ``value``: dataclasses field by field (all fields, also those
    left out of their ``repr``), mappings with sorted string keys, sequences as lists.

    Raises:
      TypeError: a value with no stable form (a function, an arbitrary object).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and nan/inf stay JSON
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__type__": type(value).__qualname__,
                **{f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)):
        return [canonical(v) for v in value]
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars
        return canonical(value.item())
    raise TypeError(f"no stable form for a {type(value).__name__} in the options")


def options_part(options) -> dict:
    """Every field of ``options`` that can change the plan, canonically."""
    return {f.name: canonical(getattr(options, f.name)) for f in dataclasses.fields(options)
            if f.name not in PLAN_NEUTRAL}


@functools.cache
def code_part() -> dict:
    """The installed JAX, XLA's flags and this package's version and source (once per process;
    XLA_FLAGS as at the first call)."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        top = os.path.dirname(importlib.import_module(package).__file__)
        for folder, dirs, files in sorted(os.walk(top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(_SOURCE_SUFFIXES):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, top).encode() + b"\0")
                    with open(path, "rb") as f:
                        digest.update(hashlib.sha256(f.read()).digest())
    try:
        version = importlib.metadata.version("concerto_jax")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_dump")]
    jax_version, jaxlib_version = jax_compat.jax_versions()
    return {"concerto_jax": version, "source_sha256": digest.hexdigest(), "jax": jax_version,
            "jaxlib": jaxlib_version, "xla_flags": flags}


def devices_part(devices: Sequence) -> list:
    """``[platform, kind, id, process]`` of each device, in order."""
    return [[d.platform, getattr(d, "device_kind", ""), d.id, getattr(d, "process_index", 0)]
            for d in devices]


def program_part(lowered) -> dict:
    """The lowered program: its text's SHA-256, its devices and the jit's compiler options.

    Raises:
      RuntimeError: the lowering names no devices (nothing to key the plan by).
    """
    devices, jit_options = jax_compat.lowering_facts(lowered)
    if devices is None:
        raise RuntimeError("the lowering has no device assignment")
    text = lowered.as_text()
    return {"stablehlo_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "devices": devices_part(devices), "jit_compiler_options": canonical(dict(jit_options)),
            "processes": jax.process_count()}


def registered_passes(names: Sequence[str]) -> bool:
    """Whether every pass named is the one ``hlo_passes.registry.PASS_TABLE`` registers (a pass
    registered or replaced at run time is code the key cannot see)."""
    for name in names:
        spec = PASS_TABLE.get(name)
        if spec is None:
            return False
        if PASSES[name] is not load(spec):
            return False
    return True
