"""Progress lines for long scheduler work (CP-SAT solves, odd-even rounds, fusion, benches), and
the stage times of a long call (``StageTimes``: ``compile_for_target``'s).

A ``Progress`` writes a ``logging`` line at most every ``every_s`` seconds with the
elapsed time and what the caller reports (best makespan, blocks done...). Through
``logging`` only: inside ``optimize`` nothing is printed unless the user configured
logging (the library never adds handlers), while a bench that calls
``logging.basicConfig(level=INFO)`` sees the lines.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from ortools.sat.python import cp_model

DEFAULT_EVERY_S = 5.0
"""Least seconds between two lines of a ``Progress`` made without ``every_s``."""


class Progress:
    """Throttled progress lines: ``<what>: <fields> (elapsed 12.3 s)``.

    Args:
      logger: where the lines go (at ``level``).
      what: the task's name at the head of each line.
      every_s: the least time between two lines (the first after ``every_s`` too);
        default ``DEFAULT_EVERY_S``.
      enabled: False makes every call a no-op.
      level: logging level of the lines.
    """

    def __init__(self, logger: logging.Logger, what: str, *, every_s: float | None = None,
                 enabled: bool = True, level: int = logging.INFO):
        self.logger = logger
        self.what = what
        self.every_s = DEFAULT_EVERY_S if every_s is None else every_s
        self.enabled = enabled and logger.isEnabledFor(level)
        self.level = level
        self.t0 = time.perf_counter()
        self._last = self.t0
        self.lines = 0

    @property
    def elapsed_s(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.t0

    def update(self, force: bool = False, **fields) -> bool:
        """Log ``fields`` if ``every_s`` passed since the last line (or ``force``); returns whether it did."""
        if not self.enabled:
            return False
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return False
        self._last = now
        text = ", ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        self.logger.log(self.level, "%s: %s (elapsed %.1f s)", self.what, text, now - self.t0)
        self.lines += 1
        return True


def _fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


class SolutionProgress(cp_model.CpSolverSolutionCallback):
    """CP-SAT callback: a throttled line per improving solution (objective, bound, elapsed)."""

    def __init__(self, progress: Progress, scale: float = 1.0, unit: str = ""):
        super().__init__()
        self.progress = progress
        self.scale = scale
        self.unit = unit
        self.solutions = 0

    def on_solution_callback(self) -> None:
        self.solutions += 1
        self.progress.update(best=f"{self.objective_value * self.scale:.1f}{self.unit}",
                             bound=f"{self.best_objective_bound * self.scale:.1f}{self.unit}",
                             solutions=self.solutions)


class StageTimes(dict):
    """Wall time per stage of a long call (``TargetResult.seconds``) that says each stage as it
    ends: a ``logging`` line (``level``) with the stage, its time and the call's elapsed time,
    and, once the caller sets ``expected_s``, the whole call's expected time; on a terminal
    (stderr a TTY, no ``CI`` variable) also a one-line bar on stderr, ended by ``close``.
    Nothing is printed in tests or CI (stderr captured), nothing logged unless the user
    configured logging.

    Args:
      logger: where the lines go.
      what: the call's name at the head of each line.
      stream: where the bar goes (default ``sys.stderr``; only if it is a TTY).
    """

    def __init__(self, logger: logging.Logger, what: str, *, stream=None, level: int = logging.INFO):
        super().__init__()
        self.logger, self.what, self.level = logger, what, level
        self.t0 = time.perf_counter()
        self.expected_s: float | None = None
        stream = sys.stderr if stream is None else stream
        tty = getattr(stream, "isatty", lambda: False)()
        self.stream = stream if tty and not os.environ.get("CI") else None

    def __setitem__(self, stage: str, seconds: float) -> None:
        super().__setitem__(stage, seconds)
        elapsed = time.perf_counter() - self.t0
        about = f", about {self.expected_s:.0f} s in all" if self.expected_s else ""
        self.logger.log(self.level, "%s: %s %.1f s (elapsed %.1f s%s)", self.what, stage, seconds, elapsed, about)
        if self.stream is not None:
            frac = min(elapsed / self.expected_s, 0.99) if self.expected_s else 0.0
            bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
            total = f" of ~{self.expected_s:.0f} s" if self.expected_s else ""
            self.stream.write(f"\r[{bar}] {self.what}: {stage} done, {elapsed:.0f} s{total}\033[K")
            self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line (on a terminal)."""
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.stream = None
