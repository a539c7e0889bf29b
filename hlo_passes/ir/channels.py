"""Channel ids of a module's collectives: the largest in use, and fresh ones for rewrites."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

__all__ = ["channel_counter", "max_channel_id"]


def max_channel_id(module) -> int:
    """The largest ``channel_id`` in the module (0 if none)."""
    return max((i.channel_id or 0 for i in module.instructions()), default=0)


def channel_counter(module) -> Callable[[], int]:
    """A ``next_channel_id`` for the rewrites: fresh ids above every id ``module`` holds now."""
    return functools.partial(next, itertools.count(max_channel_id(module) + 1))
