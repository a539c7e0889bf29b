"""The one place where concerto_jax touches JAX's and jaxlib's internals.

Everything private that the package uses of JAX (``jax._src``), jaxlib (``_jax``,
``_hlo``, ``xla_client``) and XLA (dump pass names, the IFRT serialization header) goes
through this module, so that a JAX upgrade is checked in one file. Each function names
the versions its path was checked on. The PJRT C API of the CUDA plugin is driven by
``concerto_jax.deviceless.pjrt_c``, which checks the API version and table size the plugin
reports and reads function pointers by the header's (append-only) layout.

Supported: jax/jaxlib from ``MIN_VERSION`` up to, not including, ``NEXT_UNCHECKED``
(checked on 0.11.2 and 0.12.0.1). On another version ``check_supported`` raises
``UnsupportedJaxVersion``: ``optimize`` then runs the original step with one warning and
``compile_for_target`` raises it, rather than misbehaving on internals that changed.
Setting ``CONCERTO_JAX_ALLOW_UNCHECKED_JAX=1`` lets a newer version through at the user's
risk (for trying a release before it is checked here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

# Public JAX only here: each function imports the internals it uses, so that a release that
# moved one still imports the package (check_supported then names the unchecked version).
import jax
import jaxlib
import numpy as np

log = logging.getLogger(__name__)

MIN_VERSION = (0, 11, 2)
"""The oldest jax/jaxlib release checked."""
NEXT_UNCHECKED = (0, 13)
"""The first release line not checked yet (0.12.x is)."""
CHECKED_VERSIONS = ("0.11.2", "0.12.0.1")
"""The releases the test suite ran on."""

ALLOW_ENV = "CONCERTO_JAX_ALLOW_UNCHECKED_JAX"


class UnsupportedJaxVersion(RuntimeError):
    """The installed JAX is outside the range whose internals this package was checked on."""


def parse_version(version: str) -> tuple[int, ...]:
    """The release numbers of a version string, up to its first non-numeric suffix
    (``"0.13.0rc1"`` -> ``(0, 13, 0)``, ``"0.12.1.dev20261101"`` -> ``(0, 12, 1)``)."""
    parts = []
    for piece in version.split("."):
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):
            break
    return tuple(parts)


def jax_versions() -> tuple[str, str]:
    """``(jax.__version__, jaxlib.__version__)``."""
    return jax.__version__, jaxlib.__version__


def check_supported() -> None:
    """Raise ``UnsupportedJaxVersion`` unless jax and jaxlib are in the checked range.

    Raises:
      UnsupportedJaxVersion: says which versions are supported and how to proceed.
    """
    versions = jax_versions()
    bad = [v for v in versions if not MIN_VERSION <= parse_version(v) < NEXT_UNCHECKED]
    if not bad:
        return
    if os.environ.get(ALLOW_ENV) == "1":
        log.warning("jax/jaxlib %s/%s were not checked with concerto_jax (%s=1 lets them through)",
                    *versions, ALLOW_ENV)
        return
    lo = ".".join(map(str, MIN_VERSION))
    hi = ".".join(map(str, NEXT_UNCHECKED))
    raise UnsupportedJaxVersion(
        f"concerto_jax was checked with jax/jaxlib >= {lo}, < {hi} (tested on "
        f"{', '.join(CHECKED_VERSIONS)}); this environment has jax {versions[0]}, jaxlib "
        f"{versions[1]}. Install a supported release (`pip install 'jax>={lo},<{hi}'`), or set "
        f"{ALLOW_ENV}=1 to try this one at your own risk")


# -- XLA's dumps (pass names and file markers; checked on 0.11.2, 0.12.0.1) ------------------

SPMD_PASS = "spmd-partitioning"
"""The pass whose ``after`` dump is the per-device module (``*after_spmd-partitioning*``)."""
LHS_PASS = "latency-hiding-scheduler"
"""XLA:GPU's latency hiding scheduler."""
SCHEDULED_PASS = "apply-xla-transforms"
"""First pass of XLA:GPU's post-scheduling pipelines; its ``before`` dump in the pipeline
``SCHEDULED_MARKER`` names is the scheduled module ``RunPostSchedulingPipelines`` receives."""
SCHEDULED_MARKER = "post-scheduler-xla-transforms.after_pipeline-start.before_apply-xla-transforms"


# -- XLA:GPU flags whose form changed (checked on 0.11.2, 0.12.0.1) ---------------------------

COLLECTIVE_PIPELINER_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collective kinds XLA:GPU's collective pipeliner moves out of loop bodies."""


def collective_pipeliner_options(on: bool) -> tuple[tuple[str, str], ...]:
    """Compiler options turning XLA:GPU's collective pipeliner on (every collective it can move)
    or off, for every kind of ``COLLECTIVE_PIPELINER_KINDS``.

    The boolean ``xla_gpu_enable_pipelined_{all_gather,...}`` flags of older XLA are reserved
    (refused) in 0.11.2 and 0.12: the setting is the enum ``xla_gpu_pipeline_<kind>``
    (``CollectivePipeliningMode``: DEFAULT, the opt level's choice; OFF; ON, what ``true`` was;
    EXPLICIT, only collectives marked by the frontend).
    """
    mode = "COLLECTIVE_PIPELINING_MODE_ON" if on else "COLLECTIVE_PIPELINING_MODE_OFF"
    return tuple((f"xla_gpu_pipeline_{kind}", mode) for kind in COLLECTIVE_PIPELINER_KINDS)


# -- our own deviceless compiles (checked on 0.11.2, 0.12.0.1) ---------------------------------

FUSION_AUTOTUNER_OFF = (("xla_gpu_experimental_enable_fusion_autotuner", False),)
"""XLA options that turn the generic-fusion autotuner off (``deviceless_own_compile_options``)."""

FUSION_AUTOTUNER_OFF_FROM = (0, 12)
"""The first JAX release line where ``FUSION_AUTOTUNER_OFF`` is used (checked on 0.12.0.1). On
0.11.2 its config assigner then finds no default config for some Triton GEMM fusions of a
rewritten program ("TritonBackend does not support a default config"; the replicated-collectives
retry of ``tests/test_compile_for_target.py``), so that release keeps the autotuner."""


def deviceless_own_compile_options() -> tuple[tuple[str, object], ...]:
    """XLA options of the deviceless compiles ``compile_for_target`` runs for itself (stock's
    reference compile, XLA's pipeline on a rewritten program, the threshold candidates), never
    of a compile a user runs.

    Why: on a deviceless target XLA's generic-fusion autotuner (the ``config-assigner`` pass) has
    no device to measure on; it compiles every loop and input fusion through the GPU pipeline and
    then gives each the default emitter config (``NATIVE_EMITTER_TYPE_INVALID``, unroll 0, which
    the emitters read as no config). That is about half of XLA's whole compile of a step (the
    1-layer TP=8 held-out step, one 2-core machine shared with other jobs: 40.3 -> 22.4 s on
    0.12.0.1). With it off, XLA's scheduled and final modules are the same but for that
    annotation and the ``fingerprint_before_lhs`` attribute
    (``tests/test_target.py::test_own_compile_options_change_no_kernel``). GEMM fusions keep
    their configs on 0.12; on 0.11.2 some lose their default one (``FUSION_AUTOTUNER_OFF_FROM``),
    so there nothing is set."""
    return FUSION_AUTOTUNER_OFF if parse_version(jax.__version__) >= FUSION_AUTOTUNER_OFF_FROM else ()


KERNEL_CACHE_OPTION = "xla_gpu_kernel_cache_file"
"""XLA's kernel cache: compiled kernels written to this file, found again by the fingerprint of
their fused computation and arguments (``KernelReuseCache``; the cache JAX itself puts under its
persistent compilation cache with ``jax_persistent_cache_enable_xla_caches``). Our compiles of
one ``compile_for_target`` call share one file (D40): the stock step, the rewritten program and
each threshold candidate repeat most kernels. Checked: with it, XLA's scheduled and final
modules are the same text (the 1-layer TP=8 held-out step, 0.12.0.1)."""

# -- jaxlib's HLO and MLIR bridges (checked on 0.11.2, 0.12.0.1) -------------------------------

def xla_client():
    """``jax._src.lib.xla_client`` (``CompileOptions``, ``DeviceList``, the ``hlo`` module)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.lib import xla_client as xc

    return xc


def hlo_module_from_text(text: str):
    """XLA's parser: a jaxlib ``HloModule`` (raises what XLA raises for bad text)."""
    return xla_client().hlo.hlo_module_from_text(text)


def hlo_module_from_proto(proto: bytes):
    """A jaxlib ``HloModule`` from a serialized ``HloModuleProto``."""
    return xla_client().hlo.HloModule.from_serialized_hlo_module_proto(proto)


def hlo_to_stablehlo(hlo_module) -> bytes:
    """StableHLO bytecode of a jaxlib ``HloModule`` (XLA's HLO -> MHLO -> StableHLO import)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.lib import _jax

    return _jax.mlir.hlo_to_stablehlo(hlo_module.as_serialized_hlo_module_proto())


@contextlib.contextmanager
def mlir_module(module_bytes: bytes | str) -> Iterator[Any]:
    """Parse StableHLO into an ``ir.Module`` inside JAX's MLIR context (yields the module)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # lazy: as above

    with mlir.make_ir_context() as ctx:
        yield ir.Module.parse(module_bytes, context=ctx)


def mlir_ir():
    """JAX's MLIR Python bindings (``ir``): attributes for edits inside ``mlir_module``."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.lib.mlir import ir

    return ir


def compile_options(devices_grid, *, num_replicas: int, num_partitions: int,
                    spmd: bool, env: dict | None = None):
    """``xla_client.CompileOptions`` with a device assignment (``devices_grid``: ids,
    shape ``(num_replicas, num_partitions)``) and XLA option overrides ``env``."""
    xc = xla_client()
    opts = xc.CompileOptions()
    build = opts.executable_build_options
    build.num_replicas = num_replicas
    build.num_partitions = num_partitions
    build.use_spmd_partitioning = spmd
    build.device_assignment = xc.DeviceAssignment.create(
        np.asarray(devices_grid, dtype=np.int64).reshape(num_replicas, num_partitions))
    if env:
        opts.env_option_overrides = list(env.items())
    return opts


def device_list(devices: Sequence) -> Any:
    """jaxlib's ``DeviceList`` of ``devices``."""
    return xla_client().DeviceList(tuple(devices))


def custom_call_targets(platform: str) -> Any:
    """The custom-call targets registered with XLA for ``platform``."""
    return xla_client().custom_call_targets(platform)


# -- JAX's compiled steps (checked on 0.11.2, 0.12.0.1) ----------------------------------------

@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache unused while the block runs: a compile whose dumps we
    read must run XLA's passes (a hit runs none and dumps nothing; MaxText turns the cache on).

    JAX decides once per process whether the cache is used (``compilation_cache.is_cache_used``
    memoises it; its config flag is read only then), so the block sets that memo to "not used"
    and puts the process's own decision back after it. Compiles of other threads meanwhile miss
    the cache too (they compile; nothing is wrong). Where JAX keeps no such memo, a no-op."""
    from jax._src import compilation_cache as cc  # lazy: JAX internals, only around a capture

    lock = getattr(cc, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(cc, "_cache_checked") or not hasattr(cc, "_cache_used"):
        yield
        return
    with lock:
        saved = (cc._cache_checked, cc._cache_used)
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            cc._cache_checked, cc._cache_used = saved


_SHARDING_IDS: dict = {}


def sharding_identity(sharding, ndim: int) -> Any:
    """A hashable value equal for shardings that place an ``ndim``-array alike: the devices in
    order, XLA's sharding and the memory kind (``P(None, None)`` and ``P()`` over one mesh are
    one identity; as objects they differ). Memoised per sharding object; the sharding itself
    where JAX's internals do not say."""
    key = (sharding, ndim)
    found = _SHARDING_IDS.get(key)
    if found is None:
        try:
            found = (tuple(d.id for d in sharding._device_assignment),
                     str(sharding._to_xla_hlo_sharding(ndim)), getattr(sharding, "memory_kind", None))
        except Exception:  # noqa: BLE001 - another sharding type or JAX: the object keys itself
            found = sharding
        if len(_SHARDING_IDS) < 4096:
            _SHARDING_IDS[key] = found
    return found


def unloaded_executable(compiled) -> Any:
    """The ``UnloadedMeshExecutable`` of a ``jax.stages.Compiled`` (devices, callbacks,
    output avals and shardings, effects)."""
    return compiled._executable._unloaded_executable


def xla_executable(compiled) -> Any:
    """The jaxlib ``LoadedExecutable`` a ``jax.stages.Compiled`` runs."""
    return compiled._executable.xla_executable


def physical_shard_shapes(avals: Sequence, shardings: Sequence) -> list[tuple[int, ...]]:
    """Per-device shapes of outputs ``avals`` under ``shardings`` (typed keys as their data)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src import core, dtypes
    from jax._src.sharding_impls import physical_sharding  # lazy: as above

    out = []
    for aval, sharding in zip(avals, shardings, strict=True):
        if dtypes.issubdtype(aval.dtype, dtypes.extended):
            aval, sharding = core.physical_aval(aval), physical_sharding(aval, sharding)
        out.append(tuple(sharding.shard_shape(aval.shape)))
    return out


@contextlib.contextmanager
def lowering_without_local_backend() -> Iterator[None]:
    """Let JAX lower host callbacks for a platform this machine has no client of.

    JAX's callback lowering asks the module context for the platform's client
    (``ModuleContext.get_backend``), which a deviceless target does not have (``Unknown
    backend: 'gpu'``); on GPU platforms the lowering never uses it (only TPU does). Inside
    this context a missing client is ``None`` instead of an error.
    """
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.interpreters import mlir

    original = mlir.ModuleContext.get_backend

    def get_backend(self, optional: bool = False):
        try:
            return original(self, optional)
        except RuntimeError:
            return None

    mlir.ModuleContext.get_backend = get_backend
    try:
        yield
    finally:
        mlir.ModuleContext.get_backend = original


def drop_host_callbacks(lowered) -> int:
    """Remove the Python host callbacks from a ``jax.stages.Lowered``'s compile arguments
    (a compile-only client takes none); returns how many were dropped."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if isinstance(args, dict) and args.get("host_callbacks"):
        n = len(args["host_callbacks"])
        lowered._lowering.compile_args = {**args, "host_callbacks": []}
        return n
    return 0


# -- PJRT plugins (checked on 0.11.2, 0.12.0.1) -------------------------------------------------

def topology_platforms() -> frozenset[str]:
    """Platforms JAX can describe deviceless topologies for (registered plugins)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src import xla_bridge as xb

    return frozenset(xb._topology_factories)


def discover_pjrt_plugins() -> None:
    """Run JAX's plugin discovery (``jax_plugins.*``) now."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src import xla_bridge as xb

    xb._discover_and_register_pjrt_plugins()


GPU_LIBRARY_MODULES = ("gpu_solver", "gpu_linalg", "gpu_sparse", "gpu_prng", "gpu_rnn")
"""jaxlib's modules of GPU library kernels (cuSOLVER, cuSPARSE, ...), each registering its FFI
targets when JAX starts (0.11.2, 0.12.0.1)."""


def register_gpu_library_calls() -> dict[str, Exception]:
    """Reload jaxlib's GPU library modules (``GPU_LIBRARY_MODULES``) and register their CUDA FFI
    targets with XLA as JAX does at start-up (``jax._src.lax.linalg.register_module_custom_calls``):
    for a CUDA plugin imported after JAX started. Returns the modules that failed, with why."""
    import importlib  # lazy: only where a CUDA plugin joins late

    from jax import ffi  # lazy: as above

    failed: dict[str, Exception] = {}
    for name in GPU_LIBRARY_MODULES:
        try:
            module = importlib.reload(importlib.import_module(f"jaxlib.{name}"))
            if name == "gpu_rnn":  # registers its targets when imported
                continue
            for platform, targets in module.registrations().items():
                if platform != "CUDA":
                    continue
                for target, value, api_version in targets:
                    ffi.register_ffi_target(target, value, platform=platform, api_version=api_version)
            for target in getattr(module, "batch_partitionable_targets", list)():
                ffi.register_ffi_target_as_batch_partitionable(target)
        except Exception as e:  # noqa: BLE001 - optional kernels: the caller reports them
            failed[name] = e
    return failed


def backends_initialized() -> bool:
    """Whether JAX has created its backends (clients) yet."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src import xla_bridge as xb

    return xb.backends_are_initialized()


# -- swapping an executable into JAX's step (checked on 0.11.2, 0.12.0.1) ----------------------

def ifrt_header_length(blob: bytes) -> int:
    """Bytes of the varint-delimited ``SerializedXlaExecutableMetadata`` at the front of a
    ``Client.serialize_executable`` blob (the PJRT executable's bytes follow)."""
    n = shift = i = 0
    while True:
        if i >= len(blob) or shift > 63:
            raise ValueError("not a serialized executable: no varint-delimited IFRT header")
        b = blob[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if i + n > len(blob):
                raise ValueError(f"not a serialized executable: header of {n} bytes, blob of {len(blob)}")
            return i + n


def behind_header(original, payload_pjrt: bytes, devices: Sequence, host_callbacks: Sequence = ()):
    """Load PJRT executable bytes on JAX's client with ``original``'s IFRT metadata.

    IFRT's serialized form is a varint-delimited ``SerializedXlaExecutableMetadata`` (output
    dtypes, global shapes, shardings, memory kinds, layouts, per-parameter donation; no
    device ids) followed by the PJRT executable's bytes; at load the runtime takes the
    outputs' description from the header. With the header of the user's step, outputs
    come back as that step's global arrays, and JAX's C++ dispatch serves every call.

    The caller must have checked that the payload's signature (per-device parameter and
    output shapes) is the original's: the runtime does not (a wrong shape runs and fails
    only when read), and a device count other than the payload's aborts the process.

    Args:
      original: the jaxlib ``LoadedExecutable`` of the user's step.
      payload_pjrt: PJRT executable bytes (``serialize_executable`` minus its header, or
        ``PJRT_Executable_Serialize`` of a deviceless compile).
      devices: the devices to load on, in the payload's device-assignment order.
      host_callbacks: the callables the module's host-callback custom calls index.
    """
    client = original.client
    theirs = client.serialize_executable(original)
    blob = theirs[:ifrt_header_length(theirs)] + payload_pjrt
    kwargs = {"host_callbacks": list(host_callbacks)} if host_callbacks else {}
    return client.deserialize_executable(blob, device_list(devices), **kwargs)


def pjrt_payload(executable) -> bytes:
    """The PJRT executable bytes of a jaxlib ``LoadedExecutable`` (its serialization minus the
    IFRT header)."""
    blob = executable.client.serialize_executable(executable)
    return blob[ifrt_header_length(blob):]


def swapped_step(original, loaded_executable, *, assemble_outputs: bool):
    """A ``jax.stages.Compiled`` calling ``loaded_executable`` with ``original``'s convention.

    JAX's own ``MeshExecutable`` machinery is reused (``UnloadedMeshExecutable`` with another
    ``xla_executable``): argument flattening, unused-argument pruning, donation, output
    shardings and weak types come out exactly as for the original.

    Args:
      original: the user's step (``jax.stages.Compiled``).
      loaded_executable: an executable over the same devices whose outputs the runtime
        already describes as the step's global arrays (``behind_header``), or, with
        ``assemble_outputs``, a replicated executable whose outputs it describes per device.
      assemble_outputs: build every output from its per-device buffers on every call
        (jaxlib >= 0.11 reads a per-device-described output as a whole: "Shape mismatch
        during ToLiteral conversion"); costs JAX's Python dispatch on every call.
    """
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src import stages

    unloaded = unloaded_executable(original)
    ours = dataclasses.replace(unloaded, xla_executable=loaded_executable, pgle_profiler=None)
    loaded = ours.load()
    if assemble_outputs:
        loaded._unsafe_call = _AssembledCall(loaded.unsafe_call)
    params = original._params
    return stages.Compiled(loaded, params.const_args, original.args_info, original.out_tree,
                           original._no_kwargs, params.in_types, params.out_types)


def guarded_cpp_call(compiled, guard) -> Any:
    """JAX's C++ dispatcher for ``compiled`` whose cache misses ask ``guard`` first, or None.

    ``jax.stages.Compiled`` dispatches through a C++ ``PjitFunction`` (``MeshExecutable.
    create_cpp_call``): a call whose argument signature (tree, shapes, dtypes, weak types,
    shardings, committedness) it has seen runs without Python; any other call reaches its
    Python cache miss, which checks the arguments (shapes and dtypes; not weak types) and runs.
    This returns a second ``PjitFunction`` over the same cache miss with ``guard(*args,
    **kwargs)`` called first: ``guard`` raises to refuse a signature (the caller's own key
    differs), and a refused signature is never cached. ``optimize``'s wrapper uses it so that a
    settled signature costs no Python keying per call. None where the executable has no C++
    dispatch (host callbacks, unordered effects, assembled outputs) or this JAX lacks the pieces.
    """
    from jax._src import tree_util  # lazy: JAX internals (the note at ``import jax``)
    from jax._src.interpreters import pxla  # lazy: as above
    from jax._src.lib import _jax  # lazy: as above

    try:
        inner = compiled._executable.create_cpp_call(compiled._params)
        if inner is None:
            return None
        miss = inner._cache_miss
        keys = pxla.JitGlobalCppCacheKeys()
    except Exception as e:  # noqa: BLE001 - another JAX: the caller keys every call itself
        log.info("no guarded C++ dispatch (%s: %s)", type(e).__name__, e)
        return None

    def cache_miss(*args, **kwargs):
        guard(*args, **kwargs)
        return miss(*args, **kwargs)

    return _jax.pjit(getattr(inner, "__name__", "concerto_step"), None, cache_miss, [], [], keys,
                     tree_util.dispatch_registry, pxla.cc_shard_arg)


class _Assemble:
    """A result handler that gets an output's per-device arrays (``consume_with_handlers``
    passes a Python callable the list) and has JAX's C++ handler assemble the global array."""

    __slots__ = ("handler",)

    def __init__(self, handler):
        self.handler = handler

    def __call__(self, per_device_arrays):
        return self.handler(per_device_arrays)

    def pre_wrap(self, fn):  # ExecuteReplicated calls it under jax_debug_nans / _infs
        return _Assemble(self.handler.pre_wrap(fn))


class _AssembledCall:
    """The ``unsafe_call`` of a swapped ``MeshExecutable`` whose outputs are assembled.

    Deliberately not an ``ExecuteReplicated``: ``MeshExecutable.create_cpp_call`` then returns
    None, so JAX's C++ dispatch, which would wrap the runtime's per-device outputs as global
    arrays again, never serves this step.
    """

    __slots__ = ("inner", "__weakref__")

    def __init__(self, inner):
        # lazy: JAX internals (the note at ``import jax``)
        from jax._src.interpreters import pxla

        out = inner.out_handler
        inner.out_handler = pxla.ResultsHandler([_Assemble(h) for h in out.handlers],
                                                out.out_shardings, out.out_avals)
        self.inner = inner

    def __call__(self, *args):
        return self.inner(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# -- loading a serialized executable on JAX's client (GPU route; checked on 0.11.2, 0.12.0.1
# with CPU executables; the GPU client's side is gpu_check's) ----------------------------------

IFRT_RUNTIME_NAME = b"pjrt_ifrt"
"""``SerializedXlaExecutableMetadata.runtime_name`` (field 2) of the IFRT header JAX writes."""


def proto_fields(data: bytes) -> list[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of a serialized protobuf message (no nesting);
    raises ValueError on what is not one."""
    out, i = [], 0

    def varint(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value, i

    while i < len(data):
        key, i = varint(i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value, i = varint(i)
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        elif wire == 2:
            n, i = varint(i)
            value, i = data[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(data):
            raise ValueError("field runs past the end")
        out.append((number, wire, value))
    return out


def payload_device_count(data: bytes) -> int | None:
    """Replicas x partitions stored in a plain ``ExecutableAndOptionsProto`` (a CPU executable's
    bytes); None where the bytes are framed otherwise (the CUDA plugin's Riegeli file)."""
    try:
        fields = proto_fields(data)
        (opts,) = [v for k, w, v in fields if k == 2 and w == 2]
        (build,) = [v for k, w, v in proto_fields(opts) if k == 3 and w == 2]
        got = {k: v for k, w, v in proto_fields(build) if w == 0}
        return max(1, got.get(4, 1)) * max(1, got.get(5, 1))
    except (ValueError, TypeError):
        return None


def split_ifrt_blob(blob: bytes) -> tuple[bytes, bytes]:
    """``(header, PJRT payload)`` of a blob ``Client.deserialize_executable`` accepts.

    The header is a varint-delimited ``SerializedXlaExecutableMetadata`` whose
    ``runtime_name`` is ``pjrt_ifrt``. The runtime parses the header loosely (raw PJRT bytes
    can be half-read as one and fail deep inside), so the blob is checked here first.

    Raises:
      ValueError: the blob has no such header; says what was expected.
    """
    n = ifrt_header_length(blob)
    start = n - _header_body_length(blob)
    try:
        fields = proto_fields(blob[start:n])
    except ValueError as e:
        raise ValueError(f"not a serialized executable: its first {n} bytes are no IFRT header "
                         f"({e}); expected a varint-delimited SerializedXlaExecutableMetadata "
                         "followed by the PJRT executable's bytes (raw PJRT bytes must be put "
                         "behind a step's header: gpu_route.load_payload)") from None
    runtime = [v for k, w, v in fields if k == 2 and w == 2]
    if runtime != [IFRT_RUNTIME_NAME]:
        raise ValueError(f"not a serialized executable: its header names runtime {runtime[:1]!r}, "
                         f"expected {IFRT_RUNTIME_NAME!r} (raw PJRT bytes must be put behind a "
                         "step's header: gpu_route.load_payload)")
    return blob[:n], blob[n:]


def _header_body_length(blob: bytes) -> int:
    n = shift = i = 0
    while True:
        b = blob[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n


def step_header(original) -> bytes:
    """The IFRT header of a jaxlib ``LoadedExecutable`` (its serialization's first bytes)."""
    blob = original.client.serialize_executable(original)
    header, _ = split_ifrt_blob(blob)
    return header


def deserialize(blob: bytes, devices: Sequence, *, compile_options=None,
                host_callbacks: Sequence = ()):
    """``Client.deserialize_executable`` of a header + payload ``blob`` on ``devices``.

    The caller must have checked that the payload was compiled for ``len(devices)`` devices:
    the runtime aborts the process (a CHECK, not an exception) otherwise. ``compile_options``
    override the ones stored in the payload (device assignment: the step's devices);
    ``host_callbacks`` are the callables the module's host-callback custom calls index
    (a deserialized executable without them is undefined behaviour).
    """
    split_ifrt_blob(blob)
    client = devices[0].client
    kwargs: dict[str, Any] = {}
    if compile_options is not None:
        kwargs["compile_options"] = compile_options
    if host_callbacks:
        kwargs["host_callbacks"] = list(host_callbacks)
    return client.deserialize_executable(blob, device_list(devices), **kwargs)


def entry_layout(executable) -> str:
    """The ``entry_computation_layout`` of a jaxlib ``LoadedExecutable``'s (first) module:
    every parameter's and result's per-device shape with its layout."""
    header = executable.hlo_modules()[0].to_string().split("\n", 1)[0]
    return entry_layout_of_text(header)


def entry_layout_of_text(text: str) -> str:
    """The ``entry_computation_layout={...}`` of an HLO module's header line ('' if absent)."""
    header = text.split("\n", 1)[0]
    key = "entry_computation_layout={"
    at = header.find(key)
    if at < 0:
        return ""
    i, depth = at + len(key), 1
    while i < len(header) and depth:
        depth += {"{": 1, "}": -1}.get(header[i], 0)
        i += 1
    return header[at + len(key):i - 1]


def executable_text(executable) -> str:
    """HLO text of a jaxlib ``LoadedExecutable``'s (first) module: the final module it runs."""
    return executable.hlo_modules()[0].to_string()


def gpu_device_facts(device) -> dict[str, Any]:
    """What a JAX GPU device says about itself: ``device_kind``, ``compute_capability``
    (``"9.0"``), ``core_count`` (SMs; None where not exposed), ``id``, ``process_index``."""
    return {"device_kind": getattr(device, "device_kind", ""),
            "compute_capability": str(getattr(device, "compute_capability", "") or ""),
            "core_count": getattr(device, "core_count", None),
            "id": device.id, "process_index": getattr(device, "process_index", 0)}


def profile_data_from_file(path: str):
    """jaxlib's ``ProfileData`` of an ``.xplane.pb`` file (planes -> lines -> events with
    ``name``, ``start_ns``, ``duration_ns``, ``stats``)."""
    # lazy: JAX internals (the note at ``import jax``)
    from jax._src.lib import _profile_data

    return _profile_data.ProfileData.from_file(path)


# -- the plan cache's key (checked on 0.11.2, 0.12.0.1) -----------------------------------------

def lowering_facts(lowered) -> tuple[tuple | None, tuple]:
    """``(devices, compiler options)`` of a ``jax.stages.Lowered``: the device assignment its
    compile will use, in order (None where the lowering has none yet), and the options given to
    ``jax.jit(compiler_options=...)`` as ``(name, value)`` pairs."""
    lowering = lowered._lowering
    devices = getattr(lowering, "_device_list", None)
    return (tuple(devices) if devices is not None else None,
            tuple(getattr(lowering, "_compiler_options_kvs", ()) or ()))
