"""Options of ``concerto_jax.optimize`` and ``compile_for_target``: frozen dataclasses, one
comment per field. ``Options`` holds what both entry points read (passes, target, the passes'
own settings, compiling and dumping the result); ``Options.optimize`` (``OptimizeOptions``) what
only ``optimize`` reads, ``Options.deviceless`` (``DevicelessOptions``) what only
``compile_for_target`` reads."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping
from typing import Any

from concerto_jax.costmodel.cluster import CLUSTERS
from concerto_jax.costmodel.envelope import ENVELOPE, Variant
from concerto_jax.scheduler import ScheduleOptions
from hlo_passes.decompose.options import DecomposeOptions
from hlo_passes.registry import pass_names


@dataclasses.dataclass(frozen=True)
class DevicelessOptions:
    """What ``compile_for_target`` searches beyond the passes (``Options.deviceless``): XLA's
    combine thresholds, the call's time budget, the memory budget of the plan, and the cost
    models its decisions must win under. ``optimize`` does not read them."""

    # With passes: also plan the program with XLA's all-reduce / all-gather / reduce-scatter
    # combine thresholds at each of these byte sizes (one XLA compile each) and keep the
    # fastest plan if it beats the one at the given compiler options (TargetResult.passes:
    # the "combine_thresholds" record).
    # XLA's buckets wait for their last member; smaller ones overlap earlier, bigger ones
    # pay fewer latencies. () : off.
    combine_thresholds: tuple[int, ...] = (128 << 20, 32 << 20, 8 << 20, 2 << 20, 512 << 10)
    # Then, where two or more of those kinds carry more bytes than the smallest size, one
    # round of coordinate descent per kind over the same sizes (a ZeRO-3 step's weight
    # gathers and gradient reduce-scatters want different sizes): up to
    # (len(combine_thresholds) + 1) more compiles per such kind.
    combine_per_kind: bool = True
    # How many candidates of that search are compiled beyond the smallest size. The smallest
    # size is compiled first; every other candidate (each uniform size, and the per-kind
    # round) is estimated on its module with XLA's combiners emulated
    # (concerto_jax.deviceless.thresholds), and only the best-estimated ones with a bucket
    # structure of their own are compiled and planned; the search keeps a real plan only.
    # None: every candidate compiled (the estimates are still recorded beside the plans).
    combine_compiles: int | None = 2
    # The whole call's budget. Where the optional searches (the combine-threshold candidates,
    # the guard's search of the original program, the replicated-only alternative) would not
    # fit in what is left, they are not run; the best plan found so far is kept (never one
    # slower than stock: the final-module guard still decides) and the records say what was
    # cut (TargetResult.cut). "auto": a count of XLA compiles of the step, stock's and one
    # threshold search's (deviceless.budget.auto_budget_compiles: 3.6 at the defaults), so that
    # the plan depends on the program alone, not on the machine's speed or load; seconds: wall
    # time from the call to the final compile (a loaded machine searches less); None: no bound.
    time_budget_s: float | str | None = "auto"
    # The memory the "schedule" pass may plan with. "xla": up to the
    # limit XLA's own GPU scheduler holds itself to on the target ((80 % of the device's
    # memory - parameter and output bytes) x xla_gpu_memory_limit_slop_factor %, 95 by
    # default), never below the peak of XLA's order; every decision compares plans within that
    # limit, and the chosen program is also planned held to the peak of XLA's order, the faster
    # of its two plans kept (the schedule record's memory_candidates, with both peaks).
    # "input": never above the peak of XLA's order (Options.scheduler's limit alone). "both":
    # every plan of every decision made both ways (a second solve per plan; docs/DECISIONS.md
    # D48). With "xla" and control flow, each computation plans within its share of the
    # budget (entry 1/2, a loop body 1/4, nested 1/8, ...: ``judge.budget_share``), never
    # below its input order's peak.
    memory_budget: str = "xla"
    # The cost models decisions that trade extra kernels or bytes for
    # hidden communication are judged under (costmodel.envelope.ENVELOPE: the nominal model and
    # each configured GPU figure at both ends of its plausible range). The rewrite guard keeps a
    # rewrite, and the combine-threshold search a threshold, only where its worst-case gain over
    # stock XLA's program across these models is higher than without it (maximin); the
    # final-module guard keeps our program only where it is no slower than stock's under every
    # one (TargetResult.robust: nominal and worst-case gain per decision). () : the nominal
    # model alone decides (no robust judgement).
    robust: tuple[Variant, ...] = ENVELOPE

    def __post_init__(self):
        if any(not isinstance(b, int) or b < 0 for b in self.combine_thresholds):
            raise ValueError(f"combine_thresholds must be byte sizes >= 0, got "
                             f"{self.combine_thresholds!r}")
        if not isinstance(self.combine_per_kind, bool):
            raise TypeError(f"combine_per_kind must be True or False, got {self.combine_per_kind!r}")
        if self.combine_compiles is not None and (
                isinstance(self.combine_compiles, bool) or not isinstance(self.combine_compiles, int)
                or self.combine_compiles < 0):
            raise ValueError(f"combine_compiles must be an int >= 0 or None, got {self.combine_compiles!r}")
        if self.time_budget_s is not None and self.time_budget_s != "auto" and (
                isinstance(self.time_budget_s, bool) or not isinstance(self.time_budget_s, (int, float))
                or not self.time_budget_s > 0):
            raise ValueError(f"time_budget_s must be seconds > 0, 'auto' or None, got {self.time_budget_s!r}")
        if self.memory_budget not in ("xla", "input", "both"):
            raise ValueError(f"memory_budget must be 'xla', 'input' or 'both', got {self.memory_budget!r}")
        if not isinstance(self.robust, tuple) or not all(isinstance(v, Variant) for v in self.robust):
            raise TypeError(f"robust must be a tuple of costmodel.envelope.Variant (() : off), got "
                            f"{self.robust!r}")
        if len({v.name for v in self.robust}) != len(self.robust):
            raise ValueError(f"robust: variant names must be unique, got {[v.name for v in self.robust]}")


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """What only ``optimize`` reads (``Options.optimize``): the first-step check of a recompiled
    step, what it holds a reassociating pass to, and whether an unchanged module is recompiled.
    None of it changes a plan (the plan cache's key leaves the group out)."""

    # Safety net for a recompiled module: on the first call of a signature, run
    # the original step on a copy of the inputs, compare its outputs with ours
    # (bitwise, or within the tolerance the passes declare) and on a difference
    # return the original's outputs and fall back with one warning. "auto" runs
    # it when a copy of the inputs plus one extra set of outputs fits in half of
    # the free memory (each device's memory_stats() on GPU/TPU, the host's
    # available memory on CPU): a training state is often most of a device's
    # memory, and a check that ran the device out of memory would be the crash
    # it exists to prevent. Skipped for steps with side effects (debug.print,
    # io_callback), which would fire twice, and under "auto" when
    # compiler_options are set (True then compares with the original compiled
    # with the same options). The identity pipeline runs JAX's own executable
    # and needs no check. True: always; False: never. A pass that reassociates sums
    # (declares a tolerance: decompose's region split) runs only where the check runs: where
    # it cannot (side effects, memory), that pass is left out with one warning; under "auto"
    # with compiler_options such a module is checked against the original compiled with the
    # same options. False runs it unchecked.
    check_first_step: bool | str = "auto"
    # What a reassociating pass's first step is held to. "original": every output within the
    # tolerance the passes declare of the original's; where one is not, those passes are
    # left out (the step is rebuilt without them, the rest kept). On bf16 steps with Adam
    # that is the common case: Adam's first update is +-lr on the sign of each gradient, so
    # a rounding-level change of a near-zero gradient moves a parameter by 2 x lr, past any
    # fixed tolerance. "wider": where an output is past the tolerance, the step also runs in
    # wider precision (hlo_passes.upcast: bf16 / f16 -> f32, else f32 -> f64), and the
    # optimised outputs are kept when each leaf is as close to that run as the original's
    # (largest and RMS error at most first_step.ACCURACY_FACTOR = 2x the original's, or
    # within the tolerance; other leaves bitwise): as accurate as the original step, not
    # equal to it. Costs, on the first call only, one more compile and step and a second
    # copy of the inputs (the check then needs two copies within half of the free memory).
    first_step_reference: str = "original"
    # Recompile the post-SPMD module even when no pass changed it. By default an
    # unchanged module runs JAX's own executable of the step (identical by
    # construction); True exercises our recompile path (tests, debugging).
    always_recompile: bool = False

    def __post_init__(self):
        if self.check_first_step not in (True, False, "auto"):
            raise ValueError(
                f"check_first_step must be True, False or 'auto', got {self.check_first_step!r}")
        if self.first_step_reference not in ("original", "wider"):
            raise ValueError(f"first_step_reference must be 'original' or 'wider', got "
                             f"{self.first_step_reference!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``optimize`` and ``compile_for_target`` do to a step, and how they report it; what
    only one of them reads is in its group (``optimize``, ``deviceless``).

    The defaults are safe: every pass that changes the program keeps the
    results bitwise equal (they only reorder or regroup work), and any
    internal failure falls back to the original step with one warning.
    """

    # Passes, in pipeline order; the accepted names are those of
    # hlo_passes.registry.PASS_TABLE: "decompose" (split the computation around
    # critical collectives; put it before "schedule"), "schedule" (RCPSP order of the
    # program), "fuse_collectives" (merge fusible collectives into one,
    # fused size chosen by the cost model), "pin" (opt-barriers that keep each
    # collective's planned window through XLA's GPU scheduler). An empty tuple
    # runs the identity pipeline (capture -> IR -> print -> execute).
    passes: tuple[str, ...] = ()
    # Run the IR verifier after parsing and after every pass (cheap; keep on).
    verify: bool = True
    # Check that XLA's own parser accepts the emitted module before compiling.
    validate_with_xla: bool = True
    # Extra XLA compiler options for compiling the optimised module, e.g.
    # {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"} (values: bool/int/str).
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # On an internal failure (a pass or XLA rejecting our module), warn once
    # and run the original step. False re-raises instead (for debugging/tests).
    fallback: bool = True
    # If set, write the captured and the emitted HLO text of every compiled
    # signature into this directory, with the emitted module's scheduled form
    # (is_scheduled=true, async collective start/done pairs at planned positions).
    dump_dir: str | None = None
    # Target cluster whose cost model drives the passes (a name from
    # concerto_jax.costmodel.CLUSTERS, e.g. "h100_sxm_8", "h100_sxm_2x8"). optimize on GPUs of
    # another kind, in one process, plans with that GPU's cluster where one is shipped
    # (gpu_route.route.cost_target_for: on H200s, the kernel rates measured there).
    target: str = "h100_sxm_8"
    # Scheduler settings of the "schedule" pass (time limits, windows, seed).
    scheduler: ScheduleOptions = ScheduleOptions()
    # What optimize does on the first call of each signature (the first-step check) and
    # whether it recompiles an unchanged module; compile_for_target does not read it.
    optimize: OptimizeOptions = OptimizeOptions()
    # Settings of the "decompose" pass (degrees, context limits, joint search).
    decompose: DecomposeOptions = DecomposeOptions()
    # What compile_for_target searches beyond the passes (combine thresholds, time and memory
    # budgets, the plausible cost models); optimize does not read it.
    deviceless: DevicelessOptions = DevicelessOptions()
    # Persistent plan cache (concerto_jax.plan_cache): a second compile of the same step (same
    # lowered program, devices or target, plan-changing options, versions) reuses the plan and,
    # where one exists, the compiled executable, verified. "auto": $CONCERTO_JAX_CACHE_DIR, else
    # $XDG_CACHE_HOME/concerto_jax/plans, else ~/.cache/concerto_jax/plans (read at each
    # compile); a directory; None: off.
    cache_dir: str | os.PathLike | None = "auto"

    def __post_init__(self):
        if isinstance(self.passes, str):
            raise TypeError(f"passes must be a tuple of pass names, got the string {self.passes!r}; "
                            f"write passes=({self.passes!r},)")
        known = pass_names()
        unknown = [p for p in self.passes if p not in known]
        if unknown:
            raise ValueError(f"unknown pass name(s) {unknown}; expected some of {sorted(known)}")
        if self.target not in CLUSTERS:
            raise ValueError(f"unknown target {self.target!r}; expected one of {sorted(CLUSTERS)}")
        for name, group in GROUPS.items():
            if not isinstance(getattr(self, name), group):
                raise TypeError(f"{name} must be a {group.__name__}, got {type(getattr(self, name)).__name__}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a directory, 'auto' or None, got "
                            f"{type(self.cache_dir).__name__}")
        if not isinstance(self.compiler_options, Mapping):
            raise TypeError(
                f"compiler_options must be a mapping of XLA option -> value, got "
                f"{type(self.compiler_options).__name__}")


GPU_PLAN_PASSES: tuple[str, ...] = ("schedule", "pin")
"""The passes that make XLA's GPU compiler run our plan: the RCPSP order, pinned so that
XLA's scheduler keeps its overlap windows."""

GPU_ROUTE_PASSES: tuple[str, ...] = ("decompose", "schedule")
"""The passes ``optimize`` is meant to run by default on GPUs, on the GPU route
(``concerto_jax.gpu_route``: our order of XLA's own scheduled module, compiled by XLA's
backend only and loaded behind the step's header), with the first-step check on (the default
``check_first_step="auto"``: wherever a copy of the inputs fits; ``decompose`` only runs where
the check does). Turn them on with ``Options(passes=GPU_ROUTE_PASSES)``."""

GPU_ROUTE_CHECKED: bool = True
"""Whether ``python -m concerto_jax.gpu_check`` item a (the full route on real train steps, 3
steps bitwise equal to plain ``jax.jit``, our order present in the loaded executable, every
step within 1.03x of plain ``jax.jit``'s time) has passed on real hardware. It has: one H200,
jax 0.11.2, 2026-11-28 (bench/results/gpu/h200-2026-11-28/route-2, docs/RESULTS.md), on 1-GPU
steps; the multi-GPU load is rehearsed on CPU only, behind the first-step check."""

GPU_DEFAULT_PASSES: tuple[str, ...] = GPU_ROUTE_PASSES if GPU_ROUTE_CHECKED else ()
"""Passes ``optimize`` runs when the user gives no ``Options`` and the step runs on GPUs:
``GPU_ROUTE_PASSES`` since the route passed ``gpu_check`` on a GPU (``GPU_ROUTE_CHECKED``)."""

GROUPS: dict[str, type] = {"optimize": OptimizeOptions, "deviceless": DevicelessOptions}
"""``Options``' groups by field name: what only one entry point reads."""

GROUPED_FIELDS: dict[str, str] = {f.name: group for group, cls in GROUPS.items()
                                  for f in dataclasses.fields(cls)}
"""Each grouped field -> its group. ``Options`` also takes these at its top level (the spelling
before the groups existed: ``Options(time_budget_s=None)`` is
``Options(deviceless=DevicelessOptions(time_budget_s=None))``) and reads them as properties,
each with a ``DeprecationWarning``."""


def _take_grouped_fields(init):
    """``Options.__init__`` that moves ``GROUPED_FIELDS`` given at the top level into their
    group, with a ``DeprecationWarning`` (``dataclasses.replace`` calls it too)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in GROUPED_FIELDS}
        for group, cls in GROUPS.items():
            mine = {k: v for k, v in flat.items() if GROUPED_FIELDS[k] == group}
            if not mine:
                continue
            names = ", ".join(f"{k}=..." for k in mine)
            warnings.warn(f"Options({names}) is deprecated: write Options({group}={cls.__name__}({names}))",
                          DeprecationWarning, stacklevel=2)
            kwargs[group] = dataclasses.replace(kwargs.get(group, cls()), **mine)
        init(self, *args, **kwargs)

    return __init__


def _grouped_field(name: str) -> property:
    """A read of ``Options.<name>``: ``Options.<group>.<name>``, with a ``DeprecationWarning``."""
    group = GROUPED_FIELDS[name]

    def read(self):
        warnings.warn(f"Options.{name} is deprecated: read Options.{group}.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(getattr(self, group), name)

    return property(read, doc=f"Deprecated: ``{group}.{name}``.")


Options.__init__ = _take_grouped_fields(Options.__init__)
for _name in GROUPED_FIELDS:
    setattr(Options, _name, _grouped_field(_name))
del _name

_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def defaults_for_platform(platform: str) -> Options:
    """The default ``Options`` for a backend: ``GPU_DEFAULT_PASSES`` on GPUs, identity elsewhere
    (XLA:CPU has no async collectives, so a schedule buys nothing there)."""
    return Options(passes=GPU_DEFAULT_PASSES) if platform in _GPU_PLATFORMS else Options()
