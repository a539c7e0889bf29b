"""First-step check: compare the first optimised call with the original step, fall back on a difference.

The safety net behind ``Options.optimize.check_first_step``. On the first call of a
signature whose module was recompiled, the original jitted step runs on a
*copy* of the inputs (it may donate them) and our executable on the user's
inputs; the outputs are compared bit for bit, or within the tolerance the
passes declared (``PassOutcome.tolerance``: relative to the largest magnitude
of the original leaf). On a difference the caller returns the original's
outputs (computed on identical inputs, so exactly what the user would have got)
and falls back for good.

Cost: one more compile (JAX's own, of the original step) and one more step on
the first call; memory for a copy of the inputs and one extra set of outputs.

With ``Options.optimize.first_step_reference="wider"``, outputs past the tolerance get a second
judge: the step run in wider precision (``pipeline.wider_text``), against which the
optimised outputs must be as accurate as the original's (``less_accurate``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

# The copy of the inputs plus one extra output set must fit in this fraction of
# the free memory (the step itself still needs its temporaries).
_HEADROOM = 0.5


def _shard_bytes_by_device(leaves: Sequence[Any]) -> dict:
    out: dict = {}
    for x in leaves:
        if not isinstance(x, jax.Array):
            continue
        for s in x.addressable_shards:
            data = s.data
            nbytes = data.size * data.dtype.itemsize
            if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
                nbytes = jax.random.key_data(data).nbytes
            out[s.device] = out.get(s.device, 0) + nbytes
    return out


def _out_bytes_by_device(out_avals, out_shardings) -> dict:
    out: dict = {}
    for aval, sharding in zip(out_avals, out_shardings, strict=True):
        shape = sharding.shard_shape(aval.shape)
        dtype = aval.dtype
        itemsize = dtype.itemsize
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            itemsize = 8
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        for d in sharding.addressable_devices:
            out[d] = out.get(d, 0) + nbytes
    return out


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(arg_leaves: Sequence[Any], out_avals, out_shardings,
                   copies: int = 1) -> tuple[bool, str]:
    """Whether ``copies`` copies of the inputs and as many extra output sets fit comfortably
    in free memory.

    Devices with ``memory_stats()`` (GPU, TPU) are judged one by one against
    ``bytes_limit - bytes_in_use``; devices without (the CPU backend, whose
    "devices" share the host's memory) are judged together against the host's
    available memory. "Comfortably" means at most half of it.

    Returns:
      (fits, a sentence saying what was compared).
    """
    need = _shard_bytes_by_device(arg_leaves)
    for d, b in _out_bytes_by_device(out_avals, out_shardings).items():
        need[d] = need.get(d, 0) + b
    need = {d: copies * b for d, b in need.items()}
    host_need = 0
    for device, nbytes in need.items():
        stats = None
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            if nbytes > _HEADROOM * free:
                return False, (f"{device} needs {nbytes} bytes for the copies, more than half "
                               f"of its {free} free bytes")
        else:
            host_need += nbytes
    if host_need:
        free = _host_available_bytes()
        if free is None or host_need > _HEADROOM * free:
            return False, (f"the host needs {host_need} bytes for the copies; available: "
                           f"{free}")
    total = sum(need.values())
    return True, f"copies take {total} bytes, within half of the free memory"


def copy_arrays(tree: Any) -> Any:
    """A copy of every ``jax.Array`` leaf of ``tree`` (same shardings, same committedness).

    An uncommitted argument (created without a device, e.g. ``jnp.ones``) stays
    uncommitted: committing it would make jit reject it next to sharded arguments.
    """
    leaves, treedef = jax.tree.flatten(tree)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            if getattr(x, "_committed", True):
                leaves[i] = jax.device_put(x, x.sharding, may_alias=False)
            else:
                leaves[i] = jax.device_put(x, may_alias=False)
    return jax.tree.unflatten(treedef, leaves)


def _host_shards(x: jax.Array) -> list[np.ndarray]:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return [np.asarray(s.data) for s in shards]


def _is_float(dtype) -> bool:
    return bool(jax.dtypes.issubdtype(dtype, np.inexact))


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bits (so NaN payloads and the sign of zero count, as in a bitwise check)."""
    size = a.dtype.itemsize
    return a.view(np.dtype(f"u{size}")) if size in (1, 2, 4, 8) else a.view(np.uint8)


def differences(reference: Any, got: Any, tolerance: float = 0.0, limit: int = 5) -> list[str]:
    """Leaves where ``got`` differs from ``reference`` (bitwise, or beyond ``tolerance``).

    Compares this process's shards only (every process compares its own).
    ``tolerance`` is relative to the largest magnitude of the reference leaf.
    """
    ref_leaves, ref_tree = jax.tree_util.tree_flatten_with_path(reference)
    got_leaves, got_tree = jax.tree.flatten(got)
    if ref_tree != jax.tree.structure(got) or len(ref_leaves) != len(got_leaves):
        return [f"output structure differs: {got_tree} vs {ref_tree}"]
    bad = []
    for (path, r), g in zip(ref_leaves, got_leaves, strict=True):
        name = jax.tree_util.keystr(path) or "<output>"
        if not isinstance(r, jax.Array) or not isinstance(g, jax.Array):
            if not np.array_equal(np.asarray(r), np.asarray(g)):
                bad.append(f"{name}: values differ")
            continue
        if r.dtype != g.dtype or r.shape != g.shape:
            bad.append(f"{name}: {g.dtype}{g.shape} vs {r.dtype}{r.shape}")
            continue
        for rs, gs in zip(_host_shards(r), _host_shards(g), strict=True):
            if tolerance > 0 and _is_float(rs.dtype) and not np.iscomplexobj(rs):
                a, b = rs.astype(np.float64), gs.astype(np.float64)
                finite = np.abs(a[np.isfinite(a)])  # an inf or NaN sets no scale
                scale = float(finite.max()) if finite.size else 0.0
                ok = np.allclose(b, a, rtol=tolerance, atol=tolerance * scale, equal_nan=True)
            else:
                ok = np.array_equal(_bits(rs), _bits(gs))
            if not ok:
                diff = ""
                if _is_float(rs.dtype) and not np.iscomplexobj(rs):
                    with np.errstate(invalid="ignore"):
                        d = np.abs(rs.astype(np.float64) - gs.astype(np.float64))
                    d = d[np.isfinite(d)]
                    diff = f" (max |diff| {d.max():.3g})" if d.size else " (non-finite values differ)"
                bad.append(f"{name}: values differ{diff}")
                break
        if len(bad) >= limit:
            break
    return bad


SPREAD_FACTOR = 4.0
"""How far (per leaf, largest absolute difference) the optimised outputs may be from the
original's where the original itself is not reproducible, in units of the original's own
run-to-run difference on that leaf (``within_spread``)."""

SPREAD_REPEATS = 2
"""At most how many more runs of the original the spread judge makes: a second always, a third
only where the judge on two runs fails and its copy of the inputs fits."""

NONDETERMINISTIC_GPU_OPS = re.compile(r"= [^=]*(?<![\w-])(scatter|select-and-scatter)\(")
"""HLO instructions XLA:GPU may run with atomics (a different summation order each run) unless
``--xla_gpu_exclude_nondeterministic_ops`` (or ``--xla_gpu_deterministic_ops``) is set."""

_DETERMINISTIC_FLAGS = re.compile(r"--xla_gpu_(exclude_nondeterministic_ops|deterministic_ops)(=true|=1)?(\s|$)")


def platform_of(tree: Any) -> str:
    """The platform of the devices holding the first array in ``tree`` (JAX's default else)."""
    for leaf in jax.tree.leaves(tree):
        devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return jax.default_backend()


def may_vary_between_runs(hlo_text: str | None, platform: str) -> bool:
    """Whether two runs of the original step may differ bitwise on ``platform``: a GPU step
    with a scatter or select-and-scatter, without XLA's flags that make them deterministic."""
    if platform not in ("gpu", "cuda", "rocm") or not hlo_text:
        return False
    if _DETERMINISTIC_FLAGS.search(os.environ.get("XLA_FLAGS", "")):
        return False
    return NONDETERMINISTIC_GPU_OPS.search(hlo_text) is not None


def _array_rows(reference: Any, others: Sequence[Any], got: Any, bad: list[str]):
    """``(name, r, others' leaves, g)`` for each leaf of outputs of one structure whose leaves
    are arrays in all of them; a leaf that is not an array in all is compared with
    ``reference``'s by value (``got``'s) and its difference appended to ``bad``. None where the
    structures differ."""
    ref_leaves, _ = jax.tree_util.tree_flatten_with_path(reference)
    columns = [jax.tree.leaves(o) for o in others]
    got_leaves = jax.tree.leaves(got)
    if any(len(c) != len(ref_leaves) for c in [*columns, got_leaves]):
        return None
    out = []
    for i, ((path, r), g) in enumerate(zip(ref_leaves, got_leaves, strict=True)):
        name = jax.tree_util.keystr(path) or "<output>"
        row = [c[i] for c in columns]
        if all(isinstance(x, jax.Array) for x in (r, *row, g)):
            out.append((name, r, row, g))
        elif not np.array_equal(np.asarray(r), np.asarray(g)):
            bad.append(f"{name}: values differ")
    return out


def within_spread(runs: Sequence[Any], got: Any, factor: float = SPREAD_FACTOR,
                  limit: int = 5) -> tuple[bool, list[str], str]:
    """Judges ``got`` against an original that is not reproducible: ``runs`` are two or more
    runs of the original on the same inputs, the first the reference.

    Every shard where all runs agree bitwise must agree bitwise in ``got`` too; a float shard
    where they differ may differ from the reference by at most ``factor`` times the largest
    absolute difference between any two runs (with the reference's NaN/inf positions).
    Returns (ok, the leaves that fail, a sentence on the original's own spread).
    """
    if len(runs) < 2:
        raise ValueError(f"within_spread needs two or more runs of the original, got {len(runs)}")
    reference, others = runs[0], list(runs[1:])
    bad, varied = [], 0
    rows = _array_rows(reference, others, got, bad)
    if rows is None or jax.tree.structure(reference) != jax.tree.structure(got):
        return False, ["output structure differs"], ""
    for name, r, row, g in rows:
        if len(bad) >= limit:
            break
        if (g.dtype, g.shape) != (r.dtype, r.shape):
            bad.append(f"{name}: {g.dtype}{g.shape} vs {r.dtype}{r.shape}")
            continue
        for rs, gs, *os_ in zip(_host_shards(r), _host_shards(g), *(_host_shards(a) for a in row),
                                strict=True):
            if all(np.array_equal(_bits(rs), _bits(o)) for o in os_):
                if not np.array_equal(_bits(rs), _bits(gs)):
                    bad.append(f"{name}: differs where {len(runs)} runs of the original agree bitwise")
                    break
                continue
            varied += 1
            if not _is_float(rs.dtype) or np.iscomplexobj(rs):
                bad.append(f"{name}: a non-float leaf the original itself does not reproduce")
                break
            x, z = rs.astype(np.float64), gs.astype(np.float64)
            if not np.array_equal(np.isfinite(x), np.isfinite(z)):
                bad.append(f"{name}: non-finite values at other positions")
                break
            spread = _largest_pairwise_difference([x, *(o.astype(np.float64) for o in os_)])
            dev = float(np.abs(x - z)[np.isfinite(x)].max()) if np.isfinite(x).any() else 0.0
            if dev > factor * spread:
                bad.append(f"{name}: max |diff| {dev:.3g}, above {factor:g}x the original's own "
                           f"{spread:.3g}")
                break
    words = (f"the original itself differs between {len(runs)} runs on {varied} shard(s) "
             f"(atomic scatters): judged against that spread ({factor:g}x)")
    return not bad, bad, words


def _largest_pairwise_difference(values: list[np.ndarray]) -> float:
    """The largest absolute difference, over elements finite in both, between any two arrays."""
    spread = 0.0
    for i, x in enumerate(values):
        for y in values[i + 1:]:
            fin = np.isfinite(x) & np.isfinite(y)
            if fin.any():
                spread = max(spread, float(np.abs(x - y)[fin].max()))
    return spread


ACCURACY_FACTOR = 2.0
"""How much further from the wider-precision run than the original's the optimised outputs
may be (``less_accurate``)."""

EXTRA_EVENTS = 2
"""Worst-case errors a leaf may have beyond the original's (``less_accurate``)."""


def _distinct_values(x: jax.Array) -> np.ndarray:
    """This process's part of ``x``, each element once (replicated shards counted once), flat."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    seen, parts = set(), []
    for s in sorted(x.addressable_shards, key=lambda s: s.device.id):
        key = repr(s.index)
        if key not in seen:
            seen.add(key)
            parts.append(np.asarray(s.data).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros((0,), x.dtype)


def less_accurate(reference: Any, got: Any, wider: Any, tolerance: float,
                  factor: float = ACCURACY_FACTOR, extra: int = EXTRA_EVENTS,
                  limit: int = 5) -> list[str]:
    """Leaves where ``got`` is less accurate than ``reference``, both judged against ``wider``.

    ``wider`` is the step run in wider precision (``hlo_passes.upcast``). Errors are
    normalised per leaf by the largest magnitude of its wider value. ``got`` passes
    when (1) its largest normalised error anywhere is at most ``factor`` x the original's
    largest anywhere, and (2) in every float leaf its sum of squared normalised errors is
    at most ``factor``^2 x the original's plus ``extra`` worst-case errors (the original's
    largest, squared): an optimizer that turns rounding into +-lr (Adam's first step) flips
    a few near-zero gradients in one run and not the other, and a small leaf (a bias) may
    have none in the original's run. Errors within ``tolerance`` count as none. NaN / inf
    must sit where the original's do; other leaves (integers, keys, bools) must equal the
    original's bit for bit. Compares this process's part of each leaf.
    """
    bad, errors = [], []
    rows = _array_rows(reference, [wider], got, bad)
    if rows is None:
        return ["output structure differs"]
    for name, r, (w,), g in rows:
        rv, gv, wv = _distinct_values(r), _distinct_values(g), _distinct_values(w)
        if not _is_float(rv.dtype) or np.iscomplexobj(rv):
            if not np.array_equal(_bits(rv), _bits(gv)):
                bad.append(f"{name}: values differ")
            continue
        rv, gv, wv = (v.astype(np.float64) for v in (rv, gv, wv))
        finite = np.isfinite(rv)
        if not np.array_equal(finite, np.isfinite(gv)) or not np.array_equal(
                rv[~finite], gv[~finite], equal_nan=True):
            bad.append(f"{name}: non-finite values differ from the original's")
            continue
        keep = finite & np.isfinite(wv)  # where the wider run overflows there is no judge
        rv, gv, wv = rv[keep], gv[keep], wv[keep]
        scale = float(np.max(np.abs(wv))) if wv.size else 0.0
        if not wv.size or scale == 0.0:
            if not np.array_equal(rv, gv):
                bad.append(f"{name}: values differ where the wider run is zero")
            continue
        er, eg = np.abs(rv - wv) / scale, np.abs(gv - wv) / scale
        er[er <= tolerance] = 0.0
        eg[eg <= tolerance] = 0.0
        errors.append((name, er, eg))
    worst = max((float(er.max()) for _, er, _ in errors), default=0.0)
    for name, er, eg in errors:
        if len(bad) >= limit:
            break
        max_g = float(eg.max())
        if max_g > factor * worst:
            bad.append(f"{name}: an error of {max_g:.3g} of its largest magnitude, over "
                       f"{factor:g}x the original's largest anywhere ({worst:.3g})")
            continue
        ss_r, ss_g = float(np.sum(er ** 2)), float(np.sum(eg ** 2))
        if ss_g > factor ** 2 * ss_r + extra * worst ** 2:
            bad.append(f"{name}: RMS error {np.sqrt(ss_g / eg.size):.3g} of its largest magnitude "
                       f"vs the original's {np.sqrt(ss_r / er.size):.3g}")
    return bad
