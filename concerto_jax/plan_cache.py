"""The persistent plan cache: what a second compile of the same step reuses (``Options.cache_dir``).

``optimize`` (``api``, CPU path) and ``compile_for_target`` open a handle per compile, keyed by
what determines the plan (``plan_keys``: the lowered program and its devices, the options, the
code and JAX); a target compile's key adds the cluster (name, figures), its target config's
SHA-256 and the CUDA plugin that compiles for it.

Entries (``plan_store``: atomic directories, checksummed blobs):

    step        the captured module, ``PipelineResult.to_json()`` and the step's compiled entry
                layout. A hit (one process) skips XLA's dumped compile and every pass: JAX
                compiles the step without dumps (its calling convention; as the original
                compiles where the first-step check may run, which then runs that compile
                instead of compiling the original again; at the capture's level otherwise),
                whose entry layout must equal the stored one; the emitted module
                must parse and pass the IR verifier (``api`` then checks its signature
                against the captured one, as for any plan)
    executable  keyed by the emitted module's SHA-256, devices, compiler options and code: our
                compiled executable's PJRT bytes (one process, no host callbacks), loaded
                behind the step's header; its entry layout must equal the step's. A load that
                fails is rejected: ours is compiled from the plan's text
    target      a ``TargetResult``'s texts and figures (not one that fell back on an error);
                every module in it must parse, the handed one pass the verifier
    route       ``optimize``'s GPU route (``gpu_route.route.build``): its plan
                (``Plan.to_json()``) and the backend's serialized executable with what it was
                compiled for (one process). A hit skips the plan and the backend compile; JAX's
                stock compile of the step still runs (the header ours is loaded behind, and the
                post-SPMD module, which must equal the stored one), the handed module must parse
                and pass the IR verifier, and the load's own checks (device count, compute
                capability, entry layouts) run as on a miss; a load they refuse rejects the
                entry and the step is built again

Under ``jax.distributed`` every process captures as without a cache; process 0 alone reads and
writes the cache inside ``multiprocess.leader_decides`` (a hit only if the stored captured
module is the one it captured), every process verifies a plan that came from the cache, and
all fall back together if any cannot. Executables are not cached there. The GPU route's
entries are per process instead (each holds that process's executable and the leader's plan of
the build that wrote it), used only where every process has its own. A pass registered at
run time (not ``hlo_passes.registry.PASS_TABLE``'s own) turns the cache off for that compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from concerto_jax import capture as capture_lib
from concerto_jax import jax_compat, multiprocess, pipeline
from concerto_jax.costmodel.envelope import RobustVerdict
from concerto_jax.jax_compat import payload_device_count
from concerto_jax.plan_keys import (
    canonical,
    code_part,
    devices_part,
    options_part,
    program_part,
    registered_passes,
)
from concerto_jax.plan_store import PlanStore, key_of, resolve_dir
from concerto_jax.report import PassRecord
from hlo_passes.ir import HloModule, parse_module, verify, without_source_locations

log = logging.getLogger(__name__)

LIGHT_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""How a hit compiles the step for its calling convention where no first-step check will run:
the capture's options (``capture.capture``) without XLA's dumps. Its entry layout is checked
against the stored one."""
_FROM_CACHE = "plan_cache_hit"


def _store(options, what: str) -> PlanStore | None:
    root = resolve_dir(options.cache_dir)
    if root is None:
        return None
    if not registered_passes(options.passes):
        log.info("plan cache off for this %s: a pass of %s is registered at run time", what,
                 list(options.passes))
        return None
    return PlanStore(root)


def _verified_module(text: str, source: str) -> HloModule:
    """``text`` parsed and verified (raises ``hlo_passes.ir.HloError`` otherwise)."""
    module = parse_module(text, source=source)
    verify(module)
    return module


# -- optimize ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    captured: str
    data: dict
    entry_layout: str


class StepCache:
    """The cache of one signature of ``optimize``: ``capture`` (a hit without XLA's dumps),
    ``decide`` (the leader's plan, read or made and written), ``load`` / ``save`` (our
    executable). Made by ``open_step``."""

    def __init__(self, store: PlanStore, lowered, parts: dict, reference_options: Mapping | None = None):
        self.store, self.lowered, self.parts = store, lowered, parts
        self.key = key_of(parts)
        # a hit compiles the step with these (the first-step check's reference: JAX's defaults plus
        # Options.compiler_options) instead of LIGHT_COMPILE, so that the check runs that compile
        # rather than compiling the original again; None: no check, LIGHT_COMPILE
        self.reference_options = None if reference_options is None else dict(reference_options)
        self._plan: _Plan | None = None
        self._looked = False
        self._read_s = 0.0

    def _read(self) -> _Plan | None:
        """The stored plan, checked and verified (None: a miss, or a rejected entry)."""
        t0 = time.perf_counter()
        self._looked = True
        entry = self.store.read("step", self.parts)
        if entry is None:
            return None
        try:
            data = json.loads(entry.blobs["plan.json"])
            result = pipeline.PipelineResult.from_json(data)
            _verified_module(result.text, "plan cache")
            plan = _Plan(entry.blobs["captured.hlo"].decode(), data, entry.meta["entry_layout"])
        except Exception as e:  # noqa: BLE001 - whatever is wrong, the entry is not trusted
            self.store.reject("step", entry.key, f"its plan does not verify ({type(e).__name__}: "
                                                 f"{str(e)[:300]})")
            return None
        self._read_s = time.perf_counter() - t0
        return plan

    def capture(self) -> capture_lib.Capture | None:
        """On a hit in a single process: a ``Capture`` of the stored module with JAX's compile
        of the step without XLA's dumps (its calling convention): as the original compiles where
        the first-step check may run (``Capture.reference``: the check runs this compile), at the
        capture's level (``LIGHT_COMPILE``) otherwise; else None (capture as usual)."""
        if jax.process_count() > 1:
            return None
        plan = self._read()
        if plan is None:
            return None
        t0 = time.perf_counter()
        reference = self.reference_options is not None
        try:
            compiled = self.lowered.compile(
                compiler_options=self.reference_options if reference else dict(LIGHT_COMPILE))
            layout = jax_compat.entry_layout(jax_compat.xla_executable(compiled))
        except Exception as e:  # noqa: BLE001 - capture as without a cache (it reports the error)
            log.warning("plan cache: the step could not be compiled for its hit (%s: %s)",
                        type(e).__name__, str(e)[:300])
            return None
        if layout != plan.entry_layout:
            self.store.reject("step", self.key, "the step compiles to another entry layout "
                              f"({layout[:200]}) than the stored ({plan.entry_layout[:200]})")
            return None
        self._plan = plan
        devices = tuple(jax_compat.unloaded_executable(compiled).device_list)
        log.info("plan cache hit: %s", self.store.path("step", self.key))
        return capture_lib.Capture(hlo_text=plan.captured, compiled=compiled, device_list=devices,
                                   num_partitions=len(devices), seconds=time.perf_counter() - t0,
                                   reference=reference)

    def decide(self, cap: capture_lib.Capture | None, build: Callable[[], dict]) -> dict:
        """``multiprocess.leader_decides`` with the cache on the leader: the stored plan where
        there is one for this captured module, else ``build()``'s, written. A plan from the
        cache is verified on every process (``LeaderPlanError`` on all if one cannot)."""
        if cap is None:
            return multiprocess.leader_decides("", build)

        def leader() -> dict:
            t0 = time.perf_counter()
            plan = self._plan if self._plan is not None or self._looked else self._read()
            if plan is not None and (without_source_locations(plan.captured)
                                     != without_source_locations(cap.hlo_text)):
                self.store.reject("step", self.key, "its captured module differs from the "
                                                          "one this step captured")
                plan = None
            if plan is not None:
                seconds = self._read_s + time.perf_counter() - t0
                return {**plan.data, "stage_seconds": {"plan_cache": seconds}, _FROM_CACHE: True}
            data = build()
            self._write(cap, data)
            return data

        return _checked(multiprocess.leader_decides(cap.hlo_text, leader))

    def _write(self, cap: capture_lib.Capture, data: dict) -> None:
        try:
            layout = jax_compat.entry_layout(jax_compat.xla_executable(cap.compiled))
            blobs = {"captured.hlo": cap.hlo_text.encode(), "plan.json": json.dumps(data).encode()}
        except Exception as e:  # noqa: BLE001 - a plan we cannot store is only not cached
            log.info("plan cache: the plan is not stored (%s: %s)", type(e).__name__, e)
            return
        self.store.write("step", self.parts, blobs, {"entry_layout": layout})

    def _executable_parts(self, cap, text: str, compiler_options: Mapping) -> dict | None:
        if jax.process_count() > 1 or cap.host_callbacks:
            return None  # JAX's own cache does not store executables with host callbacks either
        return {"emitted_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "devices": devices_part(cap.device_list),
                "compiler_options": canonical(dict(compiler_options)), "code": code_part()}

    def load(self, cap: capture_lib.Capture, text: str, compiler_options: Mapping) -> Any | None:
        """Our compiled step (``jax.stages.Compiled``, JAX's calling convention) from the
        stored executable of ``text``, or None: compile it."""
        parts = self._executable_parts(cap, text, compiler_options)
        entry = self.store.read("executable", parts) if parts is not None else None
        if entry is None:
            return None
        try:
            payload = entry.blobs["executable.pjrt"]
            stored = payload_device_count(payload)
            if stored is not None and stored != len(cap.device_list):
                raise ValueError(f"compiled for {stored} devices, the step has {len(cap.device_list)}")
            original = jax_compat.xla_executable(cap.compiled)
            loaded = jax_compat.behind_header(original, payload, cap.device_list)
            want, got = jax_compat.entry_layout(original), jax_compat.entry_layout(loaded)
            if want != got:
                raise ValueError(f"its entry layout {got[:200]} is not the step's {want[:200]}")
            compiled = jax_compat.swapped_step(cap.compiled, loaded, assemble_outputs=False)
        except Exception as e:  # noqa: BLE001 - compile from the text instead
            self.store.reject("executable", entry.key, f"it could not be loaded ({type(e).__name__}: "
                                                       f"{str(e)[:300]})")
            return None
        log.info("plan cache: loaded our executable %s", entry.key[:12])
        return compiled

    def save(self, cap: capture_lib.Capture, text: str, compiler_options: Mapping, loaded) -> None:
        """Store ``loaded`` (our executable of ``text``) where the client can serialize it."""
        parts = self._executable_parts(cap, text, compiler_options)
        if parts is None:
            return
        try:
            payload = jax_compat.pjrt_payload(loaded)
        except Exception as e:  # noqa: BLE001 - a client that cannot serialize: plan only
            log.info("plan cache: our executable is not stored (%s: %s)", type(e).__name__, e)
            return
        self.store.write("executable", parts, {"executable.pjrt": payload},
                         {"num_devices": len(cap.device_list)})


def _checked(data: dict) -> dict:
    """The leader's plan as every process takes it: one from the leader's cache is verified on
    every process (``LeaderPlanError`` on all if one cannot)."""
    if data.pop(_FROM_CACHE, False) and jax.process_count() > 1:
        ok = True
        try:
            _verified_module(data["text"], "plan cache")
        except Exception as e:  # noqa: BLE001 - reported jointly below
            log.warning("the leader's cached plan does not verify here: %s", e)
            ok = False
        if not multiprocess.all_succeeded(ok):
            raise multiprocess.LeaderPlanError(
                "the plan process 0 read from its plan cache does not verify on every process")
    return data


def decide(cache: StepCache | None, cap: capture_lib.Capture | None, build: Callable[[], dict]) -> dict:
    """The plan every process runs: ``cache.decide`` where this process has a cache, else the
    leader's plan (which may come from the leader's cache: a process whose passes cannot be
    keyed still takes part in the leader's checks)."""
    if cache is not None:
        return cache.decide(cap, build)
    return _checked(multiprocess.leader_decides(cap.hlo_text if cap is not None else "", build))


def open_step(fn, args: tuple, kwargs: dict, options) -> StepCache | None:
    """The plan cache of ``fn``'s signature for ``args``/``kwargs`` under ``options`` (the
    pipeline's), or None where the cache is off or the step cannot be keyed (logged)."""
    try:
        store = _store(options, "step")
        if store is None:
            return None
        lowered = fn.lower(*args, **kwargs)
        parts = {"program": program_part(lowered), "options": options_part(options),
                 "code": code_part()}
    except Exception as e:  # noqa: BLE001 - no key: compile as without a cache
        log.info("plan cache off for this step (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    checks = options.optimize.check_first_step is not False
    return StepCache(store, lowered, parts, dict(options.compiler_options) if checks else None)


# -- compile_for_target ------------------------------------------------------------------------

_TEXTS = {"final_text": "final.hlo", "stock_final_text": "stock_final.hlo",
          "emitted_text": "emitted.hlo", "scheduled_text": "scheduled.hlo"}


class TargetCache:
    """The cache of one ``compile_for_target`` call: ``lookup`` (the stored result's fields)
    and ``save``. Made by ``open_target``."""

    def __init__(self, store: PlanStore, parts: dict, reads: bool):
        self.store, self.parts, self.reads = store, parts, reads
        self.key = key_of(parts)

    def lookup(self, seconds: Mapping[str, float]) -> dict | None:
        """The fields of the stored ``TargetResult`` (``seconds``: this call's, plus the hit's),
        verified; None on a miss."""
        if not self.reads:
            return None
        t0 = time.perf_counter()
        entry = self.store.read("target", self.parts)
        if entry is None:
            return None
        try:
            fields = json.loads(entry.blobs["result.json"])
            for field, blob in _TEXTS.items():
                fields[field] = entry.blobs[blob].decode() if blob in entry.blobs else None
                if fields[field] is not None:
                    module = parse_module(fields[field], source=f"plan cache {blob}")
                    if field == "emitted_text":
                        verify(module)
            fields["passes"] = tuple(PassRecord.from_dict(p) for p in fields["passes"])
            fields["robust"] = tuple(RobustVerdict.from_dict(v) for v in fields.get("robust", ()))
            fields["cut"] = tuple(fields.get("cut", ()))
        except Exception as e:  # noqa: BLE001 - whatever is wrong, the entry is not trusted
            self.store.reject("target", entry.key, f"its result does not verify ({type(e).__name__}: "
                                                   f"{str(e)[:300]})")
            return None
        fields["seconds"] = {**{k: round(v, 2) for k, v in seconds.items()},
                             "plan_cache": round(time.perf_counter() - t0, 2)}
        log.info("plan cache hit: %s", self.store.path("target", entry.key))
        return fields

    def save(self, result, failed: bool) -> None:
        """Store ``result`` (a ``TargetResult``) unless it reports the stock program after a
        failure (``failed``: a failure may not happen again)."""
        if failed:
            return
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        blobs = {blob: fields.pop(field).encode() for field, blob in _TEXTS.items()
                 if fields.get(field) is not None}
        for field in _TEXTS:
            fields.pop(field, None)
        fields["passes"] = [dataclasses.asdict(p) for p in fields["passes"]]
        fields["robust"] = [v.as_dict() for v in fields.get("robust", ())]
        try:
            blobs["result.json"] = json.dumps(fields, default=_json_scalar).encode()
        except (TypeError, ValueError) as e:
            log.info("plan cache: the target result is not stored (%s)", e)
            return
        self.store.write("target", self.parts, blobs)


def _json_scalar(value):
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars in pass statistics
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


# -- optimize's GPU route ------------------------------------------------------------------------

class RouteCache:
    """The cache of one build of ``optimize``'s GPU route: ``lookup`` (the stored plan and
    payload fields), ``save`` and ``reject``. Made by ``open_route``."""

    def __init__(self, store: PlanStore, parts: dict):
        self.store, self.parts = store, parts
        self.key = key_of(parts)

    def lookup(self, post_spmd: str) -> tuple[dict, dict] | None:
        """``(plan json, payload fields)`` of the stored build of this step, verified against
        this stock compile's post-SPMD module; None on a miss or a rejected entry."""
        entry = self.store.read("route", self.parts)
        if entry is None:
            return None
        try:
            plan = json.loads(entry.blobs["plan.json"])
            if without_source_locations(entry.blobs["post_spmd.hlo"].decode()) != without_source_locations(post_spmd):
                raise ValueError("its post-SPMD module differs from the one this step's compile wrote")
            _verified_module(plan["handed"], "plan cache handed")
            if hashlib.sha256(plan["handed"].encode()).hexdigest() != plan["sha256"]:
                raise ValueError("its handed module's SHA-256 is not the recorded one")
            meta = entry.meta
            payload = {"data": entry.blobs["executable.pjrt"], "num_devices": int(meta["num_devices"]),
                       "replicated": bool(meta["replicated"]), "compute_capability": meta["compute_capability"],
                       "final_text": entry.blobs["final.hlo"].decode(),
                       "compile_options": entry.blobs["compile_options.pb"]}
        except Exception as e:  # noqa: BLE001 - whatever is wrong, the entry is not trusted
            self.reject(f"it does not verify ({type(e).__name__}: {str(e)[:300]})")
            return None
        log.info("plan cache hit: %s", self.store.path("route", self.key))
        return plan, payload

    def reject(self, why: str) -> None:
        self.store.reject("route", self.key, why)

    def save(self, post_spmd: str, plan_json: dict, payload) -> None:
        """Store a built step: its post-SPMD module, plan and ``payload`` (``gpu_route.Payload``)."""
        try:
            blobs = {"post_spmd.hlo": post_spmd.encode(), "plan.json": json.dumps(plan_json).encode(),
                     "executable.pjrt": bytes(payload.data), "final.hlo": payload.final_text.encode(),
                     "compile_options.pb": bytes(payload.compile_options)}
        except (TypeError, ValueError) as e:
            log.info("plan cache: the route's build is not stored (%s: %s)", type(e).__name__, e)
            return
        self.store.write("route", self.parts, blobs, {
            "num_devices": payload.num_devices, "replicated": payload.replicated,
            "compute_capability": payload.compute_capability})


def open_route(lowered, options, backend: str) -> RouteCache | None:
    """The plan cache of a GPU-route build of ``lowered`` under ``options`` on ``backend`` (its
    name), or None where it is off: no cache directory, a pass registered at run time, or a step
    that cannot be keyed. Under ``jax.distributed`` each process keeps its own entry (its
    executable is for its own devices; the plan in it is the leader's of the build that wrote
    it): the key names the process and the process count, and a build uses the entries only
    where every process has one (``gpu_route.route.build``)."""
    try:
        store = _store(options, "GPU route build")
        if store is None:
            return None
        parts = {"program": program_part(lowered), "options": options_part(options),
                 "code": code_part(), "backend": backend}
        if jax.process_count() > 1:
            parts["process"] = f"{jax.process_index()} of {jax.process_count()}"
    except Exception as e:  # noqa: BLE001 - no key: build as without a cache
        log.info("plan cache off for this GPU route build (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    return RouteCache(store, parts)


def open_target(lowered, cluster, options, **settings) -> TargetCache | None:
    """The plan cache of a ``compile_for_target`` call (``settings``: its other arguments that
    change the result, e.g. ``via``), or None where it is off or the step cannot be keyed."""
    try:
        store = _store(options, "target compile")
        if store is None:
            return None
        plugin = importlib.import_module("jax_plugins.xla_cuda13")
        plugin_dir = os.path.dirname(plugin.__file__)
        libs = sorted(n for n in os.listdir(plugin_dir) if n.endswith(".so"))
        plugin_files = [[n, os.stat(os.path.join(plugin_dir, n)).st_size] for n in libs]
        parts = {"program": program_part(lowered), "options": options_part(options),
                 "code": code_part(), "settings": canonical(settings),
                 "cluster": canonical(cluster), "plugin": [plugin_dir, plugin_files],
                 "target_config_sha256": hashlib.sha256(
                     cluster.target_config_text().encode()).hexdigest()}
    except Exception as e:  # noqa: BLE001 - no key: compile as without a cache
        log.info("plan cache off for this target compile (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    reads = options.dump_dir is None
    if not reads:
        log.info("plan cache: not read for this target compile (dump_dir asks for the modules "
                 "of a real compile); its result is stored")
    return TargetCache(store, parts, reads)

