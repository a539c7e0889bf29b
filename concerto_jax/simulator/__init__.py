"""Schedule simulator: replay a schedule (events over a ``TaskGraph``) on a modelled device.

Pipeline: TaskGraph + schedule -> ``simulate`` -> ``SimResult`` (step time,
exposed communication, overlap, utilisation, peak memory, per-task timings)
-> ``write_chrome_trace`` / ``write_gantt`` (several schedules on one time axis:
``write_chrome_trace_comparison`` / ``write_gantt_comparison``). ``lower_bounds`` gives what no
schedule can beat. Semantics: ``concerto_jax.taskgraph`` and ``engine``.
"""

from concerto_jax.simulator.bounds import LowerBounds, critical_path, lower_bounds
from concerto_jax.simulator.engine import (
    DEFAULT_OVERLAP_SLOWDOWN,
    SimOptions,
    order_of,
    simulate,
    simulate_synchronous,
)
from concerto_jax.simulator.result import SimResult, TaskTiming
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
    "DEFAULT_OVERLAP_SLOWDOWN", "LowerBounds", "SimOptions", "SimResult", "TaskTiming",
    "chrome_trace", "chrome_trace_comparison", "critical_path", "exposed_intervals", "lower_bounds",
    "order_of", "simulate", "simulate_synchronous", "write_chrome_trace",
    "write_chrome_trace_comparison", "write_gantt", "write_gantt_comparison",
]
