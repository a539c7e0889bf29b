"""PGLE profiles written from our cost model, so XLA's latency hiding scheduler uses our costs.

XLA:GPU reads a ``ProfiledInstructionsProto`` (text format) given as
``xla_gpu_pgle_profile_file_or_directory_path``: one ``costs { name: "<instruction>"
cost_us: <float> }`` per instruction of the scheduled computation. Names are those
of the module LHS receives (the before-LHS dump), so the profile is written from
that module's task graph: compute tasks under their own names and each async
collective under its ``-start`` name (XLA looks the pair up by the start).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from concerto_jax.taskgraph import TaskGraph

log = logging.getLogger(__name__)


def profile_text(costs_us: Mapping[str, float]) -> str:
    """``ProfiledInstructionsProto`` text for ``{instruction name: cost in us}``."""
    lines = []
    for name, us in costs_us.items():
        escaped = name.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'costs {{ name: "{escaped}" cost_us: {max(float(us), 0.0):.4f} }}')
    return "\n".join(lines) + "\n"


def costs_from_graph(graph: TaskGraph) -> dict[str, float]:
    """Per-instruction costs (us) of a task graph built by ``hlo_taskgraph`` (zero-cost tasks skipped)."""
    return {t.name: t.duration_us for t in graph.tasks if t.duration_us > 0}


def write_profile(path: str | os.PathLike, costs_us: Mapping[str, float]) -> str:
    """Write a PGLE profile file; returns its path."""
    with open(path, "w") as f:
        f.write(profile_text(costs_us))
    log.info("wrote PGLE profile with %d costs to %s", len(costs_us), path)
    return os.fspath(path)
