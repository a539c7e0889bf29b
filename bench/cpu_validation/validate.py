"""Whole programs against the per-kernel profile and the analytic model (``validate_program``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from bench.cpu_validation.host import page_faults_per_run
from bench.cpu_validation.measure import in_program_kernel_us, profile_module_on_cpu
from bench.cpu_validation.rates import (
    CPU_COMPUTE_OPTIONS,
    CpuRates,
    cpu_kernel_class,
    cpu_kernel_model,
    cpu_spec_probes,
    rates_from_spec,
)
from concerto_jax.costmodel.specs import GpuSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """One kernel of a validated program: its time inside the program and the two predictions."""

    name: str
    in_program_us: float | None  # XLA:CPU's profiler, median of the profiled runs (None: not in the trace)
    store_us: float  # the store's time for its signature (measured alone, process CPU time)
    analytic_us: float  # the analytic per-class model with the probed rates
    kernel_class: str = ""  # its class in the analytic model (``cpu_kernel_class``)


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """Simulated vs measured time of one single-device CPU program.

    Times are process CPU time by default: XLA:CPU runs the program on one pinned core
    (``pin_to_one_cpu``), so that is the time the core spent on it, and time the process
    waited for a neighbour on a shared machine does not count. Wall times are kept
    next to them.

    Attributes:
      name: program name.
      measured_us: median process CPU time of the jitted program less its dispatch (``dispatch_twin``).
      from_store_us: simulated step time with the per-kernel store (process CPU times).
      analytic_us: simulated step time with the analytic per-class CPU model (``cpu_kernel_time_us``,
        rates from ``CpuSpecProbes.rates_from``).
      kernels: distinct kernels timed alone.
      failed: kernels XLA would not compile alone (the analytical model stands in).
      measured_wall_us: least wall time of the program less its dispatch's.
      from_store_wall_us: simulated with the store of least wall times.
      in_program_sum_us: sum of the entry kernels' in-program times (profiler, wall).
      kernel_rows: per-kernel comparison, program order.
      page_faults: fewest minor page faults of one program run.
      temp_bytes: the executable's temporary buffer (XLA's memory analysis).
      cpu_spec: what the per-class probes measured (``CpuRates.source``).
      roofline_us: the one-bandwidth, one-GEMM-rate roofline (``compute_time_us`` with the
        probed ``GpuSpec``), the analytic model before the kernel classes, for comparison.
    """

    name: str
    measured_us: float
    from_store_us: float
    analytic_us: float
    kernels: int
    failed: int
    measured_wall_us: float = float("nan")
    from_store_wall_us: float = float("nan")
    in_program_sum_us: float = float("nan")
    kernel_rows: tuple[KernelRow, ...] = ()
    page_faults: int = -1
    temp_bytes: int = -1
    cpu_spec: str = ""
    roofline_us: float = float("nan")

    @staticmethod
    def _err(predicted: float, measured: float) -> float:
        return 100.0 * (predicted - measured) / measured

    @property
    def store_error_pct(self) -> float:
        return self._err(self.from_store_us, self.measured_us)

    @property
    def analytic_error_pct(self) -> float:
        return self._err(self.analytic_us, self.measured_us)

    @property
    def roofline_error_pct(self) -> float:
        return self._err(self.roofline_us, self.measured_us)

    @property
    def store_wall_error_pct(self) -> float:
        return self._err(self.from_store_wall_us, self.measured_wall_us)


def mean_abs_error_pct(errors: Sequence[float]) -> float:
    """Mean of the absolute values (the validation's figure of merit); nan for no errors."""
    errors = list(errors)
    return sum(abs(e) for e in errors) / len(errors) if errors else float("nan")


def dispatch_twin(fn: Callable, args: Sequence):
    """A compiled program with ``fn``'s arguments and output tree that does (almost) nothing.

    Its time is the dispatch cost of calling ``fn``'s executable (argument pytree,
    buffers in, one output buffer per leaf out), which no kernel contains: the
    Evoformer block train step (200 argument leaves) spends ~1.3 ms per call there,
    against ~10 us for a one-argument program.
    """
    import jax
    import jax.numpy as jnp

    out = jax.eval_shape(fn, *args)
    try:
        return jax.jit(lambda *a: jax.tree.map(lambda s: jnp.zeros((), s.dtype), out),
                       keep_unused=True).lower(*args).compile()
    except (TypeError, ValueError) as e:  # an output dtype without zeros: one-argument program instead
        log.warning("no dispatch twin (%s); subtracting a one-argument program's dispatch", e)
        small = jax.device_put(np.zeros((1,), np.float32), jax.devices("cpu")[0])
        trivial = jax.jit(lambda x: -x).lower(small).compile()
        return lambda *_: trivial(small)


def validate_program(name: str, fn: Callable, args: Sequence, *, cpu_spec: GpuSpec | None = None,
                     cpu_rates: CpuRates | None = None, repeats: int = 15, profile_repeats: int = 5) -> ValidationRow:
    """Measure ``jit(fn)(*args)`` on CPU and predict it from per-kernel times and from the CPU spec.

    The program is the executable XLA:CPU compiled for ``fn``; its optimized module
    gives the kernels (timed alone into the store) and the task graph both models
    are simulated on. The program, a trivial jitted program (dispatch overhead),
    the standalone dispatch overhead and every kernel are timed in the same
    interleaved rounds; then ``profile_repeats`` profiled runs of the program give
    every kernel's time inside it (``in_program_kernel_us``).

    Args:
      name: program name (reports).
      fn: the function (jitted here, no donation).
      args: its arguments (placed on CPU device 0).
      cpu_spec: the CPU spec of the analytical model; by default its probes
        (``cpu_spec_probes``) are timed in the program's rounds, so the spec is
        measured under the same load as the program it predicts (``ValidationRow.cpu_spec``).
      cpu_rates: the per-class rates of the analytic model; by default probed in the
        program's rounds, or, with ``cpu_spec`` given, that spec's rates for every class
        (``rates_from_spec``).
      repeats: interleaved timing rounds.
      profile_repeats: profiled program runs for the per-kernel comparison (0: none).
    """
    import jax

    from concerto_jax.costmodel.cluster import get_cluster
    from concerto_jax.costmodel.model import CostModel, CostOptions
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.simulator import SimOptions, simulate
    from hlo_passes.ir.parser import parse_module

    dev = jax.devices("cpu")[0]
    args = [jax.device_put(a, dev) for a in args]
    compiled = jax.jit(fn).lower(*args).compile()
    twin = dispatch_twin(fn, args)
    module = parse_module(compiled.as_text())

    def program():
        return jax.block_until_ready(compiled(*args))

    # Program, its dispatch overhead, every kernel and (unless given) the CPU spec's probes in the same rounds.
    probes = cpu_spec_probes() if cpu_spec is None or cpu_rates is None else None
    extra = {"program": program, "jit_overhead": lambda: jax.block_until_ready(twin(*args))}
    extra.update({f"probe:{k}": run for k, run in (probes.runners.items() if probes else ())})
    prof = profile_module_on_cpu(module, repeats=repeats, profile_repeats=profile_repeats, extra=extra)
    measured_wall = max(prof.extra_us["program"] - prof.extra_us["jit_overhead"], 1e-3)
    measured = max(prof.extra_cpu_us["program"] - prof.extra_cpu_us["jit_overhead"], 1e-3)
    cluster = get_cluster("h100_sxm_8")  # placement only; single device programs have no collectives
    probe_us = {k[len("probe:"):]: v for k, v in prof.extra_cpu_us.items() if k.startswith("probe:")}
    spec = cpu_spec or probes.spec_from(probe_us)
    rates = cpu_rates or (rates_from_spec(cpu_spec) if cpu_spec is not None else probes.rates_from(probe_us))
    opts = CostOptions(compute=CPU_COMPUTE_OPTIONS, overlap_slowdown=1.0)
    sim = SimOptions(overlap_slowdown=1.0, memory=False)

    def simulated(model) -> float:
        built = build_taskgraph(module, model)
        return simulate(built.graph, built.events, sim).step_time_us

    store_model = CostModel(cluster, opts, store=prof.cpu_store, gpu=spec)
    analytic_model = cpu_kernel_model(cluster, opts, rates)
    in_prog = in_program_kernel_us(program, prof.timed, profile_repeats) if profile_repeats > 0 else {}
    rows = tuple(KernelRow(k, in_prog.get(k), store_model.compute_us(info), analytic_model.compute_us(info),
                           cpu_kernel_class(info)) for k, info in prof.timed.items())
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except (AttributeError, TypeError):  # memory analysis is optional per backend
        temp = -1
    return ValidationRow(name, measured, simulated(store_model), simulated(analytic_model), prof.measured,
                         len(prof.failed), measured_wall,
                         simulated(CostModel(cluster, opts, store=prof.store, gpu=spec)),
                         sum(in_prog.values()) if in_prog else float("nan"), rows, page_faults_per_run(program),
                         temp, rates.source or spec.name, simulated(CostModel(cluster, opts, gpu=spec)))
