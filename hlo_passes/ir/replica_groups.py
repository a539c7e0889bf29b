"""Replica groups in their three textual forms: explicit lists, iota and mesh axes.

* list: ``{{0,1},{2,3}}`` (``{}`` means one group of every participant);
* iota: ``[4,2]<=[2,4]T(1,0)``: ``arange(8).reshape(2,4).transpose(1,0)``
  reshaped to 4 groups of 2;
* mesh: ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (optionally
  ``mesh[...], device_ids=(0,2,1,3)`` or an iota ``device_ids=([2,8]T(1,0))``, and
  sub-axes ``'a':(pre)size``): the devices of a
  mesh laid out as an array over its axes; a group gathers the devices that
  differ only in the listed axes.

All forms expand to a list of groups, each a list of ids (:func:`parse_replica_groups`).
The mesh expansion follows XLA's ``MeshAxesReplicaGroupList::flattened_replica_groups``.
"""

from __future__ import annotations

import re

import numpy as np

from hlo_passes.ir.attributes import parse_groups

__all__ = [
    "parse_replica_groups", "format_replica_groups", "replica_groups_form",
    "expand_iota", "is_partition_of", "parse_mesh_axes", "parse_axis_ref", "mesh_device_array",
    "device_groups",
]

_IOTA_RE = re.compile(
    r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*\Z")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?\s*"
    r"\{(?P<group>[^}]*)\}\s*\Z")
_AXIS_DEF_RE = re.compile(r"\s*(?:'([^']*)'|([\w.\-]+))\s*=\s*(\d+)\s*")
_AXIS_REF_RE = re.compile(r"\s*(?:'([^']*)'|([\w.\-]+))\s*(?::\s*\((\d+)\)\s*(\d+))?\s*")
_TILE_IOTA_RE = re.compile(
    r"(?:\[([\d,\s]*)\]\s*<=\s*)?\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*\Z")
# Compact iota device list of a mesh: ``[2,4]T(1,0)`` = iota over reshape dims [2,4], transposed.
_MESH_IOTA_RE = re.compile(r"\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*\Z")


def replica_groups_form(text: str) -> str:
    """``'list'``, ``'iota'`` or ``'mesh'`` for a replica_groups attribute value."""
    text = text.strip()
    if text.startswith("mesh["):
        return "mesh"
    if text.startswith("["):
        return "iota"
    return "list"


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def expand_iota(reshape_dims, transpose=None) -> np.ndarray:
    """``arange(prod(dims)).reshape(dims).transpose(perm)`` (XLA's iota tile assignment)."""
    array = np.arange(int(np.prod(reshape_dims))).reshape(reshape_dims)
    if transpose:
        array = array.transpose(transpose)
    return array


def _parse_iota(text: str) -> list[list[int]]:
    m = _IOTA_RE.match(text.strip())
    if m is None:
        raise ValueError(f"expected iota replica groups such as [4,2]<=[2,4]T(1,0), found {text!r}")
    groups, size = int(m.group(1)), int(m.group(2))
    dims = _ints(m.group(3))
    perm = _ints(m.group(4)) if m.group(4) is not None else None
    array = expand_iota(dims, perm)
    if array.size != groups * size:
        raise ValueError(f"iota replica groups {text!r}: {groups}x{size} != {array.size} ids")
    return array.reshape(groups, size).tolist()


def mesh_device_array(sizes: list[int], ids_text: str | None) -> np.ndarray:
    """The device ids of a mesh laid out over its axes (``sizes``): an iota, or the
    ``device_ids=(...)`` text's list or iota (``[2,4]T(1,0)``)."""
    if not ids_text:
        return np.arange(int(np.prod(sizes))).reshape(sizes)
    m = _TILE_IOTA_RE.match(ids_text.strip())
    if m is not None:  # [reshape_dims]T(perm), optionally prefixed by [dims]<=
        perm = _ints(m.group(3)) if m.group(3) is not None else None
        return expand_iota(_ints(m.group(2)), perm).reshape(sizes)
    m = _MESH_IOTA_RE.match(ids_text)
    if m is not None:
        perm = _ints(m.group(2)) if m.group(2) is not None else None
        return expand_iota(_ints(m.group(1)), perm).reshape(sizes)
    return np.asarray(_ints(ids_text)).reshape(sizes)


def parse_mesh_axes(text: str) -> tuple[list[str], list[int]]:
    """The axis names and sizes of a mesh's ``'a'=2,'b'=4`` (the text inside ``mesh[...]``;
    empty for ``mesh[]``).

    Raises:
      ValueError: an axis is not ``name=size``.
    """
    names, sizes = [], []
    if not text.strip():
        return names, sizes
    for part in text.split(","):
        d = _AXIS_DEF_RE.fullmatch(part)
        if d is None:
            raise ValueError(f"bad mesh axis {part!r} in mesh[{text}]")
        names.append(d.group(1) if d.group(1) is not None else d.group(2))
        sizes.append(int(d.group(3)))
    return names, sizes


def parse_axis_ref(text: str, names: list[str]) -> tuple[int, tuple[int, int] | None]:
    """A mesh axis reference ``'a'`` or sub-axis ``'a':(pre)size``: the axis's index in
    ``names`` and ``(pre, size)`` or None for the whole axis.

    Raises:
      ValueError: not an axis reference, or an axis the mesh does not have.
    """
    r = _AXIS_REF_RE.fullmatch(text)
    if r is None:
        raise ValueError(f"bad axis reference {text!r}")
    name = r.group(1) if r.group(1) is not None else r.group(2)
    if name not in names:
        raise ValueError(f"axis {name!r} is not in the mesh {names}")
    sub = (int(r.group(3)), int(r.group(4))) if r.group(3) is not None else None
    return names.index(name), sub


def _parse_mesh(text: str) -> list[list[int]]:
    m = _MESH_RE.match(text.strip())
    if m is None:
        raise ValueError(
            f"expected mesh replica groups such as mesh['a'=2,'b'=4] {{'b'}}, found {text!r}")
    names, sizes = parse_mesh_axes(m.group("axes"))
    devices = mesh_device_array(sizes, m.group("ids"))
    # Per mesh dimension: the axis refs (full axis or sub-axes) grouped over.
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for part in m.group("group").split(","):
        if not part.strip():
            continue
        dim, sub = parse_axis_ref(part, names)
        refs.setdefault(dim, []).append(sub)
    # Reshape every mesh dimension into (padding, sub-axis, ...) pieces and
    # collect the pieces grouped over, in mesh-dimension order (as XLA does).
    reshape, grouped = [], []
    for dim, full in enumerate(sizes):
        subs = refs.get(dim)
        if subs is None:
            reshape.append(full)
            continue
        if subs == [None]:
            grouped.append(len(reshape))
            reshape.append(full)
            continue
        if None in subs:
            raise ValueError(f"axis {names[dim]!r} used both whole and as sub-axes in {text!r}")
        order = sorted(range(len(subs)), key=lambda i: subs[i][0])
        position, prefix = {}, 1
        for i in order:
            pre, size = subs[i]
            if pre != prefix:
                reshape.append(pre // prefix)
                prefix = pre
            position[i] = len(reshape)
            reshape.append(size)
            prefix *= size
        if prefix != full:
            reshape.append(full // prefix)
        grouped.extend(position[i] for i in range(len(subs)))
    if not grouped:
        raise ValueError(f"mesh replica groups {text!r} name no axis")
    rest = [i for i in range(len(reshape)) if i not in grouped]
    array = devices.reshape(reshape).transpose(rest + grouped)
    group_size = int(np.prod([reshape[i] for i in grouped]))
    return array.reshape(-1, group_size).tolist()


def parse_replica_groups(text: str) -> list[list[int]]:
    """Expands a replica_groups value of any form into lists of ids.

    Args:
      text: the attribute value, e.g. ``"{{0,1},{2,3}}"``, ``"[2,2]<=[4]"`` or
        ``"mesh['x'=2,'y'=2] {'y'}"``.

    Returns:
      The groups, each a list of ids; ``[]`` for ``{}`` (one group of all).

    Raises:
      ValueError: the text is not replica groups.
    """
    form = replica_groups_form(text)
    if form == "iota":
        return _parse_iota(text)
    if form == "mesh":
        return _parse_mesh(text)
    return parse_groups(text)


def format_replica_groups(groups) -> str:
    """``[[0, 1], [2, 3]]`` -> ``"{{0,1},{2,3}}"`` (the list form)."""
    return "{" + ",".join("{" + ",".join(str(int(i)) for i in g) + "}" for g in groups) + "}"


def is_partition_of(groups, num_ids: int) -> bool:
    """True when the groups are non-empty, equally sized and cover ``range(num_ids)`` once."""
    if not groups:
        return True
    flat = [i for g in groups for i in g]
    sizes = {len(g) for g in groups}
    return len(sizes) == 1 and 0 not in sizes and sorted(flat) == list(range(num_ids))


def device_groups(inst, num_devices: int) -> list[list[int]]:
    """The device groups a collective communicates over: its source-target pairs (a
    ``collective-permute``; ``[[0]]`` for none), else its replica groups, else every device
    (``inst``: the instruction carrying the collective's attributes)."""
    pairs = inst.source_target_pairs
    if pairs is not None:
        return [list(p) for p in pairs] or [[0]]
    groups = inst.replica_groups
    return groups if groups else [list(range(num_devices))]
