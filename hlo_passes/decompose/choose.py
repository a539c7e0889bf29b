"""Choice of one strategy per critical collective by CP-SAT, where contexts overlap.

Each candidate is (collective, axis, degree) with a predicted gain. A
collective takes at most one candidate (one-hot with "none"), and two
candidates whose contexts share an instruction cannot both be taken (the
op would have to split two ways). The model maximises the summed gain.

References: Concerto (ASPLOS'25) §5.2, strategy selection as an ILP.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict

from ortools.sat.python import cp_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy: split ``collective``'s context along ``axis`` into ``n`` chunks."""

    collective: str
    axis: int
    n: int
    gain_us: float
    members: frozenset[str]
    computation: str = ""
    variant: str = "both"  # which sides of the context split: "both", "pre" or "post"

    @property
    def key(self) -> tuple:
        """Key of its context in ``search.Found.contexts``."""
        return (self.computation, self.collective, self.axis, self.variant)


class ChoiceError(RuntimeError):
    """CP-SAT found no feasible choice (cannot happen: choosing nothing is feasible)."""


def choose(candidates: list[Candidate], *, time_limit_s: float = 5.0) -> list[Candidate]:
    """The non-conflicting subset of ``candidates`` with the largest total gain.

    Args:
      candidates: strategies with positive predicted gain.
      time_limit_s: CP-SAT wall limit.

    Returns:
      The chosen candidates (at most one per collective).

    Raises:
      ChoiceError: the solver returned no solution.
    """
    cands = [c for c in candidates if c.gain_us > 0]
    if not cands:
        return []
    model = cp_model.CpModel()
    take = [model.new_bool_var(f"take_{c.computation}_{c.collective}_{c.axis}_{c.n}")
            for c in cands]
    by_collective: dict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(cands):
        by_collective[(c.computation, c.collective)].append(i)
    for idx in by_collective.values():
        model.add_at_most_one(take[i] for i in idx)
    by_member: dict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(cands):
        for m in c.members:
            by_member[(c.computation, m)].append(i)
    for idx in by_member.values():
        owners = {(cands[i].computation, cands[i].collective) for i in idx}
        if len(owners) > 1:
            model.add_at_most_one(take[i] for i in idx)
    scale = 1000.0  # gains in ns: integer objective
    model.maximize(sum(int(round(c.gain_us * scale)) * take[i] for i, c in enumerate(cands)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise ChoiceError(f"CP-SAT status {solver.status_name(status)} on {len(cands)} candidates")
    chosen = [c for i, c in enumerate(cands) if solver.value(take[i])]
    log.debug("decompose choice: %d of %d candidates, status %s", len(chosen), len(cands),
              solver.status_name(status))
    return chosen
