"""CPU validation of the method: measure kernels one by one, fill a ``ProfileStore``, compare with whole programs.

No GPU here, so the *method* is validated on the host CPU: for a single-device
jitted program, every kernel of XLA:CPU's optimized module is compiled as its
own module (a fusion's fused computation becomes the entry; any other
instruction gets parameters for its operands) and timed; the per-kernel times
go into a ``ProfileStore`` keyed by signature. Simulating the program's task
graph with those times (``CostModel(store=...)``) should then predict the
whole-program time, and so should the analytical model given a measured CPU
spec (``measure_cpu_spec``: GEMM rate and streaming bandwidth). Dispatch
overhead (measured on a trivial program, per path) is subtracted from every
timing. Times are minima over repeats (the least disturbed run: the machine is shared).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from concerto_jax.costmodel.compute import ComputeOptions
from concerto_jax.costmodel.profile_store import ProfileStore
from concerto_jax.costmodel.specs import GpuSpec

log = logging.getLogger(__name__)

_NP_DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s32": np.int32, "s64": np.int64,
              "u32": np.uint32, "u8": np.uint8, "s8": np.int8, "pred": np.bool_}


def _best_us(run: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Minimum wall time over ``repeats`` runs: the least disturbed sample on a shared machine."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t)
    return 1e6 * min(samples)


def compile_hlo_cpu(text: str):
    """Compile HLO text for CPU device 0 through XLA's parser and StableHLO (a loaded executable)."""
    import jax
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc

    module = xc.hlo.hlo_module_from_text(text)
    mlir = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
    dev = jax.devices("cpu")[0]
    return dev.client.compile_and_load(mlir, xc.DeviceList((dev,)), xc.CompileOptions())


def _args_for(shapes) -> list:
    import jax

    rng = np.random.default_rng(0)
    out = []
    for s in shapes:
        dtype = _NP_DTYPES.get(s.dtype)
        if dtype is None:
            if s.dtype == "bf16":
                import ml_dtypes

                dtype = ml_dtypes.bfloat16
            else:
                raise ValueError(f"no host dtype for {s.dtype}")
        a = rng.standard_normal(s.dims).astype(dtype) if np.issubdtype(np.dtype(dtype), np.floating) \
            else np.zeros(s.dims, dtype)
        out.append(jax.device_put(a, jax.devices("cpu")[0]))
    return out


def hlo_cpu_runner(text: str, param_shapes) -> Callable[[], object]:
    """A callable running HLO ``text`` once on CPU (compiled once, inputs random, result awaited)."""
    import jax

    exe = compile_hlo_cpu(text)
    args = _args_for(param_shapes)

    def run():
        return jax.block_until_ready(exe.execute_sharded(args).disassemble_into_single_device_arrays())

    return run


def interleaved_best_us(runners: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Best time of each runner, timed in interleaved rounds so that load drift hits all alike."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(repeats):
        for key, run in runners.items():
            t = time.perf_counter()
            run()
            best[key] = min(best[key], 1e6 * (time.perf_counter() - t))
    return best


def time_hlo_cpu_us(text: str, param_shapes, repeats: int = 15) -> float:
    """Best wall time of one execution of HLO ``text`` on CPU (dispatch included)."""
    return _best_us(hlo_cpu_runner(text, param_shapes), repeats)


_TRIVIAL = """HloModule trivial
ENTRY %main (p: f32[1]) -> f32[1] {
  %p = f32[1]{0} parameter(0)
  ROOT %n = f32[1]{0} negate(%p)
}"""


def dispatch_overhead_us(repeats: int = 50) -> float:
    """Best time of a trivial module on the standalone path (subtracted from kernel timings)."""
    from hlo_passes.shapes import Shape

    return time_hlo_cpu_us(_TRIVIAL, [Shape.array("f32", (1,))], repeats)


_METADATA = re.compile(r", metadata=\{[^{}]*\}")


def _callees(comp, seen: dict) -> None:
    for inst in comp.instructions:
        for c in inst.called_computations:
            if c.name not in seen:
                _callees(c, seen)
                seen[c.name] = c


def standalone_module(inst) -> tuple[str, list]:
    """(HLO text, parameter shapes) of a module running just ``inst`` (fusions: their fused computation)."""
    from hlo_passes.printer import computation_to_text, instruction_to_text

    seen: dict = {}
    if inst.opcode == "fusion":
        body = inst.attrs["calls"]
        _callees(body, seen)
        entry = "ENTRY " + computation_to_text(body).lstrip()
        shapes = [p.shape for p in body.parameters]
    else:
        for c in inst.called_computations:
            _callees(c, seen)
            seen[c.name] = c
        shapes = [o.shape for o in inst.operands]
        params = [f"  %p{i} = {s} parameter({i})" for i, s in enumerate(shapes)]
        line = instruction_to_text(inst, root=True)
        head, _, rest = line.partition(f" {inst.opcode}(")
        args, _, attrs = rest.partition(")")
        line = f"{head} {inst.opcode}({', '.join(f'%p{i}' for i in range(len(shapes)))}){attrs}"
        sig = ", ".join(f"p{i}: {s.without_layout()}" for i, s in enumerate(shapes))
        entry = f"ENTRY %main ({sig}) -> {inst.shape.without_layout()} {{\n" + "\n".join(params) + f"\n  {line}\n}}"
    text = "HloModule single_" + inst.name.replace(".", "_") + "\n\n"
    text += "\n\n".join(computation_to_text(c) for c in seen.values()) + "\n\n" + entry + "\n"
    # HLO -> StableHLO mistranslates layout-changing bitcasts; a reshape moves the same elements.
    return _METADATA.sub("", text).replace(" bitcast(", " reshape("), shapes


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """Per-kernel CPU timings of one module: the store and what could not be measured."""

    store: ProfileStore
    measured: int
    failed: tuple[str, ...]
    overhead_us: float
    extra_us: dict[str, float] = dataclasses.field(default_factory=dict)


def profile_module_on_cpu(module, *, repeats: int = 15, store: ProfileStore | None = None,
                          extra: dict[str, Callable[[], object]] | None = None) -> KernelProfile:
    """Measure every kernel of ``module``'s entry (an ``hlo_passes`` module of XLA:CPU) into a store.

    Args:
      module: XLA:CPU's optimized module, parsed.
      repeats: interleaved timing rounds (best of).
      store: store to add to (a new ``ProfileStore("cpu")`` by default).
      extra: more runners timed in the same rounds (e.g. the whole program and
        its dispatch overhead); their best times are ``KernelProfile.extra_us``.

    Returns:
      The store, counts, the standalone-path dispatch overhead and the extra timings.
    """
    from concerto_jax.costmodel.compute import FREE_OPCODES
    from concerto_jax.hlo_taskgraph import ALIAS_OPCODES, op_info
    from hlo_passes.shapes import Shape

    store = store if store is not None else ProfileStore("cpu")
    failed: list[str] = []
    runners: dict[str, Callable[[], object]] = {"<overhead>": hlo_cpu_runner(_TRIVIAL, [Shape.array("f32", (1,))])}
    infos = {}
    cache: dict = {}
    for inst in module.entry.instructions:
        if inst.opcode in FREE_OPCODES or inst.opcode in ALIAS_OPCODES:
            continue
        info = op_info(inst, cache)
        if store.lookup(info) is not None:
            continue
        try:
            runners[inst.name] = hlo_cpu_runner(*standalone_module(inst))
        except Exception as e:  # XLA rejects some standalone forms; report them
            log.warning("could not compile %s (%s) alone: %s", inst.name, inst.opcode, str(e).splitlines()[0][:160])
            failed.append(inst.name)
            continue
        infos[inst.name] = info
    extra = extra or {}
    runners.update({f"<extra>{k}": v for k, v in extra.items()})
    best = interleaved_best_us(runners, repeats)
    overhead = best.pop("<overhead>")
    extra_us = {k: best.pop(f"<extra>{k}") for k in extra}
    for name, us in best.items():
        store.record(infos[name], max(us - overhead, 0.0))
    return KernelProfile(store, len(best), tuple(failed), overhead, extra_us)


def measure_cpu_spec(n: int = 1024, stream_elements: int = 1 << 22, repeats: int = 10) -> GpuSpec:
    """A ``GpuSpec`` for the host CPU from microbenchmarks: f32 GEMM rate and streaming bandwidth."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    mm = jax.jit(lambda x, y: x @ y)
    t_mm = _best_us(lambda: mm(a, a).block_until_ready(), repeats)
    v = jax.device_put(jnp.ones((stream_elements,), jnp.float32), dev)
    add = jax.jit(lambda x: x * 1.5 + 1.0)
    t_bw = _best_us(lambda: add(v).block_until_ready(), repeats)
    flops = 2.0 * n**3 / (t_mm * 1e-6)
    bw = 2.0 * 4 * stream_elements / (t_bw * 1e-6)
    ew = stream_elements * 2 / (t_bw * 1e-6)
    log.info("host CPU: %.1f GFLOP/s f32 GEMM, %.1f GB/s streaming", flops / 1e9, bw / 1e9)
    return GpuSpec(
        name="host CPU (measured)",
        matmul_tflops=(("f32", flops / 1e12), ("bf16", flops / 1e12)),
        vector_tflops=(("f32", ew / 1e12),),
        hbm_bytes_per_s=bw, memory_bytes=0, sm_count=0, nvlink_bytes_per_s=0.0, pcie_bytes_per_s=0.0,
        sources=(f"measured here: {n}^3 f32 matmul {t_mm:.0f} us; {stream_elements} f32 axpy {t_bw:.0f} us",),
    )


CPU_COMPUTE_OPTIONS = ComputeOptions(matmul_efficiency=1.0, memory_efficiency=1.0, launch_overhead_us=1.0)
"""Analytical CPU variant: the measured rates already are achieved rates; ~1 us per thunk (configured)."""


@dataclasses.dataclass(frozen=True)
class ValidationRow:
    """Simulated vs measured time of one single-device CPU program."""

    name: str
    measured_us: float
    from_store_us: float
    analytic_us: float
    kernels: int
    failed: int

    @property
    def store_error_pct(self) -> float:
        return 100.0 * (self.from_store_us - self.measured_us) / self.measured_us

    @property
    def analytic_error_pct(self) -> float:
        return 100.0 * (self.analytic_us - self.measured_us) / self.measured_us


def validate_program(name: str, fn: Callable, args: Sequence, *, cpu_spec: GpuSpec | None = None,
                     repeats: int = 15) -> ValidationRow:
    """Measure ``jit(fn)(*args)`` on CPU and predict it from per-kernel times and from the CPU spec."""
    import jax

    from concerto_jax.costmodel.cluster import get_cluster
    from concerto_jax.costmodel.model import CostModel, CostOptions
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.simulator import SimOptions, simulate
    from hlo_passes.parser import parse_module

    dev = jax.devices("cpu")[0]
    args = [jax.device_put(a, dev) for a in args]
    compiled = jax.jit(fn).lower(*args).compile()
    small = args[0][..., :1] if args[0].ndim else args[0]
    trivial = jax.jit(lambda x: -x).lower(small).compile()
    module = parse_module(compiled.as_text())
    # Program, its dispatch overhead (a trivial jitted program) and every kernel timed in the same rounds.
    prof = profile_module_on_cpu(module, repeats=repeats, extra={
        "program": lambda: jax.block_until_ready(compiled(*args)),
        "jit_overhead": lambda: jax.block_until_ready(trivial(small))})
    measured = max(prof.extra_us["program"] - prof.extra_us["jit_overhead"], 1e-3)
    cluster = get_cluster("h100_sxm_8")  # placement only; single device programs have no collectives
    spec = cpu_spec or measure_cpu_spec()
    opts = CostOptions(compute=CPU_COMPUTE_OPTIONS, overlap_slowdown=1.0)
    store_model = CostModel(cluster, opts, store=prof.store, gpu=spec)
    analytic_model = CostModel(cluster, opts, gpu=spec)
    sim = SimOptions(overlap_slowdown=1.0, memory=False)
    b1 = build_taskgraph(module, store_model)
    b2 = build_taskgraph(module, analytic_model)
    return ValidationRow(name, measured, simulate(b1.graph, b1.events, sim).step_time_us,
                         simulate(b2.graph, b2.events, sim).step_time_us, prof.measured, len(prof.failed))
