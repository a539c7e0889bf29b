"""Timelines of scheduled modules: simulate a module's entry on a target, draw and export them."""

from __future__ import annotations

import dataclasses
import logging
import os

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.scheduler import peak_memory
from concerto_jax.simulator import (
    SimOptions,
    SimResult,
    simulate,
    timeline,
    write_chrome_trace_comparison,
    write_gantt_comparison,
)
from hlo_passes.ir import parse_module

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A module's entry computation simulated in its own order on a target.

    Attributes:
      label: the name shown on charts and traces.
      result: the simulation (step time, exposed communication, per-task timings).
      graph: the costed task graph the timings index.
      peak_bytes: peak live bytes of the entry in this order (the scheduler's memory model).
    """

    label: str
    result: SimResult
    graph: object
    peak_bytes: int


def simulate_module(text: str, target: str, label: str) -> Timeline:
    """Simulate the entry computation of the scheduled module ``text`` on ``target``.

    Control-flow instructions (while loops, calls) count with the cost model's estimate of
    one run; a step without them simulates as ``compile_for_target`` judges it.
    """
    cost_model = CostModel(get_cluster(target))
    module = parse_module(text)
    built = build_taskgraph(module, cost_model)
    result = simulate(built.graph, built.events,
                      SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown, memory=False))
    unfolded = build_taskgraph(module, cost_model, fold_aliases=False)
    tl = timeline(unfolded.graph, unfolded.events)  # full speed: the scheduler's memory model
    return Timeline(label, result, built.graph, peak_memory(unfolded.graph, tl.start, tl.end))


def write_comparison(out_dir: str | os.PathLike, name: str, timelines,
                     title: str = "") -> tuple[str | None, str]:
    """``<name>.trace.json`` (Perfetto: one process per timeline) and ``<name>.gantt.png`` (one
    time axis, exposed communication marked) in ``out_dir``; their paths, the PNG's None
    where matplotlib is not installed (``pip install 'concerto_jax[plot]'``)."""
    os.makedirs(out_dir, exist_ok=True)
    runs = [(t.label, t.result, t.graph) for t in timelines]
    trace = write_chrome_trace_comparison(os.path.join(out_dir, f"{name}.trace.json"), runs,
                                          metadata={"title": title})
    try:
        import matplotlib  # noqa: F401  # lazy: an optional dependency (the [plot] extra)
    except ImportError:
        return None, trace
    png = write_gantt_comparison(os.path.join(out_dir, f"{name}.gantt.png"), runs, title=title)
    return png, trace
