"""What every pass may read of the options it is given."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotation only: at run time this import would reach the concerto_jax face
    from concerto_jax.scheduler import ScheduleOptions


class PassOptions(Protocol):
    """The settings every pass may read (``concerto_jax.Options`` satisfies it).

    A pass reads its own settings, where it has some, from ``options.<pass name>``
    (``Options.decompose``).
    """

    target: str  # the cost model's cluster (concerto_jax.costmodel.CLUSTERS)
    scheduler: ScheduleOptions  # the scheduler's settings (concerto_jax.scheduler)
