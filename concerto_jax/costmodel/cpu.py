"""CPU validation of the method: measure kernels one by one, fill a ``ProfileStore``, compare with whole programs.

No GPU here, so the *method* is validated on the host CPU: for a single-device
jitted program, every kernel of XLA:CPU's optimized module is compiled as its
own module (a fusion's fused computation becomes the entry; any other
instruction gets parameters for its operands) and timed; the per-kernel times
go into a ``ProfileStore`` keyed by signature. Simulating the program's task
graph with those times (``CostModel(store=...)``) should then predict the
whole-program time, and so should the analytic model: every kernel classified by
what XLA:CPU runs it as (``cpu_kernel_class``: YNNPACK dot fusion, plain dot,
reduction, transpose, stream) and costed at its class's rate, each rate measured by
its own micro-benchmark probe (``cpu_spec_probes``, ``measure_cpu_rates``,
``cpu_kernel_time_us``). Dispatch
overhead (measured on a trivial program, per path) is subtracted from every
timing. XLA:CPU runs on one pinned core (``pin_to_one_cpu``); times are medians of
process CPU time over interleaved rounds (time spent waiting for a neighbour on the
shared machine does not count; medians of kernels add up to the median of a program,
minima do not), wall-time minima are kept for reference. ``in_program_kernel_us``
reads every kernel's time inside the program from XLA:CPU's profiler, to find where a
prediction is off.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from concerto_jax.costmodel.compute import ComputeOptions, OpInfo
from concerto_jax.costmodel.profile_store import ProfileStore, signature
from concerto_jax.costmodel.specs import GpuSpec
from hlo_passes.ir import ALIAS_OPCODES

log = logging.getLogger(__name__)

_NP_DTYPES = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s32": np.int32, "s64": np.int64,
              "u32": np.uint32, "u8": np.uint8, "s8": np.int8, "pred": np.bool_}


def compile_hlo_cpu(text: str):
    """Compile HLO text for CPU device 0 through XLA's parser and StableHLO (a loaded executable)."""
    import jax

    from concerto_jax import jax_compat

    mlir = jax_compat.hlo_to_stablehlo(jax_compat.hlo_module_from_text(text))
    dev = jax.devices("cpu")[0]
    return dev.client.compile_and_load(mlir, jax_compat.device_list((dev,)),
                                       jax_compat.xla_client().CompileOptions())


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

    run.kernel_names = _kernel_names(exe)  # the thunks XLA:CPU runs for it (profiler event names)
    return run


def _kernel_names(exe) -> frozenset[str]:
    """Names of the kernels (entry instructions that launch one) of a compiled CPU executable."""
    from concerto_jax.costmodel.compute import FREE_OPCODES
    from hlo_passes.ir.parser import parse_module

    try:
        module = parse_module(exe.hlo_modules()[0].to_string())
    except Exception as e:  # names are only needed for the profiler's view; the timing works without
        log.debug("could not parse a compiled standalone module: %s", e)
        return frozenset()
    return frozenset(i.name for i in module.entry.instructions
                     if i.opcode not in FREE_OPCODES and i.opcode not in ("bitcast", "tuple", "get-tuple-element"))


def _trace_events(run_traced: Callable[[], None]) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every host event recorded by ``jax.profiler`` during ``run_traced()``."""
    import glob
    import os
    import tempfile

    import jax.profiler

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            run_traced()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            log.warning("profiler wrote no trace")
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
        return sorted((int(ev.start_ns), int(ev.duration_ns), ev.name)
                      for plane in data.planes for line in plane.lines for ev in line.events)


def standalone_kernel_us(runners: dict[str, Callable[[], object]], repeats: int = 10,
                         warm: bool = False) -> dict[str, float]:
    """Median in-executable duration of each standalone kernel, from XLA:CPU's profiler (no dispatch in it).

    Each runner (from ``hlo_cpu_runner``) runs ``repeats`` times in interleaved
    rounds under the profiler, each run inside a named annotation; a run's time is
    the sum of the durations of its executable's kernel events (``run.kernel_names``)
    inside that annotation. This is the instrument of ``in_program_kernel_us``, for
    kernels too short to be timed as a whole call less a dispatch overhead.

    Returns:
      runner name -> median duration in microseconds (runners with no kernel event are left out).
    """
    import bisect

    import jax.profiler

    def traced():
        for _ in range(repeats):
            for key, run in runners.items():
                if warm:
                    run()
                with jax.profiler.TraceAnnotation("concerto_kernel:" + key):
                    run()

    events = _trace_events(traced)
    starts = [e[0] for e in events]
    best: dict[str, float] = {}
    for start, dur, name in events:
        if not name.startswith("concerto_kernel:"):
            continue
        key = name[len("concerto_kernel:"):]
        names = getattr(runners.get(key), "kernel_names", frozenset())
        total, found = 0, False
        i = bisect.bisect_right(starts, start)
        while i < len(events) and events[i][0] < start + dur:
            if events[i][2] in names:
                total += events[i][1]
                found = True
            i += 1
        if found:
            best.setdefault(key, []).append(total * 1e-3)
    return {k: _median(v) for k, v in best.items()}


def _median(values) -> float:
    return float(np.median(values))


@dataclasses.dataclass(frozen=True)
class Best:
    """Times of one runner over interleaved rounds.

    The CPU figure is a median, not a minimum: a program's time is the sum of its
    kernels', and the sum of per-kernel minima is not the minimum of the sum (each
    kernel's jitter does not vanish in the same run). Medians add up; with 797
    kernels (Evoformer block) the sum of minima was 14 % below the program's
    minimum, the sum of medians 3 % above its median.

    Attributes:
      wall_us: least wall time of one run.
      cpu_us: median CPU time of the whole process (all its threads) during one run;
        time the process was descheduled for a neighbour does not count.
    """

    wall_us: float
    cpu_us: float


def interleaved_best(runners: dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
                     warm: bool = False) -> dict[str, Best]:
    """Least wall time and median process-CPU time of each runner, timed in interleaved rounds.

    Interleaved: load drift hits all runners alike.

    Args:
      runners: name -> callable running once.
      repeats: rounds.
      warmup: untimed runs of each runner first.
      warm: run each runner once untimed right before each timed run (warm caches).
    """
    for run in runners.values():
        for _ in range(warmup):
            run()
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for key, run in runners.items():
            if warm:
                run()  # its inputs and code in the caches, as a kernel finds what its producer just wrote
            c = time.process_time_ns()
            t = time.perf_counter_ns()
            run()
            t = time.perf_counter_ns() - t
            c = time.process_time_ns() - c
            wall[key].append(1e-3 * t)
            cpu[key].append(1e-3 * c)
    return {k: Best(min(wall[k]), _median(cpu[k])) for k in runners}


_TRIVIAL = """HloModule trivial
ENTRY %main (p: f32[1]) -> f32[1] {
  %p = f32[1]{0} parameter(0)
  ROOT %n = f32[1]{0} negate(%p)
}"""


_METADATA = re.compile(r", metadata=\{[^{}]*\}")


def _callees(comp, seen: dict) -> None:
    for inst in comp.instructions:
        for c in inst.called_computations:
            if c.name not in seen:
                _callees(c, seen)
                seen[c.name] = c


def standalone_module(inst) -> tuple[str, list]:
    """(HLO text, parameter shapes) of a module running just ``inst`` (fusions: their fused computation)."""
    from hlo_passes.ir.printer import computation_to_text, instruction_to_text

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
    """Per-kernel CPU timings of one module: the stores and what could not be measured.

    Attributes:
      store: least wall time of each kernel alone, less the standalone dispatch overhead.
      measured: kernels timed.
      failed: names of kernels that XLA would not compile alone.
      overhead_us: least wall time of a trivial module on the standalone path.
      extra_us: least wall times of the extra runners.
      cpu_store: like ``store`` with process CPU time instead of wall time.
      extra_cpu_us: median process CPU times of the extra runners.
      overhead_cpu_us: median process CPU time of the trivial module.
      timed: kernel name -> its ``OpInfo`` (the signature under which it was recorded).
      from_profiler: kernels shorter than the dispatch overhead, whose time is the
        profiler's kernel event (``standalone_kernel_us``).
    """

    store: ProfileStore
    measured: int
    failed: tuple[str, ...]
    overhead_us: float
    extra_us: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_store: ProfileStore | None = None
    extra_cpu_us: dict[str, float] = dataclasses.field(default_factory=dict)
    overhead_cpu_us: float = 0.0
    timed: dict = dataclasses.field(default_factory=dict)
    from_profiler: int = 0


def profile_module_on_cpu(module, *, repeats: int = 15, store: ProfileStore | None = None,
                          extra: dict[str, Callable[[], object]] | None = None,
                          profile_repeats: int = 10, warm: bool = True) -> KernelProfile:
    """Measure every kernel of ``module``'s entry (an ``hlo_passes`` module of XLA:CPU) into a store.

    Args:
      module: XLA:CPU's optimized module, parsed.
      repeats: interleaved timing rounds.
      store: store to add to (a new ``ProfileStore("cpu")`` by default).
      extra: more runners timed in the same rounds (e.g. the whole program and
        its dispatch overhead); their times are ``KernelProfile.extra_us`` / ``extra_cpu_us``.
      profile_repeats: profiled rounds (``standalone_kernel_us``) for kernels shorter
        than the dispatch overhead (0: none; such kernels then keep the difference).
      warm: time every runner right after an untimed run of itself (warm caches: a
        kernel in a program mostly reads what its producer just wrote, and a train
        step follows the previous step); False times them cold, in rotation.

    Returns:
      The stores (wall and process CPU time), counts, the standalone-path dispatch
      overhead and the extra timings.
    """
    from concerto_jax.costmodel.compute import FREE_OPCODES
    from concerto_jax.hlo_taskgraph import op_info
    from hlo_passes.ir.shapes import Shape

    store = store if store is not None else ProfileStore("cpu")
    cpu_store = ProfileStore("cpu-process-time")
    failed: list[str] = []
    runners: dict[str, Callable[[], object]] = {"<overhead>": hlo_cpu_runner(_TRIVIAL, [Shape.array("f32", (1,))])}
    infos = {}
    same: dict[str, OpInfo] = {}  # kernels whose signature another kernel of the module already has
    queued: set[str] = set()
    cache: dict = {}
    for inst in module.entry.instructions:
        if inst.opcode in FREE_OPCODES or inst.opcode in ALIAS_OPCODES:
            continue
        info = op_info(inst, cache)
        if store.lookup(info) is not None:
            continue
        if signature(info) in queued:  # same kernel: time it once
            same[inst.name] = info
            continue
        queued.add(signature(info))
        try:
            runners[inst.name] = hlo_cpu_runner(*standalone_module(inst))
        except Exception as e:  # XLA rejects some standalone forms; report them
            log.warning("could not compile %s (%s) alone: %s", inst.name, inst.opcode, str(e).splitlines()[0][:160])
            failed.append(inst.name)
            continue
        infos[inst.name] = info
    extra = extra or {}
    runners.update({f"<extra>{k}": v for k, v in extra.items()})
    best = interleaved_best(runners, repeats, warm=warm)
    overhead = best.pop("<overhead>")
    extra_best = {k: best.pop(f"<extra>{k}") for k in extra}
    thunk = standalone_kernel_us({k: runners[k] for k in best}, profile_repeats, warm) if profile_repeats > 0 else {}
    from_profiler = 0
    for name, b in best.items():
        # A call timed whole, less the dispatch of a trivial module, is a difference of two noisy
        # minima: for a kernel shorter than the dispatch it came out 0 for 618 of the Evoformer
        # block's 797 kernels (4.6 ms in the program). Those take the profiler's kernel event.
        short = name in thunk and b.cpu_us - overhead.cpu_us < overhead.cpu_us
        from_profiler += short
        store.record(infos[name], thunk[name] if short else max(b.wall_us - overhead.wall_us, 0.0))
        cpu_store.record(infos[name], thunk[name] if short else max(b.cpu_us - overhead.cpu_us, 0.0))
    timed = dict(infos)
    timed.update({k: v for k, v in same.items() if store.lookup(v) is not None})
    return KernelProfile(store, len(best), tuple(failed), overhead.wall_us,
                         {k: b.wall_us for k, b in extra_best.items()}, cpu_store,
                         {k: b.cpu_us for k, b in extra_best.items()}, overhead.cpu_us, timed, from_profiler)


def in_program_kernel_us(run: Callable[[], object], names, repeats: int = 10) -> dict[str, float]:
    """Median duration of each named kernel (thunk) *inside* a program, from XLA:CPU's profiler.

    XLA:CPU's thunk executor records one trace event per executed thunk, named
    after the instruction (``jax.profiler``); this is the time the kernel took in
    the program as compiled and run, to compare kernel by kernel with the store.

    Args:
      run: runs the program once (result awaited).
      names: the kernels (entry instruction names) to report.
      repeats: profiled runs.

    Returns:
      name -> median duration in microseconds, for the names that appeared in the trace.
    """
    wanted = set(names)

    def traced():
        for _ in range(repeats):
            run()

    samples: dict[str, list[float]] = {}
    for _, dur, name in _trace_events(traced):
        if name in wanted:
            samples.setdefault(name, []).append(dur * 1e-3)
    return {k: _median(v) for k, v in samples.items()}


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory mapped (``mallopt``), as a caching device allocator does.

    XLA:CPU allocates a program's temporary buffer per execution. glibc serves an
    allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
    unmaps it on free, so every execution first-touches every page again: the
    Evoformer block train step (32.9 MiB of temporaries) took 8,414 minor page faults
    per run (its whole buffer) and ~36 % longer than with this setting, time that no
    kernel measured alone contains. With ``M_MMAP_MAX=0`` and a 1 GiB trim threshold
    freed blocks stay in the heap and are reused, which is what the GPU runtime's BFC
    allocator does.

    Returns:
      True if both settings were accepted (False off glibc, with a warning).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 1 << 30))  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.warning("mallopt not available: large temporaries are mapped and faulted in per execution")
    return ok


def page_faults_per_run(run: Callable[[], object], repeats: int = 3) -> int:
    """Fewest minor page faults of the process during one call of ``run``."""
    import resource

    best = None
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run()
        n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        best = n if best is None else min(best, n)
    return int(best or 0)


def pin_to_one_cpu(cpu: int | None = None) -> int:
    """Restrict this process to one CPU core, so that XLA:CPU runs every kernel on one thread.

    ``--xla_cpu_multi_thread_eigen=false`` only affects Eigen: XLA:CPU still sizes its
    intra-op pool from the process's CPU affinity, splits loop fusions across it
    (``outer_dimension_partitions``), runs YNNPACK fusions (dots, reductions) on it and
    runs independent thunks concurrently. With one core in the affinity mask the pool has
    one thread and the compiler partitions nothing. Call before JAX creates its CPU client
    (threads made earlier keep their affinity).

    Args:
      cpu: the core; default the first one of the current affinity mask.

    Returns:
      The core the process is now restricted to.
    """
    import os
    import sys

    if cpu is None:
        cpu = min(os.sched_getaffinity(0))
    if "jax" in sys.modules:
        try:
            from concerto_jax import jax_compat

            if jax_compat.backends_initialized():
                log.warning("pin_to_one_cpu after JAX started: its thread pools keep their size")
        except (ImportError, AttributeError):
            pass
    os.sched_setaffinity(0, {cpu})
    return cpu


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
      measured_us: median process CPU time of the jitted program less its dispatch (``_dispatch_twin``).
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


def _dispatch_twin(fn: Callable, args: Sequence):
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
    twin = _dispatch_twin(fn, args)
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
