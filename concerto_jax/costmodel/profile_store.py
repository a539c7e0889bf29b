"""Measured instruction times that override the analytical model, keyed by instruction signature.

A signature is a hash of what determines a kernel's time and nothing else:
opcode, result and operand shapes (dtype and dims), the attributes that
change the computation (dimension numbers, windows, slices, ...), and for
fusions and other called computations the signatures of the instructions
inside with their operand wiring. Names, metadata and scheduling
annotations are left out, so the same fusion in two modules (or two layers)
shares one entry. The store is JSON on disk: ``{"device": ..., "entries":
{signature: {"us": mean, "n": samples, "what": description}}}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from concerto_jax.costmodel.compute import OpInfo

IGNORED_ATTRS = frozenset({"metadata", "backend_config", "sharding", "frontend_attributes",
                           "control-predecessors", "channel_id", "statistics_viz", "origin",
                           "operand_precision", "calls", "to_apply", "body", "condition"})
"""Attributes that do not change what a kernel computes (or are covered by the called computation)."""


def _shape_text(leaves) -> str:
    return "(" + ",".join(f"{a.dtype}[{','.join(map(str, a.dims))}]" for a in leaves) + ")"


def signature(op: OpInfo) -> str:
    """A stable hex digest identifying the kernel ``op`` runs (see the module docstring)."""
    return hashlib.sha1(_canonical(op).encode()).hexdigest()[:20]


def _canonical(op: OpInfo) -> str:
    parts = [op.opcode, _shape_text(op.result), *(_shape_text(o) for o in op.operands)]
    parts += [f"{k}={v}" for k, v in sorted(op.attrs.items()) if k not in IGNORED_ATTRS]
    if op.parameter_number >= 0:
        parts.append(f"param={op.parameter_number}")
    if op.operand_ids:
        parts.append("ids=" + ",".join(map(str, op.operand_ids)))
    for attr, body in sorted(op.called.items()):
        parts.append(f"{attr}:[" + ";".join(_canonical(i) for i in body) + "]")
    return "|".join(parts)


@dataclasses.dataclass
class Entry:
    """One measured kernel: mean time, number of samples, a readable description."""

    us: float
    n: int = 1
    what: str = ""


class ProfileStore:
    """Measured times by instruction signature (JSON on disk).

    Attributes:
      device: what the times were measured on (e.g. ``"cpu"``, ``"NVIDIA H100 80GB HBM3"``).
      entries: signature -> ``Entry``.
    """

    def __init__(self, device: str, entries: dict[str, Entry] | None = None):
        self.device = device
        self.entries: dict[str, Entry] = dict(entries or {})

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"ProfileStore(device={self.device!r}, {len(self.entries)} entries)"

    def lookup(self, op: OpInfo) -> float | None:
        """Measured time of ``op`` in microseconds, or None."""
        e = self.entries.get(signature(op))
        return None if e is None else e.us

    def record(self, op: OpInfo, us: float, samples: int = 1) -> None:
        """Add a measurement of ``op`` (running mean over samples)."""
        key = signature(op)
        old = self.entries.get(key)
        if old is None:
            self.entries[key] = Entry(us, samples, f"{op.opcode} {op.name} -> {_shape_text(op.result)}")
        else:
            total = old.n + samples
            self.entries[key] = Entry((old.us * old.n + us * samples) / total, total, old.what)

    def save(self, path: str | os.PathLike) -> None:
        """Write the store as JSON."""
        data = {"device": self.device, "entries": {k: dataclasses.asdict(v) for k, v in sorted(self.entries.items())}}
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfileStore:
        """Read a store written by ``save``."""
        with open(path) as f:
            data = json.load(f)
        return cls(data["device"], {k: Entry(**v) for k, v in data["entries"].items()})
