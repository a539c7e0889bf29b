"""Cost of a decomposition strategy (degree N of one context), Concerto's formula plus measured terms.

For a collective of time ``T_C`` split into N chunks (each chunk's time
``T_c`` from the cost model, so ``N * T_c >= T_C`` counts the per-message
latency), with pre-context compute ``T_pre`` and post-context ``T_post``
and overlapped compute slowed by ``a``:

    cost1 = N*T_c - (N-1)(T_pre+T_post)/(a*N)     chunks hidden by both sides
    cost2 = T_c   - (N-1) T_pre/(a*N)             the last chunk, after all pre work
    cost3 = T_c   - (N-1) T_post/(a*N)            the first chunk, before any post work
    exposed_after = max(0, max(cost1, cost2, cost3, 0) - slack) + overhead

(the paper multiplies by ``a`` with ``a = 1.2`` hard-coded; a slowdown of
``a`` lets ``1/a`` of the compute's duration cover communication, the
simulator's semantics). ``overhead`` is what the split adds to the compute
stream: the chunks' cost-model time minus the originals', the slices and
concatenations, and the *measured* per-chunk overhead ratio
(``Calibration.chunk_overhead``: extra time per extra chunk relative to the
whole op, from the micro-benchmark ``python -m bench.cli decompose-calibrate``).
The gain is the collective's exposed time before minus after.

References: Concerto (ASPLOS'25) §5.2, Eq. (1)-(3).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from concerto_jax.costmodel.compute import ArrayInfo
from concerto_jax.costmodel.hlo_ops import op_info
from concerto_jax.simulator import DEFAULT_OVERLAP_SLOWDOWN

log = logging.getLogger(__name__)

CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), "calibration.json")
"""Measured slowdown / overhead written by ``bench.decompose_bench calibrate``."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured figures the cost uses (see ``docs/DECISIONS.md`` D29).

    Attributes:
      overlap_slowdown: compute time while a collective runs / alone (>= 1).
      chunk_overhead: extra time per extra chunk of a split op, relative to the
        unsplit op (``(t_N - t_1) / ((N - 1) t_1)``, minimum over repeats).
      source: where the figures come from (machine, command, date), or
        ``"default"`` when no measurement file exists.
      platform: where they were measured (``"cpu"``, ``"gpu"``); the pass takes the
        overlap slowdown only from a measurement on the target's platform.
    """

    overlap_slowdown: float
    chunk_overhead: float
    source: str
    platform: str = "cpu"

    @classmethod
    def load(cls, path: str = CALIBRATION_FILE) -> Calibration:
        """The measured calibration, or the simulator's configured slowdown and no extra
        overhead (with ``source="default"``) when ``path`` does not exist."""
        if not os.path.exists(path):
            return cls(DEFAULT_OVERLAP_SLOWDOWN, 0.0, "default")
        with open(path) as f:
            data = json.load(f)
        return cls(float(data["overlap_slowdown"]), float(data["chunk_overhead"]),
                   str(data.get("source", path)), str(data.get("platform", "cpu")))


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """Predicted effect of splitting one context N ways."""

    n: int
    t_c_us: float
    t_chunk_us: float
    pre_us: float
    post_us: float
    overhead_us: float
    exposed_before_us: float
    exposed_after_us: float

    @property
    def gain_us(self) -> float:
        return self.exposed_before_us - self.exposed_after_us


def _chunk_info(inst, plan, n):
    info = op_info(inst)
    res = info.result[0]
    dims = list(res.dims)
    dims[plan.out_dim] //= n
    operands = []
    for leaves, d in zip(info.operands, plan.operand_dims, strict=True):
        if d is None or not leaves:
            operands.append(leaves)
            continue
        od = list(leaves[0].dims)
        od[d] //= n
        operands.append((ArrayInfo(leaves[0].dtype, tuple(od)),) + tuple(leaves[1:]))
    return dataclasses.replace(info, result=(ArrayInfo(res.dtype, tuple(dims)),),
                               operands=tuple(operands))


def payload_bytes(coll) -> int:
    """Bytes a synchronous collective moves per device: its operands, an all-gather's result."""
    if coll.opcode == "all-gather":
        return coll.shape.byte_size
    return sum(o.shape.byte_size for o in coll.operands)


def _copy_info(inst, opcode: str):
    """A memory-bound op moving ``inst``'s result once (a slice or concatenate of it)."""
    info = op_info(inst)
    return dataclasses.replace(info, opcode=opcode, operands=(info.result,), attrs={}, called={})


def strategy_cost(ctx, n: int, cost_model, exposed_before_us: float, t_c_us: float,
                  calibration: Calibration, groups, fused=None,
                  copies: float = 1.0) -> StrategyCost:
    """Predicted exposed time of the collective when ``ctx`` is split ``n`` ways.

    Args:
      ctx: a ``Context`` divisible by ``n``.
      n: the degree.
      cost_model: the target's ``CostModel``.
      exposed_before_us: the collective's exposed time without the split.
      t_c_us: the collective's time.
      calibration: measured slowdown and per-chunk overhead.
      groups: the collective's replica groups (for the chunk's time).
      fused: a ``costmodel.fused.FusedCosts`` of the module, or None. With it an op costs
        its fused share and a chunk ``ratio(op)`` x its unfused estimate (the judge's
        figures); slices and concatenations keep their unfused estimate.
      copies: factor on the slices' and concatenations' estimate (0: XLA fuses them).
    """
    coll = ctx.collective
    t_chunk = cost_model.collective(coll.opcode, payload_bytes(coll) / n, groups).time_us
    overhead = 0.0
    for inst, plan in ctx.plans.items():
        if inst is coll:
            continue
        whole = cost_model.compute_us(op_info(inst))
        chunk = cost_model.compute_us(_chunk_info(inst, plan, n))
        if fused is not None:
            whole, chunk = fused.us.get(inst.name, whole), fused.ratio(inst.name) * chunk
        overhead += n * chunk - whole + calibration.chunk_overhead * (n - 1) * whole
        for op, d in zip(inst.operands, plan.operand_dims, strict=True):
            if d is not None and op not in ctx.plans:
                overhead += copies * cost_model.compute_us(_copy_info(op, "slice"))
        if any(u not in ctx.plans for u in inst.users) and not plan.replicable:
            overhead += copies * cost_model.compute_us(_copy_info(inst, "concatenate"))
    if any(u not in ctx.plans for u in coll.users):
        overhead += copies * cost_model.compute_us(_copy_info(coll, "concatenate"))
    a = calibration.overlap_slowdown
    frac = (n - 1) / (a * n)
    cost1 = n * t_chunk - frac * (ctx.pre_us + ctx.post_us)
    cost2 = t_chunk - frac * ctx.pre_us
    cost3 = t_chunk - frac * ctx.post_us
    # Independent work that hid part of the whole collective still hides chunks.
    slack = max(0.0, t_c_us - exposed_before_us)
    after = max(0.0, max(cost1, cost2, cost3, 0.0) - slack) + max(overhead, 0.0)
    return StrategyCost(n, t_c_us, t_chunk, ctx.pre_us, ctx.post_us, overhead,
                        exposed_before_us, max(after, 0.0))
