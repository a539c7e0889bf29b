"""Passes of the ``optimize`` pipeline, registered by name in ``concerto_jax.pipeline.PASSES``.

* ``schedule``: order the entry computation by the RCPSP scheduler (Concerto §4).
* ``pin``: opt-barriers around each collective's planned window, so XLA keeps the overlap.
"""

from concerto_jax.passes import schedule_pass  # noqa: F401  (registers "schedule")
from concerto_jax.passes import pin_pass  # noqa: F401, E402  (registers "pin")
