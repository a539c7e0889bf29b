"""PSPLIB single-mode RCPSP instances (``.sm``) and their reference optima.

Parsing is done by OR-tools' ``rcpsp`` parser; this module converts its protobuf to
an ``RcpspInstance`` and reads ``optimum.csv`` (entries ``value`` or ``lo..hi``).

References: Kolisch & Sprecher (1997), "PSPLIB - a project scheduling problem
library"; Concerto (ASPLOS'25) §4.2.
"""

from __future__ import annotations

import csv
import dataclasses
import os

from ortools.scheduling.python import rcpsp as rcpsp_parser

from concerto_jax.scheduler.rcpsp import RcpspInstance


@dataclasses.dataclass(frozen=True)
class Reference:
    """Known optimum: ``lo == hi`` when closed, else best lower bound (``None``: not given) and best known."""

    lo: int | None
    hi: int

    @property
    def closed(self) -> bool:
        return self.lo == self.hi


def load_psplib(path: str) -> RcpspInstance:
    """Read a PSPLIB ``.sm`` file.

    Args:
      path: the ``.sm`` file.

    Returns:
      The instance with its dummy source and sink tasks kept (duration 0).

    Raises:
      ValueError: the file cannot be parsed, or it is multi-mode / not renewable-only.
    """
    parser = rcpsp_parser.RcpspParser()
    if not parser.parse_file(path):
        raise ValueError(f"OR-tools could not parse {path!r} as a PSPLIB instance")
    problem = parser.problem()
    if problem.is_rcpsp_max or problem.is_consumer_producer or problem.is_resource_investment:
        raise ValueError(f"{path!r} is not a plain single-mode RCPSP instance")
    caps = tuple(int(r.max_capacity) for r in problem.resources)
    if not all(r.renewable for r in problem.resources):
        raise ValueError(f"{path!r} has non-renewable resources; only renewable ones are supported")
    durations, demands, succs = [], [], []
    for task in problem.tasks:
        if len(task.recipes) != 1:
            raise ValueError(f"{path!r} is multi-mode ({len(task.recipes)} recipes); expected one")
        recipe = task.recipes[0]
        row = [0] * len(caps)
        for q, r in zip(recipe.demands, recipe.resources, strict=False):
            row[r] = int(q)
        durations.append(int(recipe.duration))
        demands.append(tuple(row))
        succs.append(tuple(int(s) for s in task.successors))
    return RcpspInstance(
        durations=tuple(durations),
        demands=tuple(demands),
        capacities=caps,
        successors=tuple(succs),
        name=os.path.basename(path),
    )


def load_optima(csv_path: str) -> dict[str, Reference]:
    """Read ``optimum.csv`` (columns ``problem,optimum``; optimum ``v``, ``lo..hi`` or ``..hi``)."""
    out: dict[str, Reference] = {}
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            value = row["optimum"].strip()
            if ".." in value:
                lo, hi = value.split("..")
                out[row["problem"].strip()] = Reference(int(lo) if lo.strip() else None, int(hi))
            else:
                out[row["problem"].strip()] = Reference(int(value), int(value))
    return out
