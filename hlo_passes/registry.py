"""The passes by name: one table, loaded lazily, plus passes added at run time.

A pass is a function ``(module, options) -> PassOutcome`` over the IR (``options``: the
settings every pass may read, ``hlo_passes.options.PassOptions``; ``concerto_jax.Options``
satisfies it). A pass that also needs data of the run besides the module (another module's
text) declares a third parameter ``inputs`` and gets the run's ``PassInputs``: settings live
in options, data is passed as an argument. One line of ``PASS_TABLE`` registers it:
``Options.passes`` accepts exactly
the table's names plus those assigned at run time (``PASSES[name] = fn``, or
``monkeypatch.setitem(PASSES, name, fn)`` in tests).

This module sits below the passes (they import ``PassOutcome`` from here) and imports only
the IR: the table names each pass by ``"package.module:function"`` and ``PASSES[name]``
imports it on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, MutableMapping


@dataclasses.dataclass(frozen=True)
class Retry:
    """A smaller version of a pass's rewrite that ``compile_for_target``'s guards may judge
    instead of the whole: the pass declares it in its outcome, so no guard tests a pass's name.

    Attributes:
      kind: ``"leave_one_out"``: judged against the whole rewrite, the faster kept (one part of
        the rewrite left out, e.g. one loop's rotation); ``"fallback"``: judged only where the
        whole rewrite is dropped (what may still pay alone, e.g. the replicated-operand
        collectives without the split).
      label: what is left out, as the guard's record names it (``"split"``, a loop body).
      changes: replacements in the pass's own options group (``Options.<pass name>``).
    """

    kind: str
    label: str
    changes: tuple[tuple[str, object], ...]

    def __post_init__(self):
        if self.kind not in ("leave_one_out", "fallback"):
            raise ValueError(f"Retry.kind must be 'leave_one_out' or 'fallback', got {self.kind!r}")

    def applied(self, options, pass_name: str):
        """``options`` with this retry's changes in the group of the pass ``pass_name``."""
        group = getattr(options, pass_name)
        return dataclasses.replace(options, **{pass_name: dataclasses.replace(group, **dict(self.changes))})

    @classmethod
    def from_dict(cls, data: dict) -> Retry:
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (lists back to tuples)."""
        def tupled(v):
            return tuple(tupled(x) for x in v) if isinstance(v, list) else v

        return cls(data["kind"], data["label"], tuple((k, tupled(v)) for k, v in data["changes"]))


@dataclasses.dataclass(frozen=True)
class PassOutcome:
    """What a pass reports: whether it changed the module, and its statistics.

    ``tolerance`` is the relative difference from the original's outputs that the
    pass allows (0: bitwise; a pass that reassociates sums declares its bound).
    ``Options.optimize.check_first_step`` compares within the largest declared tolerance.
    ``retries``: smaller versions of the rewrite a guard may judge instead (``Retry``).
    """

    changed: bool
    stats: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 0.0
    retries: tuple[Retry, ...] = ()


@dataclasses.dataclass(frozen=True)
class PassInputs:
    """Data a run hands its passes besides the module (``compile_for_target`` and the GPU
    route set it; the user path runs with none). Settings, numbers included, stay in options.

    Attributes:
      fused_reference: XLA's scheduled module of the same, unrewritten step (text). With it,
        ``decompose`` costs each post-SPMD instruction by its share of the XLA kernel it is
        fused into (``costmodel.fused.fused_costs``) instead of one kernel per op.
    """

    fused_reference: str | None = dataclasses.field(default=None, repr=False)


NO_INPUTS = PassInputs()
"""The inputs of a run that has none."""


def takes_inputs(fn: Callable) -> bool:
    """Whether the pass ``fn`` declares the ``inputs`` parameter (registry docstring)."""
    try:
        return "inputs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: the two-argument form
        return False


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """How the table knows a pass.

    Attributes:
      where: ``"package.module:function"``, imported when the pass first runs
        (``"<run time>"`` for a pass assigned at run time).
    """

    where: str


PassFn = Callable[..., PassOutcome]
"""``(module: HloModule, options: PassOptions[, inputs: PassInputs]) -> PassOutcome``."""

PASS_TABLE: dict[str, PassSpec] = {
    "pipeline_loops": PassSpec("hlo_passes.pipeline_loops.run:pipeline_loops_pass"),  # before schedule
    "decompose": PassSpec("hlo_passes.decompose.run:decompose_pass"),
    "schedule": PassSpec("hlo_passes.schedule.run:schedule_pass"),
    "fuse_collectives": PassSpec("hlo_passes.fuse_collectives.run:fuse_pass"),
    "pin": PassSpec("hlo_passes.pin.run:pin_pass"),
}
"""The library's passes, in the order ``pass_names`` lists them."""

RUN_TIME = PassSpec("<run time>")
"""The spec of a pass assigned at run time under a name the table does not know."""


def load(spec: PassSpec) -> PassFn:
    """The function ``spec.where`` names, imported."""
    module_name, _, attr = spec.where.partition(":")
    # lazy: the registry sits below the passes (they import PassOutcome from here); a pass is
    # imported when it first runs
    return getattr(importlib.import_module(module_name), attr)


class PassRegistry(MutableMapping):
    """Passes by name: the entry table, loaded lazily, plus passes registered at run time.

    ``registry[name]`` imports the pass named in the table on first use;
    ``name in registry`` and iteration list every known name without importing.
    Assigning (``registry[name] = fn``, or ``monkeypatch.setitem`` in tests) overrides.
    """

    def __init__(self, table: dict[str, PassSpec]):
        self._table = table
        self._loaded: dict[str, PassFn] = {}

    def __getitem__(self, name: str) -> PassFn:
        if name not in self._loaded:
            if name not in self._table:
                raise KeyError(f"pass {name!r} is not registered (known: {sorted(self)})")
            self._loaded[name] = load(self._table[name])
        return self._loaded[name]

    def __setitem__(self, name: str, fn: PassFn) -> None:
        self._loaded[name] = fn

    def __delitem__(self, name: str) -> None:
        if name in self._loaded:
            del self._loaded[name]  # a table entry goes back to the table's function
        else:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._table or name in self._loaded

    def __iter__(self) -> Iterator[str]:
        yield from self._table
        yield from (n for n in self._loaded if n not in self._table)

    def __len__(self) -> int:
        return len(set(self._table) | set(self._loaded))

    def spec(self, name: str) -> PassSpec:
        """The table's spec of ``name`` (kept when a run-time function overrides a table entry);
        ``RUN_TIME`` for a name only assigned at run time.

        Raises:
          KeyError: ``name`` is not registered.
        """
        if name in self._table:
            return self._table[name]
        if name in self._loaded:
            return RUN_TIME
        raise KeyError(f"pass {name!r} is not registered (known: {sorted(self)})")


PASSES: PassRegistry = PassRegistry(PASS_TABLE)
"""Registered passes by name (``Options.passes`` picks from these)."""


def pass_names() -> tuple[str, ...]:
    """Every pass name ``Options.passes`` accepts, in table order."""
    return tuple(PASSES)
