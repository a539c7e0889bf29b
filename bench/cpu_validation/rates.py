"""XLA:CPU kernel classes and their rates, each measured by its own micro-benchmark probe, and the
analytic CPU cost model built from them."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

from bench.cpu_validation.measure import interleaved_best
from concerto_jax.costmodel.compute import ComputeOptions, OpInfo
from concerto_jax.costmodel.profile_store import ProfileStore
from concerto_jax.costmodel.specs import GpuSpec

log = logging.getLogger(__name__)


KERNEL_CLASSES = ("dot_ynn", "dot_plain", "reduce", "transpose", "transpose_far", "stream")
"""Kernel classes of the analytic CPU model (``cpu_kernel_class``), each with its own probed rate.

* ``dot_ynn``: a fusion holding a dot or convolution (XLA:CPU makes these ``__ynn_fusion``
  YNNPACK kernels) -- the rate of a YNNPACK GEMM probe;
* ``dot_plain``: a bare ``dot``/``convolution`` instruction (XLA:CPU left it to its own
  dot emitter: ``IsDotSupportedByYnn`` in XLA's ``ynn_support.cc`` refuses a transposed or
  column-major operand, a vector (m or n = 1) and tiny dots) -- the rate of two plain-dot
  probes, a 512^3 one and one with a 64x64 output (K = 2048), interpolated in log(output elements);
* ``reduce``: a fusion holding a reduce (no dot) -- a row-reduction probe's bytes per second;
* ``transpose``: a fusion holding a transpose that moves the innermost dimension (every read
  strided), with a stride below a 4 KiB page -- a [8192, 128] transpose probe (512 B stride);
* ``transpose_far``: the same with a stride of 4 KiB or more (every read a new page and,
  at power-of-two strides, the same L1 set) -- a [1024, 1024] transpose probe;
* ``stream``: anything else (elementwise loop fusions, copies, slices) -- an axpy probe's
  bytes per second, with the polynomial probe's FLOP rate as the compute roof.

Every class also pays transcendental elements (exp, log, tanh, ...) at the exp probe's cost
per element (the probe's time less the axpy's, per element).
"""

_TRANSCENDENTAL = frozenset({"exponential", "log", "tanh", "logistic", "erf", "power", "sine", "cosine",
                             "exponential-minus-one", "log-plus-one"})


_PAGE_BYTES = 4096


def _perm(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def cpu_kernel_class(op: OpInfo) -> str:
    """The class (``KERNEL_CLASSES``) of one kernel of XLA:CPU's optimized module, from what it contains."""
    if op.opcode in ("dot", "convolution"):
        return "dot_plain"
    body = op.called.get("calls", ()) if op.opcode == "fusion" else ()
    opcodes = {i.opcode for i in body}
    if opcodes & {"dot", "convolution"}:
        return "dot_ynn"
    if "reduce" in opcodes or op.opcode == "reduce":
        return "reduce"
    far = None
    for ins in (body if body else (op,)):
        if ins.opcode == "transpose" and ins.operands and ins.operands[0]:
            perm = _perm(ins.attrs.get("dimensions"))
            if perm and perm[-1] != len(perm) - 1:
                arr = ins.operands[0][0]
                stride = math.prod(arr.dims[perm[-1] + 1:]) * arr.bytes / max(arr.elements, 1)
                far = bool(far) or stride >= _PAGE_BYTES
    if far is not None:
        return "transpose_far" if far else "transpose"
    return "stream"


@dataclasses.dataclass(frozen=True)
class CpuRates:
    """Probed rates of the host CPU, one per kernel class (``KERNEL_CLASSES``).

    Attributes:
      dot_ynn_flops: YNNPACK GEMM rate (FLOP/s).
      dot_plain_flops: XLA:CPU's own dot emitter's rate at 512^3 (FLOP/s).
      dot_plain_small_flops: its rate with a 64x64 output, K = 2048 (FLOP/s).
      stream_bytes: streaming bandwidth (bytes read + written per second).
      reduce_bytes: row-reduction bandwidth (bytes per second).
      transpose_bytes: transpose bandwidth at a 512 B read stride (bytes read + written per second).
      transpose_far_bytes: the same at a 4 KiB read stride.
      vector_flops: elementwise FLOP rate.
      transcendental_s: seconds per transcendental element beyond streaming it.
      overhead_us: per-kernel overhead (configured).
      source: what the probes measured, for reports.
    """

    dot_ynn_flops: float
    dot_plain_flops: float
    stream_bytes: float
    reduce_bytes: float
    transpose_bytes: float
    vector_flops: float
    transcendental_s: float
    dot_plain_small_flops: float = 0.0
    transpose_far_bytes: float = 0.0
    overhead_us: float = 1.0
    source: str = ""



def _transcendental_elements(op: OpInfo) -> float:
    body = op.called.get("calls", ()) if op.opcode == "fusion" else (op,)
    n = 0.0
    for ins in body:
        if ins.opcode in _TRANSCENDENTAL and ins.result:
            n += ins.result[0].elements
        elif ins.opcode == "fusion":
            n += _transcendental_elements(ins)
    return n


_SMALL_OUT, _LARGE_OUT = 64 * 64, 512 * 512  # output elements of the two plain-dot probes


def _plain_dot_rate(op: OpInfo, rates: CpuRates) -> float:
    """Plain-dot rate for ``op``'s output size: log-linear between the two probes, clamped to them."""
    if rates.dot_plain_small_flops <= 0 or not op.result:
        return rates.dot_plain_flops
    out = max(op.result[0].elements, 1)
    x = min(max((math.log(out) - math.log(_SMALL_OUT)) / (math.log(_LARGE_OUT) - math.log(_SMALL_OUT)), 0.0), 1.0)
    return math.exp((1 - x) * math.log(rates.dot_plain_small_flops) + x * math.log(rates.dot_plain_flops))


def cpu_kernel_time_us(op: OpInfo, rates: CpuRates) -> float:
    """Analytic time of one CPU kernel: its class's probed rate against its FLOPs or bytes.

    Dots: the class's GEMM rate against the FLOPs (roof: streaming the bytes). Reductions and
    transposes: their bytes at the class's bandwidth. Others: roofline of bytes at the streaming
    bandwidth and elementwise FLOPs at the vector rate. Every class adds its transcendental
    elements at the exp probe's cost; a while costs its body's kernels per trip.
    """
    from concerto_jax.costmodel.compute import FREE_OPCODES, kernel_count, work_of

    if op.opcode in FREE_OPCODES or kernel_count(op) == 0:
        return 0.0
    if op.opcode == "while":
        trips = kernel_count(op) / max(sum(kernel_count(i) for i in op.called.get("body", ())), 1)
        return trips * sum(cpu_kernel_time_us(i, rates) for i in op.called.get("body", ()))
    work = work_of(op)
    cls = cpu_kernel_class(op)
    mm = sum(f for _, f in work.matmul_flops)
    if cls in ("dot_ynn", "dot_plain"):
        rate = rates.dot_ynn_flops if cls == "dot_ynn" else _plain_dot_rate(op, rates)
        t = max(mm / rate, work.bytes / rates.stream_bytes, work.vector_flops / rates.vector_flops)
    elif cls == "reduce":
        t = max(work.bytes / rates.reduce_bytes, work.vector_flops / rates.vector_flops)
    elif cls in ("transpose", "transpose_far"):
        far = rates.transpose_far_bytes if cls == "transpose_far" and rates.transpose_far_bytes > 0 else 0.0
        t = work.bytes / (far or rates.transpose_bytes)
    else:
        t = max(work.bytes / rates.stream_bytes, work.vector_flops / rates.vector_flops)
    t += _transcendental_elements(op) * rates.transcendental_s
    return 1e6 * t + rates.overhead_us


@dataclasses.dataclass(frozen=True)
class CpuSpecProbes:
    """Microbenchmarks of the host CPU, to be timed with other runners (``spec_from``, ``rates_from``).

    Attributes:
      runners: probe name -> runs it once (``"gemm"``, ``"dot_plain"``, ``"dot_plain_small"``, ``"axpy"``,
        ``"poly"``, ``"exp"``, ``"row_sum"``, ``"transpose"``, ``"transpose_far"``, ``"trivial"``).
      n: GEMM size.
      stream_elements: elements of the streaming, vector, exp, reduction and transpose probes.
    """

    runners: dict
    n: int
    stream_elements: int

    def _times(self, cpu_us: dict[str, float]) -> dict[str, float]:
        overhead = cpu_us["trivial"]
        return {k: max(v - overhead, 1e-3) for k, v in cpu_us.items() if k != "trivial"}

    def spec_from(self, cpu_us: dict[str, float]) -> GpuSpec:
        """The ``GpuSpec`` from the probes' process CPU times (``trivial`` is subtracted from the others)."""
        t = self._times(cpu_us)
        t_mm, t_bw, t_vec = t["gemm"], t["axpy"], t["poly"]
        n, e = self.n, self.stream_elements
        flops = 2.0 * n**3 / (t_mm * 1e-6)
        bw = 2.0 * 4 * e / (t_bw * 1e-6)
        ew = 32.0 * e / (t_vec * 1e-6)
        return GpuSpec(
            name="host CPU (measured)",
            matmul_tflops=(("f32", flops / 1e12), ("bf16", flops / 1e12)),
            vector_tflops=(("f32", ew / 1e12),),
            hbm_bytes_per_s=bw, memory_bytes=0, sm_count=0, nvlink_bytes_per_s=0.0, pcie_bytes_per_s=0.0,
            sources=(f"measured here (process CPU time): {n}^3 f32 matmul {t_mm:.0f} us ({flops / 1e9:.1f} GFLOP/s); "
                     f"{e} f32 axpy {t_bw:.0f} us ({bw / 1e9:.1f} GB/s); 16-term polynomial "
                     f"{t_vec:.0f} us ({ew / 1e9:.1f} GFLOP/s)",),
        )

    def rates_from(self, cpu_us: dict[str, float], overhead_us: float = 1.0) -> CpuRates:
        """Per-class ``CpuRates`` from the probes' process CPU times (``trivial`` subtracted)."""
        t = self._times(cpu_us)
        n, e = self.n, self.stream_elements
        stream = 8.0 * e / (t["axpy"] * 1e-6)
        r = CpuRates(
            dot_ynn_flops=2.0 * n**3 / (t["gemm"] * 1e-6),
            dot_plain_flops=2.0 * n**3 / (t["dot_plain"] * 1e-6),
            stream_bytes=stream,
            reduce_bytes=4.0 * e / (t["row_sum"] * 1e-6),
            transpose_bytes=8.0 * e / (t["transpose"] * 1e-6),
            transpose_far_bytes=8.0 * e / (t["transpose_far"] * 1e-6),
            dot_plain_small_flops=2.0 * 64 * 64 * 2048 / (t["dot_plain_small"] * 1e-6),
            vector_flops=32.0 * e / (t["poly"] * 1e-6),
            transcendental_s=max(t["exp"] - t["axpy"], 0.0) * 1e-6 / e,
            overhead_us=overhead_us,
        )
        src = (f"probed here (process CPU time): YNNPACK {n}^3 GEMM {r.dot_ynn_flops / 1e9:.1f} GFLOP/s; plain dot "
               f"{r.dot_plain_flops / 1e9:.1f} GFLOP/s, 64x64 output {r.dot_plain_small_flops / 1e9:.1f} GFLOP/s; "
               f"axpy {r.stream_bytes / 1e9:.1f} GB/s; row sum {r.reduce_bytes / 1e9:.1f} GB/s; transpose "
               f"{r.transpose_bytes / 1e9:.1f} GB/s (512 B stride), {r.transpose_far_bytes / 1e9:.1f} GB/s (4 KiB); "
               f"polynomial "
               f"{r.vector_flops / 1e9:.1f} GFLOP/s; exp {r.transcendental_s * 1e9:.2f} ns/element")
        return dataclasses.replace(r, source=src)


def cpu_spec_probes(n: int = 512, stream_elements: int = 1 << 20) -> CpuSpecProbes:
    """The probes of ``measure_cpu_spec`` and of the per-class rates (``CpuSpecProbes.rates_from``).

    f32 GEMM (``x @ y``: a YNNPACK fusion), plain dot (``x.T @ y``: XLA:CPU's own dot
    emitter) at 512^3 and with a 64x64 output (K = 2048), streaming axpy, 16-term polynomial
    (32 FLOPs per element), elementwise exp, row sum, a [8192, 128] transpose (512 B read
    stride) and a [1024, 1024] one (4 KiB), and a trivial program. The sizes are those of the validation
    programs' kernels: an ``n``-cubed GEMM, and ``stream_elements`` f32 (4 MiB by default),
    which stay in the caches as these programs' activations do (a 16 MiB stream measured DRAM
    bandwidth instead, ~3x lower here). None of them is one of the validated programs' kernels.
    """
    import jax
    import jax.numpy as jnp

    dev = jax.devices("cpu")[0]
    small = jax.device_put(jnp.ones((1,), jnp.float32), dev)
    trivial = jax.jit(lambda x: -x)
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    mm = jax.jit(lambda x, y: x @ y)
    mm_t = jax.jit(lambda x, y: x.T @ y)
    v = jax.device_put(jnp.full((stream_elements,), 0.5, jnp.float32), dev)
    side = int(round(stream_elements ** 0.5))
    sq = jax.device_put(jnp.full((side, stream_elements // side), 0.5, jnp.float32), dev)
    axpy = jax.jit(lambda x: x * 1.5 + 1.0)
    exp = jax.jit(jnp.exp)
    row_sum = jax.jit(lambda x: jnp.sum(x, axis=1))
    transpose = jax.jit(lambda x: x.T * 1.5)
    tall = jax.device_put(jnp.full((stream_elements // 128, 128), 0.5, jnp.float32), dev)
    skinny = jax.device_put(jnp.ones((2048, 64), jnp.float32), dev)

    def poly(x):
        y = x
        for k in range(16):
            y = y * x + 0.1 * k
        return y

    vec = jax.jit(poly)
    return CpuSpecProbes({"trivial": lambda: trivial(small).block_until_ready(),
                          "gemm": lambda: mm(a, a).block_until_ready(),
                          "dot_plain": lambda: mm_t(a, a).block_until_ready(),
                          "axpy": lambda: axpy(v).block_until_ready(),
                          "poly": lambda: vec(v).block_until_ready(),
                          "exp": lambda: exp(v).block_until_ready(),
                          "row_sum": lambda: row_sum(sq).block_until_ready(),
                          "transpose": lambda: transpose(tall).block_until_ready(),
                          "transpose_far": lambda: transpose(sq).block_until_ready(),
                          "dot_plain_small": lambda: mm_t(skinny, skinny).block_until_ready()}, n, stream_elements)


def cpu_kernel_model(cluster, options, rates: CpuRates, store: ProfileStore | None = None):
    """A ``CostModel`` whose compute times are ``cpu_kernel_time_us`` with ``rates`` (a store still comes first)."""
    from concerto_jax.costmodel.model import CostModel

    class _CpuKernelModel(CostModel):
        def modelled_compute_us(self, op: OpInfo) -> float:
            return cpu_kernel_time_us(op, rates)

    return _CpuKernelModel(cluster, options, store=store)


def rates_from_spec(spec: GpuSpec, overhead_us: float = 1.0) -> CpuRates:
    """``CpuRates`` giving every class the one GEMM rate and one bandwidth of ``spec`` (no exp cost)."""
    bw = spec.hbm_bytes_per_s
    mm = spec.matmul_flops_per_s("f32")
    return CpuRates(mm, mm, bw, bw, bw, spec.vector_flops_per_s("f32"), 0.0, overhead_us=overhead_us,
                    source=spec.name)


def measure_cpu_rates(n: int = 512, stream_elements: int = 1 << 20, repeats: int = 10) -> CpuRates:
    """Per-class ``CpuRates`` of the host CPU from its probes (process CPU time, medians, warm)."""
    probes = cpu_spec_probes(n, stream_elements)
    best = interleaved_best(probes.runners, repeats, warm=True)
    rates = probes.rates_from({k: b.cpu_us for k, b in best.items()})
    log.info("host CPU: %s", rates.source)
    return rates


def measure_cpu_spec(n: int = 512, stream_elements: int = 1 << 20, repeats: int = 10) -> GpuSpec:
    """A ``GpuSpec`` for the host CPU from microbenchmarks: f32 GEMM rate, streaming bandwidth, vector rate.

    Each probe (``cpu_spec_probes``) is a jitted program timed in process CPU time
    (median of ``repeats``, warm, less a trivial jitted program's), like the programs
    it is used to predict; on a shared machine a wall-time probe measured half the
    GEMM rate under load. ``validate_program`` times the probes in the same rounds
    as the program instead: the cache-resident streaming probe moved between 20 and
    63 GB/s from one run to the next with the neighbours' load.

    Args:
      n: GEMM size.
      stream_elements: elements of the streaming and vector probes.
      repeats: timed runs per probe.
    """
    probes = cpu_spec_probes(n, stream_elements)
    best = interleaved_best(probes.runners, repeats, warm=True)
    spec = probes.spec_from({k: b.cpu_us for k, b in best.items()})
    log.info("host CPU: %s", spec.sources[0])
    return spec


CPU_COMPUTE_OPTIONS = ComputeOptions(matmul_efficiency=1.0, memory_efficiency=1.0, launch_overhead_us=1.0)
"""Analytical CPU variant: the measured rates already are achieved rates; ~1 us per thunk (configured)."""
