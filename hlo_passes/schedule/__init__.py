"""Pass ``schedule``: every computation of a module ordered as an RCPSP (Concerto ASPLOS'25 §4).

The pass function is ``hlo_passes.schedule.run.schedule_pass``, reached through
``hlo_passes.registry`` (this face does not import it); each computation is planned by the judge
(``concerto_jax.judge.plan_computation``) and put in the planned order.
"""
