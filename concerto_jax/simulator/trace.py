"""Export a simulated schedule: Perfetto/Chrome trace JSON and a Gantt chart PNG."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from concerto_jax.simulator.result import SimResult, difference, union
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
        import matplotlib  # lazy: an optional dependency (the [plot] extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use
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


def exposed_intervals(result: SimResult) -> list[tuple[float, float]]:
    """Where a collective is in flight and no kernel runs (``SimResult.exposed_comm_us`` as spans)."""
    compute = union((t.start_us, t.end_us) for t in result.timings if t.stream == COMPUTE_STREAM)
    comm = union((t.start_us, t.end_us) for t in result.timings if t.stream != COMPUTE_STREAM)
    return difference(comm, compute)


def chrome_trace_comparison(runs, metadata: Mapping[str, object] | None = None) -> dict:
    """One Perfetto trace of several schedules on the same time axis, one process each.

    Args:
      runs: ``(label, SimResult, TaskGraph or None)`` triples; process ``k`` is ``runs[k]``.
      metadata: extra key/values stored under ``otherData``.

    Returns:
      A JSON-serialisable dict; each run's summary is under ``otherData[label]``.
    """
    events, other = [], dict(metadata or {})
    for pid, (label, result, graph) in enumerate(runs):
        tr = chrome_trace(result, graph, process_name=label)
        events += [{**e, "pid": pid} for e in tr["traceEvents"]]
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        other[label] = tr["otherData"]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace_comparison(path: str | os.PathLike, runs, **kwargs) -> str:
    """Write ``chrome_trace_comparison(runs, ...)`` to ``path``; returns the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace_comparison(runs, **kwargs), f)
    log.info("wrote trace %s", path)
    return os.fspath(path)


def write_gantt_comparison(path: str | os.PathLike, runs, *, title: str = "") -> str:
    """Gantt charts of several schedules stacked on one time axis, exposed communication marked.

    Each run gets one panel: a row of compute kernels, a row per communication stream
    (collectives coloured by kind), and a row where communication is in flight, green where a
    kernel runs meanwhile (hidden), red where none does (exposed; also a red band across the
    panel). Needs matplotlib.

    Args:
      path: output PNG.
      runs: ``(label, SimResult, TaskGraph or None)`` triples, drawn top to bottom.
      title: figure title.

    Returns:
      The path written.
    """
    try:
        import matplotlib  # lazy: an optional dependency (the [plot] extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use
        from matplotlib.patches import Patch  # lazy: optional dependency
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("write_gantt_comparison needs matplotlib: pip install 'concerto_jax[plot]'") from e
    palette = {"all-reduce": "tab:orange", "all-gather": "tab:green", "reduce-scatter": "tab:purple",
               "all-to-all": "tab:olive", "collective-permute": "tab:brown"}
    ms = 1e-3
    end = max(r.step_time_us for _, r, _ in runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 1.2 + 1.9 * len(runs)), sharex=True,
                             squeeze=False)
    seen_ops: set[str] = set()
    for ax, (label, result, graph) in zip(axes[:, 0], runs, strict=True):
        comm_streams = sorted(s for s in result.stream_utilisation if s != COMPUTE_STREAM)
        rows = {COMPUTE_STREAM: 2 + len(comm_streams)}
        rows.update({s: 1 + len(comm_streams) - k for k, s in enumerate(comm_streams)})
        exposed = exposed_intervals(result)
        for s, e in exposed:  # behind everything: the band spans the whole panel
            ax.axvspan(s * ms, e * ms, color="red", alpha=0.18, lw=0)
        comm = union((t.start_us, t.end_us) for t in result.timings if t.stream != COMPUTE_STREAM)
        ax.broken_barh([(s * ms, (e - s) * ms) for s, e in comm], (0.6, 0.8), facecolors="tab:green")
        ax.broken_barh([(s * ms, (e - s) * ms) for s, e in exposed], (0.6, 0.8), facecolors="red")
        compute = union((t.start_us, t.end_us) for t in result.timings if t.stream == COMPUTE_STREAM)
        ax.broken_barh([(s * ms, (e - s) * ms) for s, e in compute], (rows[COMPUTE_STREAM] - 0.4, 0.8),
                       facecolors="tab:blue")
        for i, t in enumerate(result.timings):
            if t.stream == COMPUTE_STREAM or t.end_us <= t.start_us:
                continue
            op = "collective"
            if graph is not None and graph.tasks[i].collective is not None:
                op = graph.tasks[i].collective.op
            seen_ops.add(op)
            ax.broken_barh([(t.start_us * ms, (t.end_us - t.start_us) * ms)], (rows[t.stream] - 0.4, 0.8),
                           facecolors=palette.get(op, "tab:gray"), edgecolor="black", linewidth=0.3)
        ax.axvline(result.step_time_us * ms, color="black", ls="--", lw=1)
        ax.annotate(f"end of step: {result.step_time_us * ms:.2f} ms",
                    (result.step_time_us * ms, rows[COMPUTE_STREAM] + 1.05), xytext=(-6, 0),
                    textcoords="offset points", ha="right", va="top", fontsize=8)
        ax.set_yticks([rows[COMPUTE_STREAM], *(rows[s] for s in comm_streams), 1],
                      ["compute", *(("communication" if len(comm_streams) == 1 else _stream_name(s))
                                    for s in comm_streams), "comm. hidden / exposed"])
        ax.set_ylim(0.3, rows[COMPUTE_STREAM] + 1.1)
        comm_us = result.comm_busy_us
        ax.set_title(f"{label}: step {result.step_time_us * ms:.2f} ms, communication "
                     f"{comm_us * ms:.2f} ms of which exposed {result.exposed_comm_us * ms:.2f} ms "
                     f"({result.overlap_pct:.0f}% overlapped)", loc="left", fontsize=10)
    axes[-1, 0].set_xlim(0, end * ms * 1.01)
    axes[-1, 0].set_xlabel("time (ms)")
    handles = [Patch(color="tab:blue", label="compute kernels")]
    handles += [Patch(color=palette.get(op, "tab:gray"), label=op) for op in sorted(seen_ops)]
    handles += [Patch(color="tab:green", label="communication hidden behind compute"),
                Patch(color="red", label="exposed communication (no kernel runs)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote gantt %s", path)
    return os.fspath(path)
