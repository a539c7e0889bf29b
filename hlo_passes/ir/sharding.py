"""Which devices hold the same data of a value: tile keys of ``sharding`` attributes, group labels.

A value's ``sharding`` (every form XLA prints: ``{replicated}``, ``devices=[...]`` with its
iota or explicit device list and replicated / manual subgroups, and the mesh form of
XLA >= 0.11, ``{mesh['data'=2,'model'=4], [{'data'}, {}]}``) gives each device a tile key:
two devices with one key hold the same tile. The replication analysis
(``hlo_passes.ir.uniformity``) starts from these keys at the entry parameters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from hlo_passes.ir.attributes import split_top_level
from hlo_passes.ir.replica_groups import (
    expand_iota,
    mesh_device_array,
    parse_axis_ref,
    parse_mesh_axes,
)

__all__ = ["labels_of_groups", "sharding_tile_keys"]

_DEVICES_RE = re.compile(r"devices=\[([\d,\s]*)\]\s*")
_MESH_SHARDING_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?\s*"
    r"(?:,(?P<rest>.*))?\Z", re.S)


def _split_sharding(text: str) -> list[str] | None:
    """The elements of a tuple sharding ``{{..}, {..}}``, or None for a leaf sharding."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        return None
    inner = body[1:-1].strip()
    if not inner.startswith("{"):
        return None
    return [p.strip() for p in split_top_level(inner)]


def _leaf_keys(text: str, num_devices: int) -> np.ndarray:
    """Per device, a key that two devices share only if they hold the same tile (one leaf)."""
    distinct = np.arange(num_devices)
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    if body == "replicated":
        return np.zeros(num_devices, dtype=np.int64)
    if body.startswith("mesh["):
        return _mesh_leaf_keys(body, num_devices)
    m = _DEVICES_RE.match(body)
    if m is None:  # maximal, manual, unknown, or a form we do not read: not proven
        return distinct
    dims = [int(x) for x in m.group(1).split(",") if x.strip()]
    rest = body[m.end():]
    subgroups: list[str] = []
    tail = ""
    if "last_tile_dim_replicate" in rest:
        rest, _, tail = rest.partition("last_tile_dim_replicate")
        subgroups = ["replicated"]
    elif "last_tile_dims=" in rest:
        rest, _, tail = rest.partition("last_tile_dims=")
        sub = re.match(r"\{([^}]*)\}", tail)
        if sub is None:
            return distinct
        subgroups = [s.strip() for s in sub.group(1).split(",") if s.strip()]
    rest = rest.split("metadata=")[0].strip()
    total = int(np.prod(dims)) if dims else 1
    iota = re.match(r"<=\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*$", rest)
    if iota is not None:
        reshape = [int(x) for x in iota.group(1).split(",") if x.strip()]
        perm = [int(x) for x in iota.group(2).split(",") if x.strip()] if iota.group(2) else None
        ids = expand_iota(reshape, perm).reshape(-1)
    else:
        ids = np.array([int(x) for x in re.findall(r"\d+", rest)], dtype=np.int64)
    if ids.size != total or len(subgroups) > len(dims):
        return distinct
    tiles = ids.reshape(dims)
    keys = distinct.copy()
    data_dims = len(dims) - len(subgroups)
    seen = np.zeros(num_devices, dtype=bool)
    for index in np.ndindex(*dims):
        d = int(tiles[index])
        if not 0 <= d < num_devices:
            return distinct
        key = list(index[:data_dims])
        # A manual subgroup dimension holds different data per index; a replicated one does not.
        key += [index[data_dims + j] for j, kind in enumerate(subgroups) if kind != "replicated"]
        keys[d] = hash(tuple(key)) & 0x7FFFFFFFFFFFFFFF
        seen[d] = True
    if not seen.all():
        return distinct
    # Re-number the keys densely (hash values are only compared for equality).
    _, dense = np.unique(keys, return_inverse=True)
    return dense.astype(np.int64)


def _mesh_leaf_keys(body: str, num_devices: int) -> np.ndarray:
    """Tile keys of a mesh-form (named) sharding without its braces, e.g.
    ``mesh['data'=2,'model'=4], [{'data'}, {}]`` or ``mesh[], replicated``.

    A device's key is its coordinates along the axes (or sub-axes ``'a':(pre)size``) that
    some dimension is sharded over or that are ``unreduced`` (partial sums differ); axes
    named nowhere or ``replicated={...}`` do not tell devices apart. Any clause not read
    here (manual axes, a form of a later XLA) proves nothing: every device its own key.
    """
    distinct = np.arange(num_devices)
    m = _MESH_SHARDING_RE.match(body)
    if m is None:
        return distinct
    try:
        names, sizes = parse_mesh_axes(m.group("axes"))
        refs: list[tuple[int, tuple[int, int] | None]] = []
        for clause in split_top_level(m.group("rest") or ""):
            if clause == "replicated" or clause.startswith(("replicated=", "metadata=")):
                continue
            if clause.startswith("["):  # per dimension: {axes, major first} (``?``: open)
                axes_text = clause[1:-1] if clause.endswith("]") else None
                if axes_text is None:
                    return distinct
                for dim in split_top_level(axes_text):
                    if not (dim.startswith("{") and dim.endswith("}")):
                        return distinct
                    refs += [parse_axis_ref(a, names) for a in split_top_level(dim[1:-1]) if a != "?"]
            elif clause.startswith("unreduced=") and clause.endswith("}"):
                axes_text = clause[len("unreduced="):].strip()
                if not axes_text.startswith("{"):
                    return distinct
                refs += [parse_axis_ref(a, names) for a in split_top_level(axes_text[1:-1])]
            else:
                return distinct
        if not names:  # mesh[]: one tile, every device holds all of it
            return np.zeros(num_devices, dtype=np.int64) if not refs else distinct
        devices = mesh_device_array(sizes, m.group("ids"))
    except ValueError:
        return distinct
    if devices.size != num_devices or sorted(devices.reshape(-1).tolist()) != list(range(num_devices)):
        return distinct
    keys = np.zeros(num_devices, dtype=np.int64)
    for index in np.ndindex(*sizes):
        key = []
        for axis, sub in refs:
            c = index[axis]
            key.append(c if sub is None else (c // sub[0]) % sub[1])
        keys[int(devices[index])] = hash(tuple(key)) & 0x7FFFFFFFFFFFFFFF
    _, dense = np.unique(keys, return_inverse=True)
    return dense.astype(np.int64)


def sharding_tile_keys(text: str | None, shape, num_devices: int):
    """Tile keys of a value's ``sharding`` attribute, as a nested structure like ``shape``.

    Each leaf is an array over devices; two devices with the same key hold the same data.
    ``None`` (no sharding) gives every device its own key.
    """
    def distinct():
        return np.arange(num_devices)

    if text is None:
        if shape.is_tuple:
            return tuple(sharding_tile_keys(None, s, num_devices) for s in shape.elements)
        return distinct()
    if shape.is_tuple:
        parts = _split_sharding(text)
        if parts is None:  # one sharding for every element
            return tuple(sharding_tile_keys(text, s, num_devices) for s in shape.elements)
        if len(parts) != len(shape.elements):
            return tuple(sharding_tile_keys(None, s, num_devices) for s in shape.elements)
        return tuple(sharding_tile_keys(p, s, num_devices) for p, s in zip(parts, shape.elements, strict=True))
    return _leaf_keys(text, num_devices)


def labels_of_groups(groups: Sequence[Sequence[int]], num_devices: int) -> np.ndarray | None:
    """Per device, the index of its group; None if the groups do not cover each device once."""
    labels = np.full(num_devices, -1, dtype=np.int64)
    for k, g in enumerate(groups):
        for d in g:
            if not 0 <= int(d) < num_devices or labels[int(d)] >= 0:
                return None
            labels[int(d)] = k
    return None if (labels < 0).any() else labels
