"""XLA:CPU kernels measured one by one and in their program: compile, run, time (process CPU
time, medians of interleaved rounds), profile a module kernel by kernel into a ``ProfileStore``."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable

import numpy as np

from concerto_jax.costmodel.compute import OpInfo
from concerto_jax.costmodel.profile_store import ProfileStore, signature
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
    from concerto_jax.costmodel import op_info
    from concerto_jax.costmodel.compute import FREE_OPCODES
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
