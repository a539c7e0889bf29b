"""Passes of the ``optimize`` pipeline, registered by name in ``concerto_jax.pipeline.PASSES``.

* ``schedule``: order the entry computation by the RCPSP scheduler (Concerto §4).
"""

from concerto_jax.passes import schedule_pass  # noqa: F401  (registers "schedule")
