"""Schedule simulator: replay a schedule (events over a ``TaskGraph``) on a modelled device.

Pipeline: TaskGraph + schedule -> ``simulate`` -> ``SimResult`` (step time,
exposed communication, overlap, utilisation, peak memory, per-task timings)
-> ``write_chrome_trace`` / ``write_gantt`` (several schedules on one time axis:
``write_chrome_trace_comparison`` / ``write_gantt_comparison``). ``lower_bounds`` gives what no
schedule can beat. Semantics: ``concerto_jax.taskgraph`` and ``engine``.

Two models, each with its own arithmetic: ``simulate`` (``engine.py``) slows compute while a
collective is in flight (the replay every figure of a step comes from); ``timeline`` /
``makespan`` (``timeline.py``) run every task at full speed (the scheduler's objective, in its
inner loops; ``IncrementalTimeline`` re-times a window of an order).
"""

from concerto_jax.simulator.bounds import LowerBounds, critical_path, lower_bound, lower_bounds
from concerto_jax.simulator.engine import (
    DEFAULT_OVERLAP_SLOWDOWN,
    SimOptions,
    order_of,
    simulate,
    simulate_synchronous,
)
from concerto_jax.simulator.result import SimResult, TaskTiming
from concerto_jax.simulator.timeline import IncrementalTimeline, Timeline, makespan, tails, timeline
from concerto_jax.simulator.trace import (
    chrome_trace,
    chrome_trace_comparison,
    exposed_intervals,
    write_chrome_trace,
    write_chrome_trace_comparison,
    write_gantt,
    write_gantt_comparison,
)

__all__ = [
    "DEFAULT_OVERLAP_SLOWDOWN", "IncrementalTimeline", "LowerBounds", "SimOptions", "SimResult",
    "TaskTiming", "Timeline", "chrome_trace", "chrome_trace_comparison", "critical_path",
    "exposed_intervals", "lower_bound", "lower_bounds", "makespan", "order_of", "simulate",
    "simulate_synchronous", "tails", "timeline", "write_chrome_trace", "write_chrome_trace_comparison",
    "write_gantt", "write_gantt_comparison",
]
