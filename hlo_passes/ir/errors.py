"""Errors raised by the HLO IR: parse errors and verifier errors."""

from __future__ import annotations

__all__ = ["HloError", "HloParseError", "HloVerifyError"]


class HloError(Exception):
    """Base class of every error raised by :mod:`hlo_passes`."""


class HloParseError(HloError, ValueError):
    """Malformed HLO text.

    The message reads ``<source>:<line>:<column>: expected <what>, found <what>``
    followed by the offending line and a caret under the offending column.

    Attributes:
      expected: what the parser expected there.
      found: what it found instead (a short excerpt).
      line_no: 1-based line number of the offending text.
      column: 1-based column of the offending text.
      line: the offending line, verbatim.
    """

    def __init__(self, expected: str, found: str, line_no: int, column: int,
                 line: str, source: str = "<hlo>"):
        self.expected = expected
        self.found = found
        self.line_no = line_no
        self.column = column
        self.line = line
        self.source = source
        if len(line) <= 240:
            shown, caret_col = line, column - 1
        else:  # show a window around the column of very long lines
            lo = max(0, column - 120)
            shown = ("..." if lo else "") + line[lo:column + 120] + (
                "..." if column + 120 < len(line) else "")
            caret_col = column - 1 - lo + (3 if lo else 0)
        super().__init__(
            f"{source}:{line_no}:{column}: expected {expected}, found {found}\n"
            f"  {shown}\n  {' ' * caret_col}^")


class HloVerifyError(HloError):
    """An IR invariant does not hold.

    The message names the invariant and shows the offending instruction with
    its neighbours in its computation (the offender marked with ``>>``).

    Attributes:
      instruction: the offending instruction, or None for module-level errors.
      computation: the computation holding it, or None.
    """

    def __init__(self, message: str, instruction=None, computation=None,
                 context: str = ""):
        self.instruction = instruction
        self.computation = computation
        super().__init__(message + ("\n" + context if context else ""))
