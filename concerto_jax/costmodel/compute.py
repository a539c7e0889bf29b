"""Time of a compute instruction on a GPU: FLOPs and bytes against peak rates, plus launch overhead.

Rules are a table keyed by opcode with a default rule (memory-bound kernel):

* free ops (parameter, constant, get-tuple-element, bitcast, tuple, ...) cost 0;
* dot / convolution: ``max(flops / (peak(dtype) * matmul_efficiency),
  bytes / (hbm * memory_efficiency)) + launch``;
* fusion: walks the fused computation -- FLOPs of the dots and convolutions
  inside on tensor cores, elementwise FLOPs on CUDA cores -- against the bytes
  read and written at the fusion boundary (a parameter read only through a
  slice counts the slice), roofline max plus one launch;
* while: body time x known trip count (``backend_config`` ``known_trip_count``);
* default: bytes read + written over HBM bandwidth, plus one launch.

The instruction is described by an ``OpInfo`` (built from ``hlo_passes`` IR by
``concerto_jax.hlo_taskgraph``), so the rules do not depend on the IR classes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Mapping

from concerto_jax.costmodel.specs import GpuSpec

log = logging.getLogger(__name__)

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
         "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8}

FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "get-dimension-size",
    "copy-done", "async-done", "async-update", "fusion-done", "fusion-update",
})
"""Opcodes that launch no kernel (aliasing or metadata only; the done of an async compute pair
waits for the kernel its start launched)."""

_ELEMENTWISE_FLOPS = {"exponential": 4, "log": 4, "tanh": 4, "logistic": 4, "rsqrt": 2, "sqrt": 2,
                      "divide": 2, "power": 8, "erf": 8, "sine": 4, "cosine": 4}
_NO_FLOPS = frozenset({"parameter", "constant", "broadcast", "reshape", "bitcast", "transpose",
                       "slice", "dynamic-slice", "concatenate", "copy", "tuple", "get-tuple-element",
                       "convert", "iota", "pad", "reverse", "gather", "dynamic-update-slice"})


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """An array (or tuple leaf list) as the cost model needs it."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return (self.elements * _BITS.get(self.dtype, 32) + 7) // 8


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One instruction as seen by the cost model.

    Attributes:
      name: instruction name.
      opcode: HLO opcode.
      result: leaves of the result shape.
      operands: leaves of each operand's shape (one tuple per operand).
      attrs: attribute text by name (``lhs_contracting_dims`` -> ``"{1}"``, ``backend_config`` -> JSON).
      called: instructions of called computations by attribute (``calls``, ``body``, ...),
        each an ``OpInfo`` in text order; operands of a fused instruction refer to
        other fused instructions by index in ``operand_ids``.
      operand_ids: for an instruction inside a called computation, the indices of
        its operands in that computation (used for the slice rule and signatures).
      parameter_number: for a ``parameter``, its number.
    """

    name: str
    opcode: str
    result: tuple[ArrayInfo, ...]
    operands: tuple[tuple[ArrayInfo, ...], ...] = ()
    attrs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    called: Mapping[str, tuple[OpInfo, ...]] = dataclasses.field(default_factory=dict)
    operand_ids: tuple[int, ...] = ()
    parameter_number: int = -1

    @property
    def result_bytes(self) -> int:
        return sum(a.bytes for a in self.result)

    @property
    def operand_bytes(self) -> int:
        return sum(a.bytes for leaves in self.operands for a in leaves)


@dataclasses.dataclass(frozen=True)
class ComputeOptions:
    """Efficiency factors and overheads of compute kernels.

    Attributes:
      matmul_efficiency: achieved fraction of tensor-core peak for dots and convolutions
        (configured, not measured; cuBLAS reaches ~0.6-0.8 of dense peak on large GEMMs).
      memory_efficiency: achieved fraction of HBM bandwidth (configured; ~0.8-0.9 for streaming kernels).
      launch_overhead_us: fixed cost per kernel (launch + tail; configured).
      highest_precision_f32_dots: run f32 dots on CUDA cores instead of TF32 tensor cores.
      reduction_efficiency: achieved fraction of HBM bandwidth of a reduction (an instruction
        or fusion with a ``reduce``: XLA's reduction emitter); None: ``memory_efficiency``.
      convolution_efficiency: achieved fraction of tensor-core peak of a convolution (cuDNN);
        None: ``matmul_efficiency``.
      step_overhead_us: time a step takes beyond its kernels that does not grow with their
        number (host dispatch, command-buffer and synchronisation gaps), added once per step
        (the entry computation's time, ``judge``); it moves no decision, only whole-step times
        and the ratios between them. 0 by default; fitted where a GPU type is calibrated.

    The defaults are configured figures; ``costmodel.calibration`` holds figures fitted to
    kernels measured on a GPU type, the defaults there.
    """

    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    launch_overhead_us: float = 2.0
    highest_precision_f32_dots: bool = False
    reduction_efficiency: float | None = None
    convolution_efficiency: float | None = None
    step_overhead_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class Work:
    """What a kernel does: tensor-core FLOPs (by dtype), CUDA-core FLOPs, HBM bytes."""

    matmul_flops: tuple[tuple[str, float], ...] = ()
    vector_flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        mm = dict(self.matmul_flops)
        for k, v in other.matmul_flops:
            mm[k] = mm.get(k, 0.0) + v
        return Work(tuple(sorted(mm.items())), self.vector_flops + other.vector_flops, self.bytes + other.bytes)


def _dims(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text or "")]


def _dot_flops(op: OpInfo) -> float:
    lhs = op.operands[0][0]
    contracting = _dims(op.attrs.get("lhs_contracting_dims"))
    if not contracting and "backend_config" in op.attrs:  # cuBLAS custom-call
        try:
            dnums = json.loads(op.attrs["backend_config"]).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            contracting = [int(x) for x in dnums.get("lhs_contracting_dimensions", [])]
        except (ValueError, AttributeError):
            contracting = []
    k = math.prod(lhs.dims[d] for d in contracting if d < len(lhs.dims))
    return 2.0 * op.result[0].elements * k


def _conv_flops(op: OpInfo) -> float:
    """2 x |y| x (|w| / out_features) for the forward triple (x, w, y) of a convolution.

    cuDNN custom-calls keep the forward ``dim_labels``: forward has y = result,
    w = operand 1; backward-input has y = operand 0 (dy), w = operand 1;
    backward-filter has y = operand 1 (dy), w = result (dw).
    """
    target = op.attrs.get("custom_call_target", "")
    if "BackwardInput" in target:
        y, w = op.operands[0][0], op.operands[1][0]
    elif "BackwardFilter" in target:
        y, w = op.operands[1][0], op.result[0]
    else:
        y, w = op.result[0], op.operands[1][0]
    labels = op.attrs.get("dim_labels", "")
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    out_feat = w.dims[kernel_labels.index("o")] if "o" in kernel_labels and len(w.dims) == len(kernel_labels) else 1
    return 2.0 * y.elements * w.elements / max(out_feat, 1)


def _operand_dtype(op: OpInfo) -> str:
    return op.operands[0][0].dtype if op.operands and op.operands[0] else op.result[0].dtype


def _dot_work(op: OpInfo) -> Work:
    return Work(((_operand_dtype(op), _dot_flops(op)),), 0.0, op.operand_bytes + op.result_bytes)


def _conv_work(op: OpInfo) -> Work:
    return Work(((_operand_dtype(op), _conv_flops(op)),), 0.0, op.operand_bytes + op.result_bytes)


def _fusion_work(op: OpInfo) -> Work:
    body = op.called.get("calls", ())
    inner = Work()
    users: dict[int, list[OpInfo]] = {}
    for ins in body:
        for j in ins.operand_ids:
            users.setdefault(j, []).append(ins)
        if ins.opcode in ("dot", "convolution"):
            inner = inner + Work(((_operand_dtype(ins), _dot_flops(ins) if ins.opcode == "dot" else _conv_flops(ins)),))
        elif ins.opcode in ("fusion", "while", "call"):
            inner = inner + dataclasses.replace(work_of(ins), bytes=0.0)
        elif ins.opcode not in _NO_FLOPS and ins.result:
            inner = inner + Work((), _ELEMENTWISE_FLOPS.get(ins.opcode, 1) * ins.result[0].elements)
    read = 0.0
    for idx, ins in enumerate(body):
        if ins.opcode != "parameter":
            continue
        us = users.get(idx, [])
        if us and all(u.opcode in ("slice", "dynamic-slice", "gather") for u in us):
            read += sum(u.result_bytes for u in us)
        elif us and all(u.opcode == "dynamic-update-slice" and u.operand_ids[:1] == (idx,) for u in us):
            read += 0.0  # updated in place: only the update is read and written
        else:
            read += ins.result_bytes
    written = op.result_bytes
    root = body[-1] if body else None
    if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
        written = sum(a.bytes for a in root.operands[1])
    return inner + Work((), 0.0, read + written)


def _while_work(op: OpInfo) -> Work:
    trips = 1
    try:
        trips = int(json.loads(op.attrs.get("backend_config", "{}")).get("known_trip_count", {}).get("n", 1))
    except (ValueError, AttributeError, TypeError):
        log.warning("while %s: no known trip count, costing one iteration", op.name)
    body = Work()
    for ins in op.called.get("body", ()):
        body = body + work_of(ins)
    return Work(tuple((k, v * trips) for k, v in body.matmul_flops), body.vector_flops * trips, body.bytes * trips)


def _memory_work(op: OpInfo) -> Work:
    return Work((), 0.0, op.operand_bytes + op.result_bytes)


def _custom_call_work(op: OpInfo) -> Work:
    target = op.attrs.get("custom_call_target", "")
    if "gemm" in target or "matmul" in target:
        return _dot_work(op)
    if "conv" in target:
        return _conv_work(op)
    return _memory_work(op)


WORK_RULES: dict[str, Callable[[OpInfo], Work]] = {
    "dot": _dot_work,
    "convolution": _conv_work,
    "fusion": _fusion_work,
    "while": _while_work,
    "custom-call": _custom_call_work,
    "call": lambda op: sum((work_of(i) for i in op.called.get("to_apply", ())), Work()),
}
"""Opcode -> what its kernel does; anything else is a memory-bound kernel (``_memory_work``)."""


def work_of(op: OpInfo) -> Work:
    """FLOPs and bytes of ``op`` (zero for free ops)."""
    if op.opcode in FREE_OPCODES:
        return Work()
    return WORK_RULES.get(op.opcode, _memory_work)(op)


def kernel_count(op: OpInfo) -> int:
    """Kernels launched by ``op`` (0 for free ops; a while launches its body's kernels per trip)."""
    if op.opcode in FREE_OPCODES:
        return 0
    if op.opcode == "while":
        try:
            trips = int(json.loads(op.attrs.get("backend_config", "{}")).get("known_trip_count", {}).get("n", 1))
        except (ValueError, AttributeError, TypeError):
            trips = 1
        return trips * sum(kernel_count(i) for i in op.called.get("body", ()))
    return 1


def work_time_us(work: Work, kernels: int, gpu: GpuSpec, options: ComputeOptions = ComputeOptions()) -> float:
    """Roofline time of ``work`` on ``gpu``: max(compute, memory) plus launch overhead per kernel."""
    compute_s = 0.0
    for dtype, flops in work.matmul_flops:
        if dtype == "f32" and options.highest_precision_f32_dots:
            rate = gpu.vector_flops_per_s("f32")
        else:
            rate = gpu.matmul_flops_per_s(dtype)
        compute_s += flops / (rate * options.matmul_efficiency)
    compute_s += work.vector_flops / gpu.vector_flops_per_s("f32")
    memory_s = work.bytes / (gpu.hbm_bytes_per_s * options.memory_efficiency)
    return 1e6 * max(compute_s, memory_s) + kernels * options.launch_overhead_us


def kernel_kind(op: OpInfo) -> str:
    """``"convolution"``, ``"reduction"`` or ``"other"``: the kernel classes with efficiencies of
    their own in ``ComputeOptions`` (a convolution: the opcode, a cuDNN call, a fusion with one;
    a reduction: a ``reduce``, or a fusion with one)."""
    if op.opcode == "convolution" or (op.opcode == "custom-call" and "conv" in op.attrs.get("custom_call_target", "")):
        return "convolution"
    if op.opcode == "reduce":
        return "reduction"
    if op.opcode == "fusion":
        body = {i.opcode for i in op.called.get("calls", ())}
        if "convolution" in body:
            return "convolution"
        if "reduce" in body:
            return "reduction"
    return "other"


def class_options(op: OpInfo, options: ComputeOptions) -> ComputeOptions:
    """``options`` as they apply to ``op``: a reduction's or a convolution's own efficiency in
    place of the general one, where ``options`` set them."""
    if options.reduction_efficiency is None and options.convolution_efficiency is None:
        return options
    kind = kernel_kind(op)
    if kind == "reduction" and options.reduction_efficiency is not None:
        return dataclasses.replace(options, memory_efficiency=options.reduction_efficiency)
    if kind == "convolution" and options.convolution_efficiency is not None:
        return dataclasses.replace(options, matmul_efficiency=options.convolution_efficiency)
    return options


def compute_time_us(op: OpInfo, gpu: GpuSpec, options: ComputeOptions = ComputeOptions()) -> float:
    """Modelled time of compute instruction ``op`` on ``gpu`` in microseconds."""
    n = kernel_count(op)
    if n == 0:
        return 0.0
    return work_time_us(work_of(op), n, gpu, class_options(op, options))
