"""HLO text without its source locations: what two captures of one program share.

JAX records where a step was traced in the module it lowers: the ``FileNames``,
``FunctionNames``, ``FileLocations`` and ``StackFrames`` tables, and a ``stack_frame_id`` in
each instruction's metadata. The same program traced from two call sites (another line of a
script, another process's code path, a plan cache keying the step before the capture) differs
there and nowhere else, and XLA computes the same thing from both.
"""

from __future__ import annotations

import re

_TABLES = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", re.M)
_REFS = re.compile(r",? ?stack_frame_id=\d+")


def without_source_locations(text: str) -> str:
    """``text`` without JAX's stack tables and ``stack_frame_id`` references."""
    return _REFS.sub("", _TABLES.sub("", text))
