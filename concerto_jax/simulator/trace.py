"""Export a simulated schedule: Perfetto/Chrome trace JSON and a Gantt chart PNG."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from concerto_jax.simulator.result import SimResult
from concerto_jax.taskgraph import COMPUTE_STREAM, TaskGraph

log = logging.getLogger(__name__)


def _stream_name(stream: int) -> str:
    return "compute" if stream == COMPUTE_STREAM else f"comm {stream}"


def chrome_trace(result: SimResult, graph: TaskGraph | None = None, *, process_name: str = "device 0",
                 metadata: Mapping[str, object] | None = None) -> dict:
    """A Chrome/Perfetto trace (``{"traceEvents": [...]}``) with one thread per stream.

    Args:
      result: the simulated schedule.
      graph: when given, each slice carries the task's opcode and collective info.
      process_name: label of the process track.
      metadata: extra key/values stored under ``otherData`` (e.g. case, cluster).

    Returns:
      A JSON-serialisable dict; times in microseconds as the format requires.
    """
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process_name}}]
    for s in sorted(result.stream_utilisation):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": _stream_name(s)}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}})
    for i, t in enumerate(result.timings):
        if t.end_us <= t.start_us:
            continue
        args: dict[str, object] = {}
        if graph is not None:
            task = graph.tasks[i]
            args["opcode"] = task.opcode
            args["nominal_us"] = round(task.duration_us, 3)
            if task.collective is not None:
                args.update(op=task.collective.op, bytes=task.collective.bytes,
                            group_size=task.collective.group_size)
        events.append({"name": t.name, "ph": "X", "pid": 0, "tid": t.stream, "ts": t.start_us,
                       "dur": t.end_us - t.start_us, "args": args})
    summary = {"step_time_us": result.step_time_us, "exposed_comm_us": result.exposed_comm_us,
               "overlap_pct": result.overlap_pct, "overlap_slowdown": result.overlap_slowdown}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {**summary, **(metadata or {})}}


def write_chrome_trace(path: str | os.PathLike, result: SimResult, graph: TaskGraph | None = None,
                       **kwargs) -> str:
    """Write ``chrome_trace(...)`` to ``path`` (open it in ui.perfetto.dev); returns the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(result, graph, **kwargs), f)
    log.info("wrote trace %s", path)
    return os.fspath(path)


def write_gantt(path: str | os.PathLike, result: SimResult, graph: TaskGraph | None = None, *,
                title: str = "", max_labels: int = 40) -> str:
    """Draw a Gantt chart (one row per stream) to a PNG; needs matplotlib (``pip install .[plot]``).

    Args:
      path: output file.
      result: the simulated schedule.
      graph: when given, collectives are coloured by op.
      title: chart title (the step time and overlap are appended).
      max_labels: label at most this many of the longest slices.

    Returns:
      The path written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("write_gantt needs matplotlib: pip install 'concerto_jax[plot]'") from e
    streams = sorted(result.stream_utilisation)
    row = {s: len(streams) - 1 - k for k, s in enumerate(streams)}
    palette = {"all-reduce": "tab:red", "all-gather": "tab:green", "reduce-scatter": "tab:purple",
               "all-to-all": "tab:orange", "collective-permute": "tab:brown"}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(streams)))
    slices = [(i, t) for i, t in enumerate(result.timings) if t.end_us > t.start_us]
    for i, t in slices:
        color = "tab:blue"
        if graph is not None and graph.tasks[i].collective is not None:
            color = palette.get(graph.tasks[i].collective.op, "tab:gray")
        ax.broken_barh([(t.start_us, t.end_us - t.start_us)], (row[t.stream] - 0.4, 0.8),
                       facecolors=color, edgecolor="black", linewidth=0.2)
    longest = sorted(slices, key=lambda it: it[1].start_us - it[1].end_us)[:max_labels]
    for _, t in longest:
        ax.text((t.start_us + t.end_us) / 2, row[t.stream], t.name[:18], ha="center", va="center",
                fontsize=5, rotation=90, clip_on=True)
    ax.set_yticks([row[s] for s in streams], [_stream_name(s) for s in streams])
    ax.set_xlabel("time (us)")
    ax.set_title(f"{title}  step {result.step_time_us:.0f} us, exposed comm {result.exposed_comm_us:.0f} us, "
                 f"overlap {result.overlap_pct:.0f}% (slowdown {result.overlap_slowdown})".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log.info("wrote gantt %s", path)
    return os.fspath(path)
