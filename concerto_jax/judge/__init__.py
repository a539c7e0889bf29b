"""The judge: schedule and simulate a task graph, a computation or a module, one service for
every pass, ``compile_for_target``'s guard and fidelity, and the bench.

* ``graph.py``: ``judge_graph`` (one order of one task graph: scheduled with
  ``scheduler.schedule`` when asked, replayed with ``simulator.simulate`` when asked) ->
  ``Judgement``.
* ``computation.py``: ``judge_computation`` (the graph of one computation, built and judged);
  ``plan_computation`` (the ``schedule`` pass's per-computation plan: figures and the new order,
  applied by the caller), ``order_from_events``, ``budget_share``.
* ``module.py``: ``judge_module`` (every computation in its own order, combined bottom-up) ->
  ``Judged``; ``overlap_by_collective``.
* ``orders.py``: XLA's order on our task graph (``map_order``, ``order_by_priority``) and
  ``planned_events`` (every collective's window as wide as dependencies allow).
* ``fidelity.py``: planned vs final vs stock (``measure`` -> ``Fidelity``, ``overlap_kept``).

Two models are kept apart, each with its own arithmetic: the scheduler's full-speed timeline
(``Judgement.makespan_us``, ``peak_bytes``) and the replay with interference
(``Judgement.sim``).
"""

from concerto_jax.judge.computation import (
    ComputationPlan,
    budget_share,
    judge_computation,
    order_from_events,
    plan_computation,
    plan_module,
)
from concerto_jax.judge.envelope import Envelope
from concerto_jax.judge.fidelity import Fidelity, measure, overlap_kept
from concerto_jax.judge.graph import Judgement, judge_graph
from concerto_jax.judge.module import Judged, judge_module, judge_parsed, overlap_by_collective
from concerto_jax.judge.orders import (
    MappedOrder,
    map_order,
    order_by_priority,
    planned_events,
    scheduling_name,
)

__all__ = [
    "ComputationPlan", "Envelope", "Fidelity", "Judged", "Judgement", "MappedOrder", "budget_share",
    "judge_computation", "judge_graph", "judge_module", "judge_parsed", "map_order", "measure", "order_by_priority",
    "order_from_events", "overlap_by_collective", "overlap_kept", "plan_computation", "plan_module",
    "planned_events", "scheduling_name",
]
