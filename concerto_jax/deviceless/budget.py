"""The time budget of one ``compile_for_target`` call (``Options.deviceless.time_budget_s``).

Two kinds of budget, one interface (``fits`` / ``allows`` / ``spend``):

* ``"auto"`` (the default) counts XLA compiles, not seconds: the call may run
  ``auto_budget_compiles`` compiles of the step (stock's included; a batch of compiles side by
  side counts as ``PARALLEL_COMPILE_COST`` each beyond the first), so what it searches depends
  on the program alone, never on the machine's speed or load: the same step gives the same plan
  on every run (D47). Its wall time is then about that many compiles plus the plans.
* seconds (a number): wall time from the call; what fits depends on how long the compiles so
  far took, so on a loaded machine less is searched.
"""

from __future__ import annotations

import dataclasses
import logging
import time

log = logging.getLogger(__name__)

PARALLEL_COMPILE_COST = 0.6
"""Compiles run side by side (threads; XLA's compile releases the GIL): each one beyond the
first costs this fraction of one compile (two compiles of the held-out DP x TP step on 2 cores:
33 s side by side, 43 s one after the other)."""


def auto_budget_compiles(options) -> float | None:
    """``Options.deviceless.time_budget_s="auto"``: the XLA compiles of the step one call may run,
    stock's included: stock's and one combine-threshold search at the options' settings (its
    smallest size, then its ``combine_compiles`` best-estimated candidates side by side): 3.6
    at the defaults. None (no bound) where ``combine_compiles`` is None (every candidate).

    The compiles a rewriting pass's own program needs (its compile, the rotation guard's) are
    not charged: the search of the program without the rewrite gets what "schedule" alone
    gets; a second search (the rewrite guard's near tie) runs on what the first left. Our
    compiles do not autotune (D39) and share one kernel cache (D40), so that budget keeps a
    first compile near 3x stock XLA's, which compiles once and autotunes (D47)."""
    k = options.deviceless.combine_compiles
    if k is None:
        return None
    return 2.0 + (1.0 + PARALLEL_COMPILE_COST * (k - 1) if k > 0 else 0.0)


@dataclasses.dataclass
class TimeBudget:
    """What is left of ``Options.deviceless.time_budget_s`` in one ``compile_for_target`` call, and what the
    budget cut (``TargetResult.cut``).

    Attributes:
      deadline: ``time.perf_counter()`` at which a budget in seconds ends (None: none).
      compile_s: stock XLA's compile of the step: what one more compile is expected to take
        before any other was timed.
      compiles: the compile budget of ``"auto"`` (None: a budget in seconds, or none).
      spent: compiles charged so far (stock's included).
      uncharged: compiles run but not charged (a rewriting pass's own program).
      search_compiles: one threshold search's compiles ("auto"; ``grant_search``).
      cut: what the budget left out, one line each.
    """

    deadline: float | None = None
    compile_s: float = 0.0
    compiles: float | None = None
    spent: float = 0.0
    uncharged: float = 0.0
    search_compiles: float | None = None  # "auto": one threshold search's compiles
    cut: list = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, options, t0: float, stock_compile_s: float) -> TimeBudget:
        """The budget of a call that began at ``t0`` (``time.perf_counter()``), stock's compile
        (``stock_compile_s``) done."""
        b = options.deviceless.time_budget_s
        if b is None:
            return cls(compile_s=stock_compile_s, spent=1.0)
        if b == "auto":
            n = auto_budget_compiles(options)
            return cls(compile_s=stock_compile_s, compiles=n, spent=1.0,
                       search_compiles=None if n is None else n - 1.0)
        return cls(t0 + float(b), stock_compile_s, spent=1.0)

    def total_s(self, t0: float) -> float | None:
        """The whole call's expected seconds for a call that began at ``t0``: the compiles "auto"
        allows at stock's compile time, or a budget in seconds; None without a bound."""
        if self.compiles is not None:
            return self.compiles * self.compile_s
        return None if self.deadline is None else self.deadline - t0

    def left(self) -> float:
        """Seconds left of a budget in seconds (inf otherwise)."""
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def fits(self, compiles: float, per_compile_s: float | None = None) -> bool:
        """Whether ``compiles`` more compiles fit: counted against ``compiles`` ("auto"), or, for a
        budget in seconds, timed at ``per_compile_s`` each (default: stock's compile)."""
        if self.compiles is not None:
            return self.spent + compiles <= self.compiles + 1e-9
        return self.left() >= compiles * (self.compile_s if per_compile_s is None else per_compile_s)

    def allows(self, compiles: float, what: str, per_compile_s: float | None = None) -> bool:
        """``fits``; if not, ``what`` is recorded as cut."""
        if self.fits(compiles, per_compile_s):
            return True
        self.cut.append(what)
        if self.compiles is not None:
            log.info("compile_for_target: compile budget: %s (%.1f of %.1f compiles spent)", what,
                     self.spent, self.compiles)
        else:
            log.info("compile_for_target: time budget: %s (%.0f s left)", what, max(self.left(), 0.0))
        return False

    def grant_search(self) -> None:
        """Under "auto": make room for one more threshold search as "schedule" alone would run it
        (``auto_budget_compiles`` less stock's compile), where less is left. The rewrite guard
        calls it before searching the original program after the rewrite's own search moved
        the rewrite's plan by more than its lead (``rewrite_guard.search_original_too``): that
        search decides whether the rewrite stands, so it is never starved by the rewrite's."""
        if self.compiles is not None and self.search_compiles is not None:
            self.compiles = max(self.compiles, self.spent + self.search_compiles)

    def spend(self, compiles: float = 1.0, charged: bool = True) -> None:
        """Record ``compiles`` compiles run (``charged=False``: a rewriting pass's own program)."""
        if charged:
            self.spent += compiles
        else:
            self.uncharged += compiles

    def summary(self) -> dict:
        """What the record says of the budget."""
        if self.compiles is not None:
            return {"kind": "compiles", "budget": self.compiles, "spent": round(self.spent, 2),
                    "uncharged": self.uncharged}
        return {"kind": "seconds" if self.deadline is not None else "none", "spent": round(self.spent, 2),
                "uncharged": self.uncharged}
