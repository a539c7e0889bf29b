"""The collectives of a compiled step, as the NCCL tuner plugin sees them: per-collective keys.

A key is (collective type, size class, communicator size, occurrence): the
size class is ``floor(log2(nBytes))`` with nBytes as NCCL reports it to a
tuner (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter:
the input -- NCCL scales per-rank counts by the communicator size); the
occurrence separates collectives of the same type and class that one step
issues several times (the k-th of p, counted by the plugin per communicator
since the table was loaded). Occurrences are only used where they are
reliable: every such collective in the entry computation of a module (a while
body repeats its collectives a data-dependent number of times) and on one
communicator; elsewhere the key covers all occurrences.

References:
  AutoCCL NSDI'25 §4.3 (one configuration per collective of the training step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax.autoccl.plugin import size_class
from hlo_passes.ir.parser import parse_module

__all__ = ["CollectiveKey", "CollectiveSite", "assign_keys", "collective_sites"]

TUNED_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class CollectiveSite:
    """One collective instruction of a step, in schedule order."""

    kind: str  # "all-reduce", "all-gather" or "reduce-scatter"
    nbytes: int  # nBytes as NCCL passes it to getCollInfo
    nranks: int | None  # communicator size (None: unknown, the key then matches any)
    group: str  # replica groups text (communicator identity)
    in_entry: bool  # False inside a while body / called computation (runs an unknown count)


@dataclasses.dataclass(frozen=True)
class CollectiveKey:
    """What one table rule matches (see the module docstring)."""

    kind: str  # collective type
    size_class: int  # floor(log2(nBytes))
    nranks: int | None  # communicator size or None for any
    occurrence: tuple[int, int] | None  # (k, p) or None for every occurrence

    def label(self) -> str:
        """Short text, e.g. ``all-reduce 2^24 n8 #1/3``."""
        occ = "" if self.occurrence is None else f" #{self.occurrence[0]}/{self.occurrence[1]}"
        n = "" if self.nranks is None else f" n{self.nranks}"
        return f"{self.kind} 2^{self.size_class}{n}{occ}"


def assign_keys(sites: Sequence[CollectiveSite]) -> list[CollectiveKey]:
    """The key of every site (same order). Same-class repeats get occurrence indices when reliable."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(sites):
        groups.setdefault((s.kind, size_class(s.nbytes), s.nranks), []).append(i)
    keys: list[CollectiveKey | None] = [None] * len(sites)
    for (kind, cls, nranks), idx in groups.items():
        reliable = len(idx) > 1 and all(sites[i].in_entry for i in idx)
        reliable = reliable and len({sites[i].group for i in idx}) == 1
        for k, i in enumerate(idx):
            occ = (k, len(idx)) if reliable else None
            keys[i] = CollectiveKey(kind, cls, nranks, occ)
    return keys  # type: ignore[return-value]


def collective_sites(hlo_text: str) -> list[CollectiveSite]:
    """All-reduces, all-gathers and reduce-scatters of a compiled module (``compiled.as_text()``).

    Sync ops and async starts count once (dones and updates are skipped); the
    generic ``async-start`` form is resolved to the op it wraps. Collective kernel
    fusions (XLA:GPU >= 0.11 runs small all-reduces as Triton kernels over NVLink) are
    left out: they never call NCCL, so the tuner plugin does not see them and counting
    them would shift the occurrence indices of the collectives it does see.
    """
    module = parse_module(hlo_text)
    entry = module.entry
    wrapped = _wrapped_computations(module)
    out: list[CollectiveSite] = []
    for comp in [entry] + [c for c in module.computations if c is not entry]:
        if comp is not entry and comp.name in wrapped:
            continue  # counted at its async-start in the caller, or a collective kernel's body
        for inst in comp.instructions:
            kind = inst.collective_kind
            if kind not in TUNED_KINDS or inst.async_role not in (None, "start"):
                continue
            if inst.is_collective_kernel:
                continue
            groups = inst.replica_groups
            if groups is None and inst.async_wrapped is not None:
                groups = inst.async_wrapped.replica_groups
            nranks = len(groups[0]) if groups and groups[0] else None
            in_bytes = sum(op.shape.byte_size for op in inst.operands)
            nbytes = in_bytes * (nranks or 1) if kind == "all-gather" else in_bytes
            out.append(CollectiveSite(kind, int(nbytes), nranks, str(groups), comp is entry))
    return out


def _wrapped_computations(module) -> set[str]:
    """Names of the computations an ``async-start`` or a fusion runs (their collectives are
    counted, or left out, at the wrapper)."""
    return {c.name for inst in module.instructions()
            if inst.opcode in ("async-start", "fusion", "fusion-start") for c in inst.called_computations}
