"""Options of the ``decompose`` pass: one frozen dataclass, one comment per field."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecomposeOptions:
    """How the ``decompose`` pass searches and judges strategies."""

    # Count independent compute without per-kernel launch overhead in the critical rule
    # (the unfused graph's small ops fuse on the GPU; see critical.find_critical).
    fused_slack: bool = True
    # Degrees tried per context: powers of two up to this (bounded by the shape).
    max_degree: int = 8
    # Members per side of a context (BFS limit).
    max_context_ops: int = 256
    # Stop a context side once its compute reaches this multiple of the collective's time.
    cover_factor: float = 1.0
    # Judge the chosen strategies by scheduling + simulating the rewritten graph and
    # revise them (other degree, other axis, none) where that is faster (joint search).
    joint: bool = True
    # At most this many rewrite-schedule-simulate evaluations in the joint search.
    joint_max_evaluations: int = 24
    # Decompose collectives inside while bodies (scanned layers) too.
    loop_bodies: bool = True
    # Path of the measured calibration JSON (None: the one shipped with the package).
    calibration_path: str | None = None
    # CP-SAT wall limit of the strategy choice.
    choice_time_limit_s: float = 5.0
    # Testing / ablation only: take, for every critical collective, the candidate of
    # this degree (and axis, if set) whatever its predicted gain, critical or not; no
    # joint revision.
    force_degree: int | None = None
    force_axis: int | None = None
