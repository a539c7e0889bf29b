"""XLA:CPU's divide-by-broadcast rule applied before our module is compiled (the executor's twin of
XLA:CPU's first algebraic simplifier: the same arithmetic as the original step on CPU)."""

from __future__ import annotations

from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.module import HloModule
from hlo_passes.ir.shapes import Shape

__all__ = ["cpu_divide_by_broadcast", "cpu_widen_mixed_dots"]


_REAL_FLOATS = frozenset({"f16", "bf16", "f32", "f64", "f8e3m4", "f8e4m3", "f8e4m3fn",
                          "f8e4m3b11fnuz", "f8e4m3fnuz", "f8e5m2", "f8e5m2fnuz",
                          "f8e8m0fnu", "f4e2m1fn"})

_CPU_NORMALIZED = frozenset({"bf16", "f8e3m4", "f8e4m3", "f8e4m3fn", "f8e4m3b11fnuz", "f8e4m3fnuz",
                             "f8e5m2", "f8e5m2fnuz", "f8e8m0fnu", "f4e2m1fn"})
"""Types whose divides XLA:CPU's ``float-normalization`` widens to f32 (``CpuFloatSupport`` has no
bf16 or narrower divide) before its first ``algsimp``: there the rule fires on XLA's own f32
divide, in the jitted program and in our recompile alike, folded chains or not."""


def _add(comp, module, before, opcode, shape, operands, attrs=None, **kw):
    inst = Instruction(module.unique_name(opcode), opcode, shape, operands, dict(attrs or {}), **kw)
    return comp.add_instruction(inst, before=before)


def _is_pin_tuple(inst: Instruction) -> bool:
    """A tuple that feeds a window pin's opt-barrier (``hlo_passes.pin``)."""
    return inst.opcode == "tuple" and len(inst.users) == 1 and inst.users[0].opcode == "opt-barrier" \
        and inst.users[0].name.startswith("pin_")


def cpu_divide_by_broadcast(module: HloModule) -> int:
    """Rewrites ``A / broadcast(B)`` into ``A * broadcast(1 / B)`` where ``B`` has one use,
    as XLA:CPU's algebraic simplifier does, before the module is compiled through StableHLO.

    XLA:CPU's first ``algsimp`` applies this rewrite (``executing_on_cpu() &&
    enable_sink_broadcast()``, ``m::Broadcast(m::Op(&b).WithOneUse())``). The
    SPMD partitioner leaves chains like ``broadcast(reshape(broadcast(reshape(x))))``
    whose inner ops have one use, so it fires on the jitted program. Our module
    goes HLO -> StableHLO -> HLO, and the StableHLO -> HLO conversion on the compile
    path runs MLIR canonicalisation, which folds those chains to
    ``broadcast(x)``; ``x`` (a softmax sum, ...) has several users, the rewrite no
    longer fires and the results differ by an ulp or two (``a * (1/b)`` is not
    ``a / b``). Applying it here, where the chain is still intact, gives XLA the
    graph its simplifier would have produced. Where the folded operand would
    still have one use, XLA would have rewritten it anyway: same result.

    Like the simplifier, a broadcast whose operand has size-1 dimensions is first
    rewritten to broadcast a reshape without them (for all its users), and
    computations are visited in post order with use counts updated as they
    change. This emulates one rule of XLA's simplifier; it is only for the CPU
    backend (the rule is CPU-only in XLA).

    Divides of bf16 and narrower types are left alone (``_CPU_NORMALIZED``): XLA:CPU normalises
    them to f32 first, so in the jitted program the reciprocal is computed and used in f32;
    rewritten here it would be a bf16 divide, which XLA widens and rounds back to bf16, one
    rounding of ``1/B`` the original does not have (a Hugging Face GPT-2 and a MaxText bf16
    step differed by up to 1.6e-3 that way).

    Returns:
      The number of divides rewritten.
    """
    changed = 0
    for comp in module.computations:
        for inst in comp.post_order():
            if inst.opcode != "divide" or inst.parent is not comp or inst.shape.dtype not in _REAL_FLOATS \
                    or inst.shape.dtype in _CPU_NORMALIZED:
                continue
            a, bcast = inst.operands
            if bcast.opcode != "broadcast":
                continue
            b = bcast.operands[0]
            # Constant divisors are XLA's "A / Const" rule, which sees through the folding.
            # Window pins (hlo_passes.pin) are not uses XLA's jitted program had.
            uses = [u for u in b.users if not _is_pin_tuple(u)]
            if b.opcode == "constant" or uses != [bcast] or b is comp.root:
                continue
            meta = {"metadata": inst.attrs["metadata"]} if "metadata" in inst.attrs else {}
            kept = [i for i, d in enumerate(b.shape.dims) if d != 1]
            if len(kept) < len(b.shape.dims):
                dims = bcast.dimensions
                b = _add(comp, module, bcast, "reshape",
                         Shape.array(b.shape.dtype, [b.shape.dims[i] for i in kept]), [b], meta)
                new_bcast = Instruction(module.unique_name("broadcast"), "broadcast",
                                        bcast.shape, [b], dict(meta))
                new_bcast.dimensions = [dims[i] for i in kept]
                comp.replace_instruction(bcast, new_bcast)
                bcast = new_bcast
            one = _add(comp, module, inst, "constant", Shape.array(b.shape.dtype, ()), [],
                       literal="1")
            ones = _add(comp, module, inst, "broadcast", b.shape, [one])
            ones.dimensions = []
            recip = _add(comp, module, inst, "divide", b.shape, [ones, b], meta)
            recip_bcast = _add(comp, module, inst, "broadcast", inst.shape, [recip], meta)
            recip_bcast.dimensions = bcast.dimensions
            comp.replace_instruction(inst, Instruction(
                module.unique_name("multiply"), "multiply", inst.shape, [a, recip_bcast],
                dict(meta)))
            changed += 1
    return changed


_HALF = frozenset({"bf16", "f16"})


def cpu_widen_mixed_dots(module: HloModule) -> int:
    """Converts the half-precision operands of every ``f32 dot(bf16, bf16)`` to f32.

    A dot whose half-precision operands accumulate into an f32 result (decompose's partial
    chunks of a bf16 GEMM: ``hlo_passes.decompose.rewrite._partial_shape``) is what a GPU GEMM
    computes, but XLA:CPU's runtime refuses some of them (a batched dot whose batch dims are
    not leading: "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"; JAX's
    own executable fails on such a dot too, so an original step never holds one). Widening a
    bf16 or f16 value to f32 is exact, so ``dot(convert(a), convert(b))`` in f32 multiplies the
    same values and accumulates in f32, as the GPU's GEMM does; on the dots XLA:CPU does run,
    the widened ones gave the same bits (an attention-style and a plain matmul). CPU only: on a
    GPU the half-precision GEMM stays.

    Returns:
      The number of dots rewritten.
    """
    changed = 0
    for comp in module.computations:
        for inst in list(comp.instructions):
            if (inst.opcode != "dot" or not inst.shape.is_array or inst.shape.dtype != "f32"
                    or not any(o.shape.dtype in _HALF for o in inst.operands)):
                continue
            for i, o in enumerate(list(inst.operands)):
                if o.shape.dtype in _HALF:
                    inst.replace_operand(i, _add(comp, module, inst, "convert",
                                                 Shape(inst.shape.dtype, list(o.shape.dims), o.shape.layout), [o]))
            changed += 1
    return changed
