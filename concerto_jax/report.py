"""Report: what ``optimize`` did to one compiled signature of a step."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hlo_passes.registry import Retry


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One pass of the pipeline: whether it changed the module, its statistics, its tolerance."""

    name: str
    changed: bool
    seconds: float
    stats: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 0.0  # relative difference from the original allowed (0: bitwise)
    retries: tuple[Retry, ...] = ()  # what the pass offers a guard instead (hlo_passes.registry.Retry)

    @classmethod
    def from_dict(cls, data: dict) -> PassRecord:
        """Inverse of ``dataclasses.asdict`` after a JSON round trip (a cached plan, another process)."""
        data = dict(data)
        data["retries"] = tuple(Retry.from_dict(r) for r in data.get("retries", ()))
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class Report:
    """The account of one compiled signature.

    Attributes:
      function: name of the user's step.
      num_devices: devices (SPMD partitions) of the program.
      optimized: True if the optimised module runs; False if the step fell back.
      fallback_reason: why it fell back (None when optimised).
      instructions: instructions in the entry computation of the captured module.
      collectives: count of collectives by kind in the captured module.
      passes: the pipeline's passes, in order.
      stage_seconds: wall time per stage (capture, parse, passes, print, compile).
      executable: what runs: ``"original"`` (JAX's own executable of the step: the
        pipeline left the module unchanged, or the step fell back) or
        ``"recompiled"`` (our emitted module, compiled as a replicated program).
      first_step_check: the safety net (``Options.optimize.check_first_step``): whether the
        first optimised call was compared with the original step, and what it found.
    """

    function: str
    num_devices: int
    optimized: bool
    fallback_reason: str | None = None
    instructions: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)
    passes: tuple[PassRecord, ...] = ()
    stage_seconds: dict = dataclasses.field(default_factory=dict)
    executable: str = "recompiled"
    first_step_check: str = "not run"

    def __str__(self) -> str:
        lines = [f"concerto_jax report for {self.function!r} on {self.num_devices} devices"]
        if self.optimized and self.executable == "original":
            lines.append("  status: identity pipeline, JAX's own executable of the step runs "
                         "(no recompile)")
        elif self.optimized:
            lines.append("  status: optimised module in use")
        else:
            lines.append(f"  status: FELL BACK to the original step ({self.fallback_reason})")
        lines.append(f"  entry instructions: {self.instructions}")
        coll = ", ".join(f"{k} x{v}" for k, v in sorted(self.collectives.items())) or "none"
        lines.append(f"  collectives: {coll}")
        if self.passes:
            lines.append("  passes:")
            for p in self.passes:
                stats = ", ".join(f"{k}={v}" for k, v in p.stats.items())
                lines.append(f"    {p.name:<18} changed={p.changed!s:<5} {p.seconds:7.3f}s  {stats}")
        else:
            lines.append("  passes: none (identity pipeline)")
        lines.append(f"  first-step check: {self.first_step_check}")
        if self.stage_seconds:
            st = "  ".join(f"{k} {v:.3f}s" for k, v in self.stage_seconds.items())
            lines.append(f"  stage times: {st}")
        return "\n".join(lines)


def count_collectives(kinds) -> dict:
    """Histogram of collective kinds (an iterable of kind names)."""
    return dict(Counter(kinds))
