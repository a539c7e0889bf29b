"""The GPU route's stages (the package docstring, ``concerto_jax.gpu_route``, describes them):
the stock compile, the plan, the target config, the backend-only compile, the checked load and
the swap into JAX's executable; ``CpuRehearsal`` runs them on CPU devices."""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from concerto_jax import executor, jax_compat, multiprocess, pipeline, plan_cache
from concerto_jax.capture import Capture
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.deviceless import pjrt_c, reschedule
from concerto_jax.deviceless.compile import (
    CompileOptions,
    compile_lowered,
    compile_replicated_for_target,
    devices_of,
    lower_for_target,
)
from concerto_jax.deviceless.pjrt_c import RIEGELI_SIGNATURE
from concerto_jax.deviceless.planning import pass_inputs, rewriting_options
from concerto_jax.first_step_policy import StepEntry
from concerto_jax.jax_compat import payload_device_count
from concerto_jax.judge import judge_module
from concerto_jax.report import PassRecord, Report, count_collectives
from hlo_passes.ir import parse_module

log = logging.getLogger(__name__)

GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
STAGES = ("stock_compile", "plan", "target_config", "backend_compile", "checksum", "load",
          "layout_check", "swap")
"""The route's stages, in order (``GpuRouteError.stage``)."""
PLAN_PASSES = frozenset({"schedule", "pin"})
"""Passes that order the program: "schedule" runs on XLA's scheduled module, "pin" is not
needed on this route (XLA's backend keeps the order) and is skipped."""


class GpuRouteError(RuntimeError):
    """A stage of the GPU route failed (the step falls back to the original)."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"the GPU route failed at stage {stage!r}: {message}")
        self.stage = stage


class LoadRefused(ValueError):
    """A payload that must not reach the runtime (no header, another device count, another
    compute capability): the runtime would misread it or abort the process."""


# -- the real devices' target config -------------------------------------------------------------

# device kind (as JAX's GPU device reports it) -> shipped GpuTargetConfigProto; first match wins
_KIND_TO_CONFIG: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"H100.*PCIe", re.I), "h100_pcie.txtpb"),
    (re.compile(r"H100", re.I), "h100_sxm.txtpb"),
    (re.compile(r"H200|GH200", re.I), "h200.txtpb"),
    (re.compile(r"A100", re.I), "a100_sxm_80.txtpb"),
    (re.compile(r"B200", re.I), "b200.txtpb"),
)


# device kind -> the one-host cluster of that GPU (``costmodel.CLUSTERS``); first match wins
_KIND_TO_CLUSTER: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"H100.*PCIe", re.I), "h100_pcie_8"),
    (re.compile(r"H100", re.I), "h100_sxm_8"),
    (re.compile(r"H200|GH200", re.I), "h200_sxm_8"),
    (re.compile(r"A100", re.I), "a100_80_8"),
)


def cost_target_for(devices: Sequence, target: str) -> str:
    """The cluster whose cost model plans a step on ``devices``: ``target`` where its GPU is
    theirs; else, for one process of one GPU kind the one-host cluster has room for, that
    cluster (an H200's measured kernel rates, ``costmodel.calibration``, in place of the
    datasheet figures of ``Options.target``'s default H100); else ``target`` (several hosts:
    its topology stands)."""
    facts = [jax_compat.gpu_device_facts(d) for d in devices]
    kinds = {f["device_kind"] for f in facts}
    if len(kinds) != 1 or len({f["process_index"] for f in facts}) != 1:
        return target
    kind = kinds.pop()
    name = next((c for pattern, c in _KIND_TO_CLUSTER if pattern.search(kind or "")), None)
    if name is None or get_cluster(name).gpu.name == get_cluster(target).gpu.name:
        return target
    return name if len(devices) <= get_cluster(name).num_devices else target


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
    """The deviceless topology that stands for the step's real devices (what ``pjrt_c.Topology``
    takes: ``topology_name``, ``topology``, ``target_config_text()``)."""

    config_file: str
    device_kind: str
    compute_capability: str
    core_count: int | None
    num_devices: int
    topology: str
    config_text: str
    topology_name: str = "concerto_real_devices"

    def target_config_text(self) -> str:
        return self.config_text


def config_compute_capability(text: str) -> str:
    """``"major.minor"`` of a GpuTargetConfigProto's ``cuda_compute_capability`` ('' if absent)."""
    m = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    if not m:
        return ""
    major = re.search(r"\bmajor:\s*(\d+)", m.group(1))
    minor = re.search(r"\bminor:\s*(\d+)", m.group(1))
    return f"{int(major.group(1)) if major else 0}.{int(minor.group(1)) if minor else 0}"


def _normal_cc(cc: str) -> str:
    parts = (str(cc).split(".") + ["0"])[:2]
    try:
        return f"{int(parts[0])}.{int(parts[1])}"
    except ValueError:
        return str(cc)


def config_for_kind(device_kind: str) -> str | None:
    """The shipped target config file for a device kind (None: no config for it)."""
    for pattern, name in _KIND_TO_CONFIG:
        if pattern.search(device_kind or ""):
            return name
    return None


def device_target(devices: Sequence) -> DeviceTarget:
    """The deviceless topology of the step's real GPU devices.

    The shipped config of their device kind, refused unless its compute capability is the
    devices' (the GPU client refuses to load an executable built for another one); the SM
    count is set to the devices' where they report it. Topology ``1 x processes x devices per
    process``, devices numbered 0..n-1 (the load puts the step's own device ids back).

    Raises:
      GpuRouteError("target_config", ...): mixed devices, an unknown kind, another compute
        capability; says what was expected.
    """
    facts = [jax_compat.gpu_device_facts(d) for d in devices]
    kinds = sorted({f["device_kind"] for f in facts})
    ccs = sorted({_normal_cc(f["compute_capability"]) for f in facts})
    if len(kinds) != 1 or len(ccs) != 1:
        raise GpuRouteError("target_config", f"the step's devices differ (kinds {kinds}, compute "
                            f"capabilities {ccs}); one kind of GPU per step is supported")
    kind, cc = kinds[0], ccs[0]
    name = config_for_kind(kind)
    if name is None:
        known = ", ".join(f"{p.pattern!r} -> {n}" for p, n in _KIND_TO_CONFIG)
        raise GpuRouteError("target_config", f"no target config for device kind {kind!r} "
                            f"(compute capability {cc}); shipped: {known}. Add its "
                            "GpuTargetConfigProto to concerto_jax/gpu_configs/ and "
                            "gpu_route.route._KIND_TO_CONFIG")
    text = resources.files("concerto_jax").joinpath("gpu_configs", name).read_text()
    want = config_compute_capability(text)
    if want != cc:
        raise GpuRouteError("target_config", f"device kind {kind!r} reports compute capability "
                            f"{cc}, the shipped config {name} is for {want}: an executable built "
                            "for it would not load; add a config for this GPU")
    cores = {f["core_count"] for f in facts}
    core_count = cores.pop() if len(cores) == 1 else None
    if isinstance(core_count, int) and core_count > 0:
        text = re.sub(r"\bcore_count:\s*\d+", f"core_count: {core_count}", text, count=1)
    hosts = sorted({f["process_index"] for f in facts})
    per_host = len(devices) // len(hosts)
    if per_host * len(hosts) != len(devices):
        raise GpuRouteError("target_config", f"{len(devices)} devices over {len(hosts)} processes "
                            "are not the same number per process")
    return DeviceTarget(name, kind, cc, core_count, len(devices), f"1x{len(hosts)}x{per_host}", text)


# -- the payload and its load -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Payload:
    """PJRT executable bytes and what they were compiled for.

    Attributes:
      data: the bytes (``PJRT_Executable_Serialize``; no IFRT header).
      num_devices: replicas x partitions of its compile.
      replicated: compiled as ``num_devices`` replicas (a rewritten per-device module), else as
        ``num_devices`` SPMD partitions (XLA's own module of the step).
      compute_capability: the target's (``"9.0"``), None for a CPU executable.
      final_text: XLA's final module of it.
      compile_options: the compile's options (``CompileOptions`` proto bytes, without
        ``run_backend_only``), whose device assignment the load replaces.
    """

    data: bytes
    num_devices: int
    replicated: bool
    compute_capability: str | None
    final_text: str
    compile_options: bytes = b""


def check_payload(payload: Payload, devices: Sequence, step_devices: int) -> None:
    """Refuse a payload the runtime must not see, with what was expected.

    Raises:
      LoadRefused: the bytes carry an IFRT header already (not PJRT bytes); they were
        compiled for another device count than the devices (the runtime aborts the process
        on that) or than the step; for another compute capability than the devices'.
    """
    data = payload.data
    if not data:
        raise LoadRefused("the payload is empty; expected PJRT executable bytes")
    try:
        jax_compat.split_ifrt_blob(data)
    except (ValueError, IndexError):
        pass
    else:
        raise LoadRefused("the payload already starts with an IFRT header (a whole "
                          "serialize_executable blob); expected the PJRT executable's bytes alone")
    if payload.compute_capability is not None and not data.startswith(RIEGELI_SIGNATURE):
        raise LoadRefused(f"the payload does not start with the Riegeli signature "
                          f"{RIEGELI_SIGNATURE.hex()} of PJRT_Executable_Serialize; expected the "
                          "CUDA plugin's serialized executable")
    stored = payload_device_count(data) if payload.compute_capability is None else None
    counts = {"payload": payload.num_devices, "devices": len(devices), "step": step_devices}
    if stored is not None:
        counts["stored in the payload"] = stored
    if len(set(counts.values())) != 1:
        raise LoadRefused("device counts differ (" + ", ".join(f"{k} {v}" for k, v in counts.items())
                          + "); the executable must be compiled for the step's devices")
    if payload.compute_capability is not None:
        have = sorted({_normal_cc(jax_compat.gpu_device_facts(d)["compute_capability"]) for d in devices})
        if have != [_normal_cc(payload.compute_capability)]:
            raise LoadRefused(f"the payload was compiled for compute capability "
                              f"{payload.compute_capability}, the devices have {have}; compile it "
                              "for these devices (device_target)")


def load_options(payload: Payload, devices: Sequence, env: Mapping[str, Any] | None = None):
    """Compile options for the load: the payload's shape (replicas or partitions) with the step's
    device assignment (``devices[i]`` runs replica / partition ``i``)."""
    n = len(devices)
    ids = [d.id for d in devices]
    if payload.replicated:
        return jax_compat.compile_options(ids, num_replicas=n, num_partitions=1, spmd=False, env=dict(env or {}))
    return jax_compat.compile_options(ids, num_replicas=1, num_partitions=n, spmd=n > 1, env=dict(env or {}))


def load_payload(original, payload: Payload, *, override_options: bool = True,
                 env: Mapping[str, Any] | None = None):
    """Load ``payload`` on JAX's client behind ``original``'s header, on its devices.

    Args:
      original: the step's ``jax.stages.Compiled`` (header, devices, host callbacks).
      payload: what to load (``check_payload`` runs first).
      override_options: pass ``load_options`` (the step's device assignment) to the load; the
        payload's own assignment is 0..n-1.
      env: XLA options recorded in the load's compile options.

    Returns:
      The loaded jaxlib executable (outputs described by the step's header).

    Raises:
      LoadRefused: see ``check_payload``.
      Exception: what the runtime raises for bytes it cannot load.
    """
    unloaded = jax_compat.unloaded_executable(original)
    devices = tuple(unloaded.device_list)
    check_payload(payload, devices, len(devices))
    header = jax_compat.step_header(jax_compat.xla_executable(original))
    opts = load_options(payload, devices, env) if override_options else None
    return jax_compat.deserialize(header + payload.data, devices, compile_options=opts,
                                  host_callbacks=tuple(unloaded.host_callbacks))


def check_layouts(original, loaded) -> None:
    """Raise ``GpuRouteError("layout_check")`` unless ``loaded``'s entry parameters and results
    (per-device shapes and layouts) are the step's."""
    want = jax_compat.entry_layout(jax_compat.xla_executable(original))
    got = jax_compat.entry_layout(loaded)
    if want != got:
        raise GpuRouteError("layout_check", f"the loaded executable's entry layout differs from the "
                            f"step's (expected {want[:300]}, found {got[:300]})")


# -- order kept ---------------------------------------------------------------------------------

_INST = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def entry_order(text: str) -> list[str]:
    """Instruction names of a module text's ENTRY computation, in order."""
    out, inside = [], False
    for line in text.split("\n"):
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.strip() == "}":
                break
            m = _INST.match(line)
            if m:
                out.append(m.group(1))
    return out


def order_kept(handed: str, final: str) -> dict:
    """How much of the handed entry order XLA's final module keeps: instructions present in both,
    and the length of the longest run of them in the same relative order (``kept`` is True when
    that is all of them)."""
    a, b = entry_order(handed), entry_order(final)
    common = set(a) & set(b)
    pos = {n: k for k, n in enumerate(b)}
    seq = [pos[n] for n in a if n in common]
    # longest increasing subsequence: the instructions XLA left in our relative order
    tails: list[int] = []
    for x in seq:
        k = bisect.bisect_left(tails, x)
        tails[k:k + 1] = [x]
    return {"common": len(seq), "in_our_order": len(tails), "kept": len(tails) == len(seq),
            "handed": len(a), "final": len(b)}


# -- backends -----------------------------------------------------------------------------------

@dataclasses.dataclass
class StockCompile:
    """The stock compile of the step: JAX's Compiled, the post-SPMD module, XLA's scheduled one."""

    compiled: Any
    post_spmd: str
    scheduled: str | None
    device_list: tuple
    seconds: float

    def as_capture(self):
        return Capture(hlo_text=self.post_spmd, compiled=self.compiled, device_list=self.device_list,
                       num_partitions=len(self.device_list), seconds=self.seconds)


@dataclasses.dataclass
class Plan:
    """What process 0 decided: the text for the backend and its account."""

    handed: str
    replicated: bool
    passes: tuple
    sha256: str
    rewritten: str | None = None  # the rewriting passes' module (before XLA's pipeline) when kept

    def to_json(self) -> dict:
        return {"handed": self.handed, "replicated": self.replicated, "sha256": self.sha256,
                "passes": [dataclasses.asdict(p) for p in self.passes]}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(data["handed"], bool(data["replicated"]),
                   tuple(PassRecord.from_dict(p) for p in data["passes"]), data["sha256"])


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_module_dump(directory: str, module: str, marker: str) -> str | None:
    """The dump of module ``module`` whose file name contains ``marker`` (XLA may dump other
    modules into the same directory: autotuning candidates)."""
    files = sorted(f for f in glob.glob(os.path.join(directory, "*.txt"))
                   if marker in os.path.basename(f) and f".{module}." in os.path.basename(f))
    if not files:
        return None
    with open(files[-1]) as f:
        return f.read()


def _module_name(compiled) -> str:
    first = compiled.as_text().split("\n", 1)[0]
    m = re.match(r"HloModule\s+([\w.\-]+)", first)
    if not m:
        raise RuntimeError(f"no module name in {first[:80]!r}")
    return m.group(1)


def plan_on_scheduled(post_spmd: str, scheduled: str | None, options,
                      xla_scheduled: Callable[[str], str | None]) -> Plan:
    """The GPU plan: rewriting passes on ``post_spmd`` (decompose costed by XLA's fusion of the
    step: its scheduled module is the fused reference), then ``xla_scheduled(our module)`` gives
    XLA's scheduled module of it; "schedule" on XLA's scheduled module. A rewrite is kept only
    where its plan simulates faster than the plan of the step without it (``final_module_guard``
    in the rewriting passes' records), as ``compile_for_target`` does.

    Raises:
      RuntimeError: no scheduled module, or our order's peak over the memory limit.
    """
    cost_model = CostModel(get_cluster(options.target))
    records: list = []
    rewriting = tuple(p for p in options.passes if p not in PLAN_PASSES)
    _require_scheduled(scheduled)
    src, replicated, rewritten = scheduled, False, None
    if rewriting:
        pre = pipeline.run(post_spmd, rewriting_options(options, rewriting), pass_inputs(scheduled))
        records += pre.passes
        if any(r.changed for r in pre.passes):
            executor.check_signature(post_spmd, pre.text)
            try:
                src = _require_scheduled(xla_scheduled(pre.text))
                replicated, rewritten = True, pre.text
            except Exception as e:  # noqa: BLE001 - the rewrite is dropped, the order still planned
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                log.warning("GPU route: XLA's pipeline on the rewritten module failed (%s); the "
                            "rewrite (%s) is dropped", why, ",".join(rewriting))
                records = [dataclasses.replace(r, changed=False, stats={**r.stats, "dropped": why})
                           for r in records]
    handed, record = _ordered(src, options, cost_model)
    if replicated:
        plain, plain_record = _ordered(scheduled, options, cost_model)
        ours_us, plain_us = judge_module(handed, cost_model).us, judge_module(plain, cost_model).us
        keep = ours_us < plain_us
        guard = {"rewritten_planned_us": round(ours_us, 1), "without_rewrite_planned_us": round(plain_us, 1),
                 "kept": keep}
        records = [dataclasses.replace(r, stats={**r.stats, "final_module_guard": guard},
                                       changed=r.changed and keep) for r in records]
        if not keep:
            log.info("GPU route: the rewrite (%s) plans %.1f us vs %.1f us without it: dropped",
                     ",".join(rewriting), ours_us, plain_us)
            handed, record, replicated, rewritten = plain, plain_record, False, None
    if record is not None:
        records.append(record)
    if "pin" in options.passes:
        records.append(PassRecord("pin", False, 0.0, {"skipped": "not needed: XLA's backend keeps "
                                                                 "the handed order"}))
    return Plan(handed, replicated, tuple(records), _sha(handed), rewritten)


def _require_scheduled(src: str | None) -> str:
    if src is None or "is_scheduled=true" not in src.split("\n", 1)[0]:
        raise RuntimeError("XLA wrote no scheduled module (no dump before its post-scheduling "
                           "pipelines nor after its latency hiding scheduler; is XLA_FLAGS "
                           "overriding --xla_dump_to?)")
    return src


def _ordered(src: str, options, cost_model) -> tuple[str, Any]:
    """``src`` in our order when "schedule" runs (else as is), and the schedule's record."""
    if "schedule" not in options.passes:
        return src, None
    t0 = time.perf_counter()
    r = reschedule.reschedule_text(src, cost_model, options)
    entry = r.computations[-1]
    if (entry.memory_limit_bytes is not None and entry.peak_bytes is not None
            and entry.peak_bytes > entry.memory_limit_bytes):
        raise RuntimeError(f"our order's peak {entry.peak_bytes} B exceeds the memory limit "
                           f"{entry.memory_limit_bytes} B")
    return r.text, PassRecord("schedule", bool(r.changed), time.perf_counter() - t0, {
        "on": "xla_scheduled", "target": options.target, "changed": list(r.changed),
        "program_order_us": round(r.input_us, 1), "scheduled_us": round(r.scheduled_us, 1),
        "input_peak_bytes": entry.input_peak_bytes, "peak_bytes": entry.peak_bytes,
        "memory_limit_bytes": entry.memory_limit_bytes})


class GpuBackend:
    """The GPU-only steps of the route, on JAX's real GPU client."""

    name = "gpu"

    def stock_compile(self, lowered, compiler_options: Mapping[str, Any]) -> StockCompile:
        """JAX's compile of the step at the normal optimisation level, with XLA's dumps."""
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="concerto_gpu_") as d:
            opts = {"xla_dump_to": d, "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True,
                    "xla_dump_hlo_pass_re": "|".join((jax_compat.SPMD_PASS, jax_compat.LHS_PASS,
                                                      jax_compat.SCHEDULED_PASS))}
            opts.update(compiler_options)
            with jax_compat.no_persistent_cache():  # a cache hit would dump nothing
                compiled = lowered.compile(compiler_options=opts)
            module = _module_name(compiled)
            post = (_read_module_dump(d, module, f"after_{jax_compat.SPMD_PASS}")
                    or _read_module_dump(d, module, "before_optimizations"))
            scheduled = (_read_module_dump(d, module, jax_compat.SCHEDULED_MARKER)
                         or _read_module_dump(d, module, f"after_{jax_compat.LHS_PASS}"))
        if post is None:
            raise RuntimeError(f"XLA wrote no post-SPMD module of {module} (XLA_FLAGS overriding "
                               "--xla_dump_to?)")
        devices = tuple(jax_compat.unloaded_executable(compiled).device_list)
        return StockCompile(compiled, post, scheduled, devices, time.perf_counter() - t0)

    def plan(self, stock: StockCompile, options) -> Plan:
        def xla_scheduled(text: str) -> str | None:
            return compile_replicated_for_target(text, stock.device_list,
                                                 dict(options.compiler_options), after_lhs=True)[3]

        target = cost_target_for(stock.device_list, options.target)
        if target != options.target:
            log.info("planning with the cost model of %s (the step's devices are %s; Options.target %s "
                     "is another GPU)", target, stock.device_list[0].device_kind, options.target)
            options = dataclasses.replace(options, target=target)
        return plan_on_scheduled(stock.post_spmd, stock.scheduled, options, xla_scheduled)

    def target(self, devices: Sequence) -> DeviceTarget:
        return device_target(devices)

    def compile(self, plan: Plan, devices: Sequence, target: DeviceTarget,
                env: Mapping[str, Any], host_callbacks: Sequence) -> Payload:
        return compile_payload(plan.handed, target, len(devices), replicated=plan.replicated, env=env)


def compile_payload(handed: str, target, num_devices: int, *, replicated: bool,
                    env: Mapping[str, Any] | None = None, compute_capability: str | None = None) -> Payload:
    """Backend-only compile of ``handed`` for ``target`` (a ``DeviceTarget`` or a ``Cluster``),
    deviceless, devices 0..n-1, and its serialized executable."""
    env = dict(env or {})
    ids = list(range(num_devices))
    if replicated:
        opts = jax_compat.compile_options(ids, num_replicas=num_devices, num_partitions=1, spmd=False, env=env)
    else:
        opts = jax_compat.compile_options(ids, num_replicas=1, num_partitions=num_devices,
                                          spmd=num_devices > 1, env=env)
    raw = opts.SerializeAsString()
    final, data = pjrt_c.compile_and_serialize(handed, target, raw, backend_only=True)
    cc = compute_capability or getattr(target, "compute_capability", None) or \
        config_compute_capability(target.target_config_text())
    return Payload(data, num_devices, replicated, cc, final, raw)


class CpuRehearsal:
    """The route on CPU devices: the CPU path's stock compile (``capture``), plan (the whole
    pipeline on the post-SPMD module) and compile (a replicated program, assigned to devices
    0..n-1 like a deviceless compile: the load's options put the step's own back); every other
    stage as on a GPU. For the tests and ``gpu_check``'s CPU half."""

    name = "cpu-rehearsal"

    def stock_compile(self, lowered, compiler_options: Mapping[str, Any]) -> StockCompile:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="concerto_rehearsal_") as d:
            opts = {"xla_dump_to": d, "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True,
                    "xla_dump_hlo_pass_re": jax_compat.SPMD_PASS}
            opts.update(compiler_options)
            with jax_compat.no_persistent_cache():  # a cache hit would dump nothing
                compiled = lowered.compile(compiler_options=opts)
            module = _module_name(compiled)
            post = (_read_module_dump(d, module, f"after_{jax_compat.SPMD_PASS}")
                    or _read_module_dump(d, module, "before_optimizations"))
        if post is None:
            raise RuntimeError(f"XLA wrote no post-SPMD module of {module}")
        devices = tuple(jax_compat.unloaded_executable(compiled).device_list)
        return StockCompile(compiled, post, None, devices, time.perf_counter() - t0)

    def plan(self, stock: StockCompile, options) -> Plan:
        result = pipeline.run(stock.post_spmd, options)
        return Plan(result.text, True, tuple(result.passes), _sha(result.text))

    def target(self, devices: Sequence) -> None:
        return None

    def compile(self, plan: Plan, devices: Sequence, target, env: Mapping[str, Any],
                host_callbacks: Sequence) -> Payload:
        ordered = sorted(devices, key=lambda d: d.id)
        exe, _ = executor.compile_replicated(plan.handed, ordered, compiler_options=env,
                                             host_callbacks=host_callbacks)
        return Payload(jax_compat.pjrt_payload(exe), len(devices), True, None,
                       jax_compat.executable_text(exe))


_REHEARSE = False
"""Set by tests / gpu_check (``rehearse``): CPU steps take the route with ``CpuRehearsal``."""


def backend_for(platform: str):
    """The route's backend for a platform: ``GpuBackend`` on GPUs, ``CpuRehearsal`` on CPU while
    rehearsing, else None (the CPU path)."""
    if platform in GPU_PLATFORMS:
        return GpuBackend()
    if _REHEARSE and platform == "cpu":
        return CpuRehearsal()
    return None


class rehearse:  # noqa: N801 - a context manager used like a function
    """``with gpu_route.rehearse(): optimize(...)``: CPU steps take the GPU route."""

    def __enter__(self):
        global _REHEARSE
        self._old, _REHEARSE = _REHEARSE, True
        return self

    def __exit__(self, *exc):
        global _REHEARSE
        _REHEARSE = self._old


# -- the route ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Built:
    """A step built by the route."""

    compiled: Any
    stock: StockCompile
    plan: Plan
    payload: Payload
    order: dict
    seconds: dict


def _joint(stage: str, seconds: dict, fn: Callable[[], Any]) -> Any:
    """Run one stage on every process; all succeed, or all raise ``GpuRouteError(stage)``."""
    t0 = time.perf_counter()
    out, error = None, None
    try:
        out = fn()
    except GpuRouteError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - every failure of a stage falls back
        error = e
    ok = multiprocess.all_succeeded(error is None)
    seconds[stage] = time.perf_counter() - t0
    if error is not None:
        if isinstance(error, GpuRouteError):
            raise error
        first = (str(error).splitlines() or [""])[0][:400]
        raise GpuRouteError(stage, f"{type(error).__name__}: {first}") from error
    if not ok:
        raise GpuRouteError(stage, "another process failed at this stage")
    return out


def _same_everywhere(digest: str) -> bool:
    """True on every process iff every process has the same hex ``digest``."""
    if jax.process_count() == 1:
        return True
    mine = np.frombuffer(bytes.fromhex(digest), dtype=np.int32).copy()
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    return bool((every == every[0]).all())


def build(fn, args: tuple, kwargs: dict, options, backend, *, stock: StockCompile | None = None,
          override_options: bool = True) -> Built:
    """Run the route's stages for one signature (``fn`` jitted, ``args``/``kwargs`` as the
    call's). ``stock``: a stock compile of these arguments already made.

    With the plan cache (``Options.cache_dir``; ``plan_cache.open_route``) a build of the same
    step, options, devices and code reads the plan and our executable stored by an earlier one:
    the plan, target config and backend compile stages are skipped (the ``plan_cache`` stage
    instead); the checksum, load, layout check and swap run as always, and an executable they
    refuse rejects the entry and the step is built again. Under ``jax.distributed`` each
    process reads its own entry and the entries are used only where every process has one
    (else all build, the plan the leader's); the checksum stage then also checks that every
    process read the same module.

    Raises:
      GpuRouteError: a stage failed (on every process alike).
      TypeError / ValueError: JAX rejected the arguments (the user's error, from lowering).
    """
    seconds: dict = {}
    env = dict(options.compiler_options)
    cache = None
    if stock is None:
        lowered = fn.lower(*args, **kwargs)  # the user's errors propagate
        stock = _joint("stock_compile", seconds, lambda: backend.stock_compile(lowered, env))
        cache = plan_cache.open_route(lowered, options, backend.name)
    devices = stock.device_list
    t0 = time.perf_counter()
    hit = cache.lookup(stock.post_spmd) if cache is not None else None
    if not multiprocess.all_succeeded(hit is not None):
        hit = None  # some process has no entry: every process builds (the leader plans)
    if hit is not None:  # the plan and our executable of an earlier build (plan_cache: route)
        seconds["plan_cache"] = time.perf_counter() - t0
        plan, payload = Plan.from_json(hit[0]), Payload(**hit[1])
    else:
        def plan_json() -> dict:
            return backend.plan(stock, options).to_json()

        plan = _joint("plan", seconds, lambda: Plan.from_json(
            multiprocess.leader_decides(stock.post_spmd, plan_json)))
        target = _joint("target_config", seconds, lambda: backend.target(devices))
        unloaded = jax_compat.unloaded_executable(stock.compiled)
        payload = _joint("backend_compile", seconds, lambda: backend.compile(
            plan, devices, target, env, tuple(unloaded.host_callbacks)))

    def checksum() -> None:
        mine = _sha(plan.handed)
        if mine != plan.sha256:
            raise RuntimeError(f"the handed module's SHA-256 {mine[:12]} is not the leader's "
                               f"{plan.sha256[:12]}")
        if not _same_everywhere(mine):
            raise RuntimeError("the processes compiled different modules")

    try:
        _joint("checksum", seconds, checksum)
        loaded = _joint("load", seconds, lambda: load_payload(
            stock.compiled, payload, override_options=override_options, env=env))
        _joint("layout_check", seconds, lambda: check_layouts(stock.compiled, loaded))
        compiled = _joint("swap", seconds, lambda: jax_compat.swapped_step(
            stock.compiled, loaded, assemble_outputs=False))
    except GpuRouteError as e:
        if hit is None:
            raise
        cache.reject(f"its executable was refused ({e})")  # built again, as without a cache
        rebuilt = build(fn, args, kwargs, options, backend, stock=stock, override_options=override_options)
        cache.save(stock.post_spmd, rebuilt.plan.to_json(), rebuilt.payload)
        rebuilt.seconds.update({k: v for k, v in seconds.items() if k not in rebuilt.seconds})
        return rebuilt
    if cache is not None and hit is None:
        cache.save(stock.post_spmd, plan.to_json(), payload)
    order = order_kept(plan.handed, payload.final_text) if backend.name == "gpu" else {}
    if order and not order["kept"]:
        log.warning("XLA's backend kept %d of %d entry instructions in our order",
                    order["in_our_order"], order["common"])
    if options.dump_dir:
        _dump(options.dump_dir, getattr(fn, "__name__", "step"), stock, plan, payload)
    return Built(compiled, stock, plan, payload, order, seconds)


def _dump(directory: str, name: str, stock: StockCompile, plan: Plan, payload: Payload) -> None:
    os.makedirs(directory, exist_ok=True)
    stamp = f"{name}.{int(time.time() * 1000)}"
    for suffix, text in (("captured", stock.post_spmd), ("xla_scheduled", stock.scheduled),
                         ("handed", plan.handed), ("final", payload.final_text)):
        if text:
            with open(os.path.join(directory, f"{stamp}.{suffix}.hlo.txt"), "w") as f:
                f.write(text)


def build_entry(step, args: tuple, kwargs: dict, options, note: str, backend):
    """``api.OptimizedStep._build`` for a step the route serves: a ``StepEntry`` running ours
    (first-step check pending as ``Options.optimize.check_first_step`` says), or the original after one
    warning naming the failed stage."""
    name = getattr(step._fn, "__name__", "step")
    try:
        built = build(step._fn, args, kwargs, options, backend)
    except GpuRouteError as e:
        if not step.options.fallback:
            raise
        return step._fallback(str(e), name, len(jax.devices()), "", {})
    cap = built.stock.as_capture()
    tolerance = max((p.tolerance for p in built.plan.passes), default=0.0)
    check, why = _joint_check(step, cap, args, kwargs, tolerance)
    if tolerance > 0 and not check and step.options.optimize.check_first_step is not False:
        # a pass that reassociates sums runs only where the first-step check verifies it
        dropped = sorted({p.name for p in built.plan.passes if p.tolerance > 0})
        reason = (f"the passes {dropped} reassociate sums (declared relative tolerance "
                  f"{tolerance:g}) and the first-step check that verifies it cannot run ({why}); "
                  "they are left out")
        step._warn_once(f"concerto_jax.optimize({name}): {reason}", reason, stacklevel=5)
        options = dataclasses.replace(options, passes=tuple(p for p in options.passes if p not in dropped))
        note += f"; {dropped} left out: they need the check"
        try:
            built = build(step._fn, args, kwargs, options, backend, stock=built.stock)
        except GpuRouteError as e:
            if not step.options.fallback:
                raise
            return step._fallback(str(e), name, len(built.stock.device_list), built.stock.post_spmd, {})
        tolerance = 0.0
        check, why = _joint_check(step, cap, args, kwargs, tolerance)
    if step.options.optimize.first_step_reference == "wider" and tolerance > 0:
        why += "; no wider-precision judge on the GPU route"
    entry = parse_module(built.stock.post_spmd, source="captured").entry
    passes = built.plan.passes
    if built.order:
        passes = passes + (_order_record(built),)
    report = Report(
        function=name, num_devices=len(built.stock.device_list), optimized=True,
        instructions=len(entry.instructions),
        collectives=count_collectives(i.collective_kind for i in entry.instructions
                                      if i.collective_kind is not None and i.async_role != "done"),
        passes=passes, stage_seconds={k: round(v, 3) for k, v in built.seconds.items()},
        executable=f"backend-only ({backend.name}: ours, loaded behind the step's header)",
        first_step_check=why + note)
    log.info("%s", report)
    # the first-step check runs the route's own stock compile of the step (JAX's compile at
    # its defaults plus Options.compiler_options; XLA's dumps change no code): no second compile
    return StepEntry(built.compiled, report, built.stock.post_spmd, built.plan.handed,
                      tolerance=tolerance, check_pending=check, built_with=options, note=note,
                      reference=built.stock.compiled if check else None)


def _joint_check(step, cap, args, kwargs, tolerance: float) -> tuple[bool, str]:
    """``api``'s first-step check decision, the same on every process (the check's comparison
    is a joint decision, so every process must run it or none)."""
    check, why = step._check_decision(cap, args, kwargs, tolerance)
    if check and not multiprocess.all_succeeded(check):
        return False, "skipped: another process cannot run it"
    if not check:
        multiprocess.all_succeeded(check)
    return check, why


def _order_record(built: Built):
    return PassRecord("backend_order", False, 0.0, dict(built.order))


# -- the deviceless half (no GPU needed: tests, gpu_check's CPU half) ----------------------------

@dataclasses.dataclass
class Deviceless:
    """The route's compile half for a deviceless target: stock compile, plan, backend-only
    compile and serialized executable (what a GPU host would load)."""

    stock: Any  # deviceless.compile.TargetCompile
    plan: Plan
    payload: Payload
    seconds: dict


def compile_deviceless(step, abstract_args: Sequence, cluster, options) -> Deviceless:
    """Run the route's compile stages for ``cluster`` without a GPU (``step`` jitted over a
    ``target_mesh`` of it, ``abstract_args`` ShapeDtypeStructs): the same ``plan_on_scheduled``
    and ``compile_payload`` a GPU host runs, on the deviceless stock compile."""
    seconds: dict = {}
    env = dict(options.compiler_options)
    t0 = time.perf_counter()
    lowered = lower_for_target(step.trace(*abstract_args))
    stock = compile_lowered(lowered, cluster, CompileOptions(
        dump_lhs=True, dump_spmd=True, dump_scheduled=True, extra=tuple(env.items())))
    seconds["stock_compile"] = time.perf_counter() - t0
    devices = devices_of(stock.compiled)
    t0 = time.perf_counter()
    plan = plan_on_scheduled(
        stock.post_spmd_text, stock.scheduled_text or stock.after_lhs_text, options,
        lambda text: compile_replicated_for_target(text, devices, env, after_lhs=True)[3])
    seconds["plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    payload = compile_payload(plan.handed, cluster, len(devices), replicated=plan.replicated, env=env)
    seconds["backend_compile"] = time.perf_counter() - t0
    return Deviceless(stock, plan, payload, seconds)
