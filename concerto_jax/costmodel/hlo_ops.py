"""The cost model's view of IR instructions: ``op_info`` (an instruction as ``OpInfo``, its called
computations included), ``array_leaves``, and ``is_kernel`` (whether the task graph makes an
instruction a compute task that launches a kernel)."""

from __future__ import annotations

import dataclasses

from concerto_jax.costmodel.compute import FREE_OPCODES, ArrayInfo, OpInfo
from hlo_passes.ir import ALIAS_OPCODES

CONTROL_FLOW_OPCODES = frozenset({"while", "conditional", "call"})
"""Instructions whose work is their called computations' (the task graph costs those)."""


def is_kernel(inst) -> bool:
    """Whether ``build_taskgraph`` makes ``inst`` a compute task that launches a kernel."""
    return not (inst.opcode in ALIAS_OPCODES or inst.opcode in FREE_OPCODES
                or inst.opcode in CONTROL_FLOW_OPCODES or inst.collective_kind is not None)


def array_leaves(shape) -> tuple[ArrayInfo, ...]:
    """The arrays of a shape (a tuple's leaves, in order; tokens and opaque values left out)."""
    if shape.is_tuple:
        return tuple(a for e in shape.elements for a in array_leaves(e))
    if shape.dtype in ("token", "opaque"):
        return ()
    return (ArrayInfo(shape.dtype, tuple(max(d, 0) for d in shape.dims)),)


def op_info(inst, _cache: dict | None = None) -> OpInfo:
    """The cost model's view (``OpInfo``) of an ``hlo_passes`` instruction, called computations included.

    The start of an async compute pair (XLA >= 0.11 wraps e.g. the dynamic-slice fusions of a
    loop body: ``async-start(...), calls=%async_computation`` before its post-scheduling
    pipelines, ``fusion-start(...), kind=kLoop, calls=%fused_...`` after them) is seen as
    the kernel it launches: its wrapped op (named as the start), its result the wrapped op's
    (element 1 of the start's tuple; element 0 holds the operands, the last the context).
    Its done launches nothing (``costmodel.compute.FREE_OPCODES``).
    """
    cache = {} if _cache is None else _cache
    wrapped = _async_compute_op(inst)
    if wrapped is not None:
        return dataclasses.replace(op_info(wrapped, cache), name=inst.name)
    if inst.opcode == "fusion-start" and inst.shape.is_tuple and len(inst.shape.elements) >= 2:
        info = _op_info(inst, cache)
        return dataclasses.replace(info, opcode="fusion", result=array_leaves(inst.shape.elements[1]))
    return _op_info(inst, cache)


class OpInfoCache:
    """``op_info`` of the instructions of one parsed module, kept for several builds of its task
    graphs (one per cost model: ``judge.envelope``). Keyed by object identity: keep the module
    alive as long as the cache (store them together)."""

    def __init__(self):
        self.computations: dict = {}
        self.instructions: dict[int, OpInfo] = {}

    def info(self, inst) -> OpInfo:
        found = self.instructions.get(id(inst))
        if found is None:
            found = self.instructions[id(inst)] = op_info(inst, self.computations)
        return found


def _async_compute_op(inst):
    """The op the generic ``async-start`` of a non-collective async pair runs, or None."""
    if inst.opcode != "async-start" or inst.collective_kind is not None:
        return None
    wrapped = inst.async_wrapped
    return None if wrapped is None or wrapped is inst else wrapped


def _op_info(inst, cache: dict) -> OpInfo:
    called: dict[str, tuple[OpInfo, ...]] = {}
    for key, value in inst.attrs.items():
        comps = value if isinstance(value, list) else [value]
        if comps and all(hasattr(c, "instructions") for c in comps):
            called[key] = tuple(o for c in comps for o in _computation_infos(c, cache))
    attrs = {k: v for k, v in inst.attrs.items() if isinstance(v, str)}
    if inst.custom_call_target is not None:
        attrs["custom_call_target"] = inst.custom_call_target
    return OpInfo(
        name=inst.name, opcode=inst.opcode, result=array_leaves(inst.shape),
        operands=tuple(array_leaves(o.shape) for o in inst.operands), attrs=attrs, called=called,
        parameter_number=-1 if inst.parameter_number is None else inst.parameter_number,
    )


def _computation_infos(comp, cache: dict) -> tuple[OpInfo, ...]:
    if comp.name in cache:
        return cache[comp.name]
    index = {inst.name: i for i, inst in enumerate(comp.instructions)}
    out = []
    for inst in comp.instructions:
        info = op_info(inst, cache)
        out.append(dataclasses.replace(info, operand_ids=tuple(index[o.name] for o in inst.operands)))
    cache[comp.name] = tuple(out)
    return cache[comp.name]
