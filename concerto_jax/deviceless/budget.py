"""The time budget of one ``compile_for_target`` call (``Options.deviceless.time_budget_s``)."""

from __future__ import annotations

import dataclasses
import logging
import time

log = logging.getLogger(__name__)

AUTO_BUDGET_FACTOR = 5.0
"""``Options.deviceless.time_budget_s="auto"``: the budget is this many times stock XLA's compile of the step
(the compile-time goal: a first compile within 3x stock's, none above 5x)."""


AUTO_BUDGET_MIN_S = 60.0
"""... and never below this (a small step's compile is seconds; its search is too)."""


@dataclasses.dataclass
class TimeBudget:
    """What is left of ``Options.deviceless.time_budget_s`` in one ``compile_for_target`` call, and what the
    budget cut (``TargetResult.cut``)."""

    deadline: float | None = None  # time.perf_counter(); None: no bound
    compile_s: float = 0.0  # stock XLA's compile of the step: what one more compile may take
    cut: list = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, options, t0: float, stock_compile_s: float) -> TimeBudget:
        """The budget of a call that began at ``t0`` (``time.perf_counter()``)."""
        b = options.deviceless.time_budget_s
        if b is None:
            return cls(compile_s=stock_compile_s)
        if b == "auto":
            b = max(AUTO_BUDGET_MIN_S, AUTO_BUDGET_FACTOR * stock_compile_s)
        return cls(t0 + float(b), stock_compile_s)

    def left(self) -> float:
        """Seconds left (inf without a bound)."""
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def allows(self, seconds: float, what: str) -> bool:
        """Whether a step expected to take ``seconds`` fits; if not, ``what`` is recorded as cut."""
        if self.left() >= seconds:
            return True
        self.cut.append(what)
        log.info("compile_for_target: time budget: %s (%.0f s left, about %.0f s needed)", what,
                 max(self.left(), 0.0), seconds)
        return False
