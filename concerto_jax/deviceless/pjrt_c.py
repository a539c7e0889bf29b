"""A minimal ctypes driver of the CUDA plugin's PJRT C API: compile an HLO module for a
deviceless target, backend only.

Why: jaxlib's Python compile entry points take MLIR only, and XLA re-runs its whole HLO
pipeline (fusion, combiners, its latency hiding scheduler) on whatever they receive. The
PJRT C API takes programs in ``"hlo"`` format (a serialized ``HloModuleProto``) and honours
``ExecutableBuildOptionsProto.run_backend_only`` (field 11): XLA then skips
``RunHloPasses`` and runs only ``RunBackend``. The GPU compiler's scheduling step leaves a
module that already carries a schedule as it is ("Module already has a schedule, do
nothing"), so a scheduled module keeps its order (checked: ``tests/test_pjrt_c.py``,
docs/DECISIONS.md D10).

What is used of the C API (``xla/pjrt/c/pjrt_c_api.h``; the plugin of jaxlib 0.10.2
reports API version 0.112; the ``PJRT_Api`` table and the argument structs are
append-only, so the offsets below, taken from the header's older prefix, hold):
``PJRT_Error_{Destroy,Message,GetCode}``, ``PJRT_Plugin_Initialize``,
``PJRT_TopologyDescription_{Create,Destroy}``, ``PJRT_Compile``,
``PJRT_Executable_{Destroy,OptimizedProgram,Serialize}`` (the plugins of jaxlib 0.11.2 and
0.12.0.1 report API 0.115 and 0.116; the indices hold). Every argument struct is passed with the
``struct_size`` of the fields we declare (the plugin accepts older, smaller callers).

The topology is created as ``jax.experimental.topologies.get_topology_desc`` does it:
``PJRT_TopologyDescription_Create`` with the string options ``topology``
(``"slices x hosts x devices"``) and ``target_config`` (a ``GpuTargetConfigProto`` text).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import threading

from concerto_jax import jax_compat
from concerto_jax.deviceless import compile as deviceless_compile
from concerto_jax.deviceless import cuda_plugin

log = logging.getLogger(__name__)

# Index of each function pointer in PJRT_Api after its header (struct_size, extension_start,
# PJRT_Api_Version of 24 bytes): pjrt_c_api.h, the fields' declaration order.
_FN_INDEX = {
    "PJRT_Error_Destroy": 0,
    "PJRT_Error_Message": 1,
    "PJRT_Error_GetCode": 2,
    "PJRT_Plugin_Initialize": 3,
    "PJRT_Executable_Destroy": 40,
    "PJRT_Executable_OptimizedProgram": 48,
    "PJRT_Executable_Serialize": 49,
    "PJRT_TopologyDescription_Create": 82,
    "PJRT_TopologyDescription_Destroy": 83,
    "PJRT_TopologyDescription_PlatformName": 84,
    "PJRT_Compile": 89,
}
_API_HEADER_BYTES = 8 + 8 + 24
# ExecutableBuildOptionsProto.run_backend_only = 11 inside CompileOptionsProto.executable_build_options = 3
# (xla/pjrt/proto/compile_options.proto): appended on the wire, protobuf merges it into the message.
_RUN_BACKEND_ONLY = bytes([(3 << 3) | 2, 2, (11 << 3) | 0, 1])

_NAMED_STRING = 0


class PjrtCError(RuntimeError):
    """A PJRT C API call failed; the message is the plugin's ``PJRT_Error`` message."""

    def __init__(self, function: str, code: int, message: str):
        super().__init__(f"{function} failed (code {code}): {message}")
        self.function = function
        self.code = code
        self.message = message


def _struct(name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": [("struct_size", ctypes.c_size_t),
                                                         ("extension_start", ctypes.c_void_p)] + fields})


_ErrorDestroyArgs = _struct("PJRT_Error_Destroy_Args", [("error", ctypes.c_void_p)])
_ErrorMessageArgs = _struct("PJRT_Error_Message_Args", [
    ("error", ctypes.c_void_p), ("message", ctypes.c_void_p), ("message_size", ctypes.c_size_t)])
_ErrorGetCodeArgs = _struct("PJRT_Error_GetCode_Args", [("error", ctypes.c_void_p), ("code", ctypes.c_int)])
_PluginInitializeArgs = _struct("PJRT_Plugin_Initialize_Args", [])


class _NamedValueUnion(ctypes.Union):
    _fields_ = [("string_value", ctypes.c_char_p), ("int64_value", ctypes.c_int64)]


_NamedValue = _struct("PJRT_NamedValue", [
    ("name", ctypes.c_char_p), ("name_size", ctypes.c_size_t), ("type", ctypes.c_int),
    ("value", _NamedValueUnion), ("value_size", ctypes.c_size_t)])
_TopologyCreateArgs = _struct("PJRT_TopologyDescription_Create_Args", [
    ("topology_name", ctypes.c_char_p), ("topology_name_size", ctypes.c_size_t),
    ("create_options", ctypes.POINTER(_NamedValue)), ("num_options", ctypes.c_size_t),
    ("topology", ctypes.c_void_p)])
_TopologyDestroyArgs = _struct("PJRT_TopologyDescription_Destroy_Args", [("topology", ctypes.c_void_p)])
_TopologyPlatformNameArgs = _struct("PJRT_TopologyDescription_PlatformName_Args", [
    ("topology", ctypes.c_void_p), ("platform_name", ctypes.c_void_p), ("platform_name_size", ctypes.c_size_t)])
_Program = _struct("PJRT_Program", [
    ("code", ctypes.c_void_p), ("code_size", ctypes.c_size_t),
    ("format", ctypes.c_void_p), ("format_size", ctypes.c_size_t)])
_CompileArgs = _struct("PJRT_Compile_Args", [
    ("topology", ctypes.c_void_p), ("program", ctypes.POINTER(_Program)),
    ("compile_options", ctypes.c_char_p), ("compile_options_size", ctypes.c_size_t),
    ("client", ctypes.c_void_p), ("executable", ctypes.c_void_p)])
_ExecutableDestroyArgs = _struct("PJRT_Executable_Destroy_Args", [("executable", ctypes.c_void_p)])
_OptimizedProgramArgs = _struct("PJRT_Executable_OptimizedProgram_Args", [
    ("executable", ctypes.c_void_p), ("program", ctypes.POINTER(_Program))])
_SerializeArgs = _struct("PJRT_Executable_Serialize_Args", [
    ("executable", ctypes.c_void_p), ("serialized_bytes", ctypes.c_void_p),
    ("serialized_bytes_size", ctypes.c_size_t), ("serialized_executable", ctypes.c_void_p),
    ("serialized_executable_deleter", ctypes.c_void_p)])
_SerializedDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

RIEGELI_SIGNATURE = bytes.fromhex("83af70d10d884a3f")
"""The first 8 bytes of a Riegeli file: how the CUDA plugin frames ``PJRT_Executable_Serialize``'s
``ExecutableAndOptionsProto`` (jaxlib 0.11.2, 0.12.0.1)."""


def _new(cls, **kw):
    obj = cls(**kw)
    obj.struct_size = ctypes.sizeof(cls)
    return obj


def plugin_path() -> str:
    """The CUDA plugin's shared library (``xla_cuda_plugin.so``) that JAX registered.

    Raises:
      GpuPluginMissingError: the plugin is not installed.
    """
    deviceless_compile.require_gpu_plugin()
    mod = importlib.import_module(cuda_plugin.PLUGIN_MODULE)
    path = os.path.join(os.path.dirname(mod.__file__), "xla_cuda_plugin.so")
    if not os.path.exists(path):
        raise deviceless_compile.GpuPluginMissingError(f"the CUDA plugin module has no xla_cuda_plugin.so at {path}")
    return path


class PjrtCApi:
    """The plugin's ``PJRT_Api`` table, with the few calls this project needs.

    One instance per process (``api()``); the plugin is the very library JAX loaded (same
    path, so the same ``dlopen`` handle).
    """

    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        self._lib.GetPjrtApi.restype = ctypes.c_void_p
        self._api = self._lib.GetPjrtApi()
        if not self._api:
            raise PjrtCError("GetPjrtApi", -1, "returned NULL")
        size = ctypes.c_size_t.from_address(self._api).value
        self.version = (ctypes.c_int.from_address(self._api + 32).value,
                        ctypes.c_int.from_address(self._api + 36).value)
        need = _API_HEADER_BYTES + 8 * (max(_FN_INDEX.values()) + 1)
        if self.version[0] != 0 or size < need:
            raise PjrtCError("GetPjrtApi", -1, f"unsupported PJRT C API {self.version} (table of {size} "
                             f"bytes; need major 0 and {need} bytes)")
        proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
        self._fns = {}
        for name, i in _FN_INDEX.items():
            addr = ctypes.c_void_p.from_address(self._api + _API_HEADER_BYTES + 8 * i).value
            if not addr:
                raise PjrtCError(name, -1, "not provided by the plugin")
            self._fns[name] = proto(addr)
        self._check("PJRT_Plugin_Initialize", _new(_PluginInitializeArgs))
        log.debug("PJRT C API %d.%d from %s", *self.version, path)

    def _call(self, name: str, args) -> int | None:
        return self._fns[name](ctypes.addressof(args))

    def _check(self, name: str, args) -> None:
        err = self._call(name, args)
        if err:
            raise self._error(name, err)

    def _error(self, name: str, err: int) -> PjrtCError:
        msg = _new(_ErrorMessageArgs, error=err)
        self._call("PJRT_Error_Message", msg)
        text = ctypes.string_at(msg.message, msg.message_size).decode("utf-8", "replace") if msg.message else ""
        code = _new(_ErrorGetCodeArgs, error=err)
        code_val = -1 if self._call("PJRT_Error_GetCode", code) else int(code.code)
        self._call("PJRT_Error_Destroy", _new(_ErrorDestroyArgs, error=err))
        return PjrtCError(name, code_val, text)

    # -- topology ---------------------------------------------------------------------------
    def create_topology(self, topology_name: str, options: dict[str, str]) -> int:
        """``PJRT_TopologyDescription_Create`` with string options; returns the handle (free it
        with ``destroy_topology``)."""
        keep = []
        values = (_NamedValue * max(1, len(options)))()
        for slot, (k, v) in zip(values, options.items(), strict=False):
            kb, vb = k.encode(), v.encode()
            keep += [kb, vb]
            slot.struct_size = ctypes.sizeof(_NamedValue)
            slot.name, slot.name_size, slot.type = kb, len(kb), _NAMED_STRING
            slot.value.string_value, slot.value_size = vb, len(vb)
        name = topology_name.encode()
        args = _new(_TopologyCreateArgs, topology_name=name, topology_name_size=len(name),
                    create_options=values, num_options=len(options))
        self._check("PJRT_TopologyDescription_Create", args)
        return args.topology

    def destroy_topology(self, topology: int) -> None:
        self._check("PJRT_TopologyDescription_Destroy", _new(_TopologyDestroyArgs, topology=topology))

    def topology_platform(self, topology: int) -> str:
        args = _new(_TopologyPlatformNameArgs, topology=topology)
        self._check("PJRT_TopologyDescription_PlatformName", args)
        return ctypes.string_at(args.platform_name, args.platform_name_size).decode()

    # -- compile ----------------------------------------------------------------------------
    def compile(self, topology: int, program: bytes, fmt: str, compile_options: bytes) -> int:
        """``PJRT_Compile`` (deviceless); returns the ``PJRT_Executable`` (free it with
        ``destroy_executable``)."""
        code = ctypes.create_string_buffer(program, len(program))
        fmtb = fmt.encode()
        prog = _new(_Program, code=ctypes.addressof(code), code_size=len(program),
                    format=ctypes.cast(ctypes.c_char_p(fmtb), ctypes.c_void_p), format_size=len(fmtb))
        args = _new(_CompileArgs, topology=topology, program=ctypes.pointer(prog),
                    compile_options=compile_options, compile_options_size=len(compile_options),
                    client=None)
        self._check("PJRT_Compile", args)
        return args.executable

    def destroy_executable(self, executable: int) -> None:
        self._check("PJRT_Executable_Destroy", _new(_ExecutableDestroyArgs, executable=executable))

    def optimized_program(self, executable: int) -> bytes:
        """``PJRT_Executable_OptimizedProgram``: the compiled module (serialized ``HloModuleProto``)."""
        fmt = b"hlo"
        prog = _new(_Program, code=None, code_size=0,
                    format=ctypes.cast(ctypes.c_char_p(fmt), ctypes.c_void_p), format_size=len(fmt))
        args = _new(_OptimizedProgramArgs, executable=executable, program=ctypes.pointer(prog))
        self._check("PJRT_Executable_OptimizedProgram", args)
        out_fmt = ctypes.string_at(prog.format, prog.format_size).decode() if prog.format else "?"
        log.debug("optimized program: format %r, %d bytes", out_fmt, prog.code_size)
        buf = ctypes.create_string_buffer(prog.code_size)
        prog.code = ctypes.addressof(buf)
        self._check("PJRT_Executable_OptimizedProgram", args)
        data = buf.raw[:prog.code_size]
        if out_fmt == "hlo_with_config":  # HloModuleProtoWithConfig: hlo_module = 1, config = 2
            data = _proto_field(data, 1)
        elif out_fmt != "hlo":
            raise PjrtCError("PJRT_Executable_OptimizedProgram", -1, f"unexpected program format {out_fmt!r}")
        return data

    def serialize(self, executable: int) -> bytes:
        """``PJRT_Executable_Serialize``: the executable's bytes as the plugin's
        ``DeserializeAndLoad`` reads them (no IFRT header; the plugin's buffer is released
        through the deleter it returns, once)."""
        args = _new(_SerializeArgs, executable=executable)
        self._check("PJRT_Executable_Serialize", args)
        try:
            if not args.serialized_bytes or not args.serialized_bytes_size:
                raise PjrtCError("PJRT_Executable_Serialize", -1, "the plugin returned no bytes")
            return ctypes.string_at(args.serialized_bytes, args.serialized_bytes_size)
        finally:
            if args.serialized_executable_deleter:
                _SerializedDeleter(args.serialized_executable_deleter)(args.serialized_executable)


def _proto_field(data: bytes, number: int) -> bytes:
    """The bytes of length-delimited field ``number`` of a serialized message (the last one)."""
    found = [v for k, wire, v in jax_compat.proto_fields(data) if k == number and wire == 2]
    if not found:
        raise ValueError(f"field {number} not in the message")
    return found[-1]


_API_LOCK = threading.Lock()


@functools.cache
def _api_for(path: str) -> PjrtCApi:
    return PjrtCApi(path)


def api() -> PjrtCApi:
    """The process's ``PjrtCApi`` of the registered CUDA plugin."""
    path = plugin_path()
    with _API_LOCK:
        return _api_for(path)


class Topology:
    """A deviceless ``PJRT_TopologyDescription`` of a ``Cluster`` (context manager: destroyed on exit)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.api = api()
        self.handle = self.api.create_topology(cluster.topology_name, {
            "topology": cluster.topology, "target_config": cluster.target_config_text()})

    def close(self) -> None:
        if self.handle:
            self.api.destroy_topology(self.handle)
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def hlo_text_to_proto(text: str) -> bytes:
    """Serialized ``HloModuleProto`` of HLO text (XLA's parser; the schedule of an
    ``is_scheduled=true`` module is kept)."""
    return jax_compat.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def hlo_proto_to_text(proto: bytes) -> str:
    """HLO text of a serialized ``HloModuleProto``."""
    return jax_compat.hlo_module_from_proto(proto).to_string()


def spmd_compile_options(num_partitions: int, compiler_options: dict | None = None,
                         *, num_replicas: int = 1, device_ids=None) -> bytes:
    """Serialized ``CompileOptions`` of a post-SPMD per-device module of ``num_partitions``
    partitions (what JAX's jit asks for; device assignment ``device_ids``, default 0..n-1),
    with ``compiler_options`` as XLA environment overrides (``xla_dump_to``, ...)."""
    grid = range(num_replicas * num_partitions) if device_ids is None else device_ids
    return jax_compat.compile_options(list(grid), num_replicas=num_replicas, num_partitions=num_partitions,
                                      spmd=num_partitions > 1, env=compiler_options).SerializeAsString()


def compile_hlo(text: str, cluster, compile_options: bytes, *, backend_only: bool = True) -> str:
    """Compile an HLO-text module for ``cluster`` (deviceless) and return XLA's final module text.

    Args:
      text: HLO text; with ``backend_only`` it should be an optimised, scheduled module
        (``is_scheduled=true``): XLA runs only its backend and keeps the given order.
      cluster: the target ``Cluster``.
      compile_options: serialized ``CompileOptions`` (``spmd_compile_options``, or JAX's).
      backend_only: set ``run_backend_only`` (skip XLA's HLO optimisation pipeline).

    Raises:
      PjrtCError: the plugin refused the module (its message included).
      GpuPluginMissingError: the CUDA plugin is not installed.
    """
    proto = hlo_text_to_proto(text)
    opts = compile_options + (_RUN_BACKEND_ONLY if backend_only else b"")
    with Topology(cluster) as topo:
        exe = topo.api.compile(topo.handle, proto, "hlo", opts)
        try:
            out = topo.api.optimized_program(exe)
        finally:
            topo.api.destroy_executable(exe)
    return hlo_proto_to_text(out)


def compile_and_serialize(text: str, topology_source, compile_options: bytes, *,
                          backend_only: bool = True) -> tuple[str, bytes]:
    """``compile_hlo`` that also serializes the executable (``PJRT_Executable_Serialize``).

    Args:
      text: HLO text (a scheduled module with ``backend_only``).
      topology_source: anything with ``topology_name``, ``topology`` and ``target_config_text()``
        (a ``Cluster``, or the real devices' ``gpu_route.DeviceTarget``).
      compile_options: serialized ``CompileOptions``.
      backend_only: set ``run_backend_only``.

    Returns:
      ``(XLA's final module text, the executable's bytes)``.

    Raises:
      PjrtCError: the plugin refused the module or could not serialize it.
    """
    proto = hlo_text_to_proto(text)
    opts = compile_options + (_RUN_BACKEND_ONLY if backend_only else b"")
    with Topology(topology_source) as topo:
        exe = topo.api.compile(topo.handle, proto, "hlo", opts)
        try:
            out = topo.api.optimized_program(exe)
            blob = topo.api.serialize(exe)
        finally:
            topo.api.destroy_executable(exe)
    return hlo_proto_to_text(out), blob
