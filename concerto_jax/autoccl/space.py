"""Tuning search space: strategy parameters (enumerated) and resource parameters (ordered grids).

AutoCCL splits the collective-library configuration space in two
(AutoCCL NSDI'25 §4.1): a handful of *strategy* parameters whose
combinations are few and hard to model (algorithm, protocol, transport), each
combination forming a *subspace*; and *resource* parameters with large,
ordered ranges on which bandwidth is unimodal (channels, threads, chunk size),
searched inside each subspace by coordinate descent (see ``search.py``).

A ``Config`` is an immutable name -> value mapping. Every config of a space
encodes to a fixed-length vector of small ints (choice / grid indices) so it
can travel between processes as one int array (see ``coordination.py``).

References:
  AutoCCL NSDI'25 §4.1 (tuning-space abstraction and subspaces).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Choice",
    "Config",
    "IntGrid",
    "SearchSpace",
    "geometric_grid",
    "linear_grid",
]


class Config(Mapping[str, Any]):
    """Immutable, hashable mapping from parameter name to value.

    Example:
      >>> c = Config(algorithm="ring", nchannels=8)
      >>> c["nchannels"], c.replace(nchannels=16)["nchannels"]
      (8, 16)
    """

    __slots__ = ("_items",)

    def __init__(self, mapping: Mapping[str, Any] | None = None, **kwargs: Any):
        items = dict(mapping or {})
        items.update(kwargs)
        self._items = tuple(sorted(items.items()))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Config):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def replace(self, **kwargs: Any) -> Config:
        """Returns a copy with some values replaced."""
        return Config(dict(self._items), **kwargs)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._items)
        return f"Config({inner})"


@dataclasses.dataclass(frozen=True)
class Choice:
    """A strategy parameter: a short list of unordered alternatives."""

    name: str  # parameter name, e.g. "algorithm"
    values: tuple[Any, ...]  # the alternatives, e.g. ("ring", "tree")

    def __post_init__(self):
        if not self.values:
            raise ValueError(f"Choice {self.name!r} needs at least one value, got none.")


@dataclasses.dataclass(frozen=True)
class IntGrid:
    """A resource parameter: an ordered grid of ints on which cost is assumed unimodal."""

    name: str  # parameter name, e.g. "nchannels"
    values: tuple[int, ...]  # strictly increasing grid points
    default: int | None = None  # starting value (grid point); None = middle of the grid

    def __post_init__(self):
        vals = tuple(int(v) for v in self.values)
        if not vals or any(b <= a for a, b in zip(vals, vals[1:], strict=False)):
            raise ValueError(
                f"IntGrid {self.name!r} needs a non-empty strictly increasing grid, got {self.values!r}."
            )
        object.__setattr__(self, "values", vals)
        if self.default is not None and self.default not in vals:
            raise ValueError(
                f"IntGrid {self.name!r}: default {self.default} is not a grid point; "
                f"pick one of {vals[:4]}...{vals[-2:]}."
            )

    @property
    def default_index(self) -> int:
        """Grid index of the default (middle of the grid when no default is set)."""
        if self.default is None:
            return len(self.values) // 2
        return self.values.index(self.default)

    def index(self, value: int) -> int:
        """Grid index of ``value`` (nearest grid point when ``value`` is off-grid)."""
        arr = np.asarray(self.values)
        return int(np.argmin(np.abs(arr - int(value))))


def linear_grid(start: int, stop: int, step: int = 1) -> tuple[int, ...]:
    """Grid ``start, start+step, ..., <= stop``."""
    return tuple(range(start, stop + 1, step))


def geometric_grid(start: int, stop: int, factor: float = 2.0) -> tuple[int, ...]:
    """Grid ``start, start*factor, ...`` (rounded, deduplicated) up to ``stop`` inclusive."""
    if start <= 0 or stop < start or factor <= 1.0:
        raise ValueError(
            f"geometric_grid needs 0 < start <= stop and factor > 1, got {start}, {stop}, {factor}."
        )
    n = int(math.floor(math.log(stop / start, factor) + 1e-9)) + 1
    vals = sorted({int(round(start * factor**i)) for i in range(n)} | {int(stop)})
    return tuple(vals)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Strategy choices x resource grids.

    A config assigns every strategy parameter one of its values and every
    resource parameter one of its grid points.
    """

    strategy: tuple[Choice, ...] = ()  # enumerated: each combination is one subspace
    resources: tuple[IntGrid, ...] = ()  # searched by coordinate descent inside a subspace

    def __post_init__(self):
        names = [p.name for p in (*self.strategy, *self.resources)]
        if len(set(names)) != len(names):
            raise ValueError(f"SearchSpace parameter names must be unique, got {names}.")
        if not names:
            raise ValueError("SearchSpace needs at least one parameter.")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in (*self.strategy, *self.resources))

    def subspaces(self) -> list[Config]:
        """All strategy combinations (one empty config when there is no strategy parameter)."""
        combos = itertools.product(*(c.values for c in self.strategy))
        return [
            Config(dict(zip((c.name for c in self.strategy), combo, strict=True)))
            for combo in combos
        ]

    def size(self) -> int:
        """Number of configs in the whole space (what an exhaustive search would measure)."""
        n = 1
        for p in (*self.strategy, *self.resources):
            n *= len(p.values)
        return n

    def default_config(self, subspace: Config | None = None) -> Config:
        """First strategy values (or ``subspace``) with each resource at its default."""
        strat = subspace if subspace is not None else self.subspaces()[0]
        return self.from_indices(strat, [g.default_index for g in self.resources])

    def from_indices(self, subspace: Mapping[str, Any], indices: Sequence[int]) -> Config:
        """Config of a subspace with the resources at the given grid indices."""
        res = {g.name: g.values[int(i)] for g, i in zip(self.resources, indices, strict=True)}
        return Config({**dict(subspace), **res})

    def resource_indices(self, config: Mapping[str, Any]) -> list[int]:
        """Grid index of each resource value of ``config``."""
        return [g.index(config[g.name]) for g in self.resources]

    def strategy_of(self, config: Mapping[str, Any]) -> Config:
        """The subspace (strategy part) of ``config``."""
        return Config({c.name: config[c.name] for c in self.strategy})

    def encode(self, config: Mapping[str, Any]) -> np.ndarray:
        """Fixed-length int32 vector: choice indices then grid indices.

        Raises:
          ValueError: a value is not one of its parameter's choices.
        """
        out = []
        for c in self.strategy:
            if config[c.name] not in c.values:
                raise ValueError(f"{c.name}={config[c.name]!r} is not one of {c.values}.")
            out.append(c.values.index(config[c.name]))
        out.extend(self.resource_indices(config))
        return np.asarray(out, dtype=np.int32)

    def decode(self, vector: Sequence[int]) -> Config:
        """Inverse of ``encode``."""
        vec = [int(v) for v in vector]
        n_s = len(self.strategy)
        if len(vec) != n_s + len(self.resources):
            raise ValueError(f"expected {n_s + len(self.resources)} ints, got {len(vec)}.")
        strat = {c.name: c.values[i] for c, i in zip(self.strategy, vec[:n_s], strict=True)}
        return self.from_indices(strat, vec[n_s:])

    def fingerprint(self) -> str:
        """Short text that changes whenever the space changes (stored with persisted results)."""
        parts = [f"{c.name}:{','.join(map(str, c.values))}" for c in self.strategy]
        parts += [f"{g.name}:{g.values[0]}..{g.values[-1]}#{len(g.values)}" for g in self.resources]
        return ";".join(parts)
