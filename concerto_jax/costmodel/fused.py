"""Fusion-aware costs of the post-SPMD module: each instruction's share of the XLA kernel it ends up in.

The post-SPMD module (what the rewriting passes -- decompose, pipeline_loops,
fuse_collectives -- see) has one instruction per HLO op; costed one kernel per
op, a GPT train step's graph has 4-5x the compute time of XLA's fused module of
the same step. This module maps post-SPMD instructions onto the kernels of
XLA's scheduled module (``CompiledTarget``/``TargetCompile.scheduled_text``, the
module XLA's post-scheduling pipelines receive) and splits each kernel's
cost-model time among the instructions mapped to it.

Mapping (XLA renames instructions when it fuses them -- ``dot.4`` becomes
``dot.133`` inside ``fusion.12`` -- but keeps each one's ``metadata={op_name=...}``):

1. *Instances*: every instruction of every schedulable computation of XLA's
   module (entry, loop bodies, ...) that launches a kernel, and every
   instruction inside its fused computations (recursively), belongs to that
   kernel.
2. *Tier 1*: a post-SPMD compute instruction matches the instances with the
   same ``(opcode, op_name)``.
3. *Tier 2*: instances left without a tier-1 partner (e.g. a ``dot`` that became
   a ``__cublas$gemm`` custom-call, a ``transpose`` that became a ``copy``) match
   the post-SPMD instructions left without one by ``op_name`` alone.
4. Unmapped post-SPMD instructions keep the cost model's unfused estimate
   (``unmapped="estimate"``, default) or cost 0 (``"zero"``), except layout-only ops (``ELIMINATED_OPCODES``: copy, reshape) with no
   counterpart at all: XLA turned them into bitcasts or removed them (the
   ``sharding_constraint`` copies of a JAX program), so they cost 0.

Costs: kernel ``k``'s time ``c_k = cost_model.compute_us(k)`` (the same call
``build_taskgraph`` makes on XLA's module, so the totals are comparable) goes
to its matched instances. Rule ``"anchor"`` (default): if the kernel holds a
matched dot / convolution / GEMM or convolution custom-call, those anchors share
``c_k`` in proportion to their own roofline work and everything fused around
them costs 0 (a GEMM's epilogue is free: the kernel's time is the GEMM's);
otherwise every matched instance shares ``c_k`` in proportion to its own
roofline time (a loop/input fusion streams all its ops once). Rule
``"proportional"``: always in proportion to own roofline time. An instruction's
cost is the sum of the shares of all the instances it matched (a group of
post-SPMD instructions with one key shares the group's total in proportion to
their own estimates). A kernel with no matched instance (XLA's own layout
copies of outputs, ``wrapped_*`` fusions: no ``op_name``) adds its time to the
kernel producing its operand, else to the first kernel reading its result
(``_fold_unmatched``); only what has neither is *unattributed*: reported, not
assigned.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping

from concerto_jax.costmodel.compute import class_options, work_of, work_time_us
from concerto_jax.costmodel.hlo_ops import is_kernel, op_info
from concerto_jax.costmodel.model import CostModel
from hlo_passes.ir.loops import schedulable_computations
from hlo_passes.ir.parser import parse_module

log = logging.getLogger(__name__)

ELIMINATED_OPCODES = frozenset({"copy", "reshape"})
"""Layout-only opcodes that cost 0 when XLA's module has no counterpart (bitcast or removed)."""

ANCHOR_OPCODES = frozenset({"dot", "convolution"})
"""Opcodes whose instance takes a fused kernel's whole time under the ``"anchor"`` rule
(plus custom-calls whose target names a GEMM or convolution)."""

RULES = ("anchor", "proportional")

_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class FusedCosts:
    """Per-instruction costs of a post-SPMD module under XLA's fusion (see module docstring).

    Attributes:
      us: instruction name -> cost (µs) for every compute instruction of the
        post-SPMD module's schedulable computations (mapped: its kernel shares;
        unmapped: the unfused estimate, or 0 for an eliminated layout op). Feed it
        to ``build_taskgraph(..., durations_us=us)``.
      unfused_us: the same instructions' unfused cost-model estimates.
      kernels: instruction name -> names of the XLA kernels it maps to (mapped only).
      unmapped: names mapped to no kernel (unfused estimate, or 0 with ``unmapped="zero"``).
      eliminated: names costed 0 as layout ops XLA removed.
      kernel_us: total time of XLA's kernels (``compute_us`` of each, summed).
      unattributed_us: time of kernels none of whose instances matched.
      rule: the sharing rule used.
    """

    us: dict[str, float]
    unfused_us: dict[str, float]
    kernels: dict[str, tuple[str, ...]]
    unmapped: tuple[str, ...]
    eliminated: tuple[str, ...]
    kernel_us: float
    unattributed_us: float
    rule: str

    @property
    def coverage(self) -> float:
        """Fraction of the post-SPMD compute instructions mapped to a kernel or found eliminated."""
        n = len(self.us)
        return (n - len(self.unmapped)) / n if n else 1.0

    @property
    def total_us(self) -> float:
        """Sum of ``us`` (compare with ``kernel_us``)."""
        return sum(self.us.values())

    def ratio(self, name: str) -> float:
        """Fused / unfused cost of ``name`` (1.0 when unknown): to scale the estimate of an
        instruction derived from ``name`` (e.g. a decomposed chunk of it)."""
        u = self.unfused_us.get(name)
        if not u or name not in self.us:
            return 1.0
        return self.us[name] / u

    def summary(self) -> dict:
        """Counts and totals, for reports."""
        return {"instructions": len(self.us), "mapped": len(self.kernels), "eliminated": len(self.eliminated),
                "unmapped": len(self.unmapped), "coverage": round(self.coverage, 4),
                "fused_total_us": round(self.total_us, 1), "unfused_total_us": round(sum(self.unfused_us.values()), 1),
                "kernel_us": round(self.kernel_us, 1), "unattributed_us": round(self.unattributed_us, 1),
                "unmapped_us": round(sum(self.unfused_us[n] for n in self.unmapped), 1), "rule": self.rule}


def op_name(inst) -> str:
    """The ``op_name`` of an instruction's metadata ("" when it has none)."""
    meta = inst.metadata
    if not meta:
        return ""
    m = _OP_NAME.search(str(meta))
    return m.group(1) if m else ""


def _is_anchor(inst) -> bool:
    if inst.opcode in ANCHOR_OPCODES:
        return True
    target = inst.custom_call_target or ""
    return inst.opcode == "custom-call" and any(t in target for t in ("gemm", "matmul", "conv"))


def _fused_instructions(inst):
    """Instructions inside the fused computations of ``inst`` (recursively through nested fusions;
    for the start of an async compute pair, the op it wraps and what is fused into that)."""
    if inst.opcode == "async-start" and inst.collective_kind is None:
        wrapped = inst.async_wrapped
        if wrapped is not None and wrapped is not inst:
            yield wrapped
            yield from _fused_instructions(wrapped)
        return
    if inst.opcode not in ("fusion", "fusion-start"):
        return
    for comp in inst.called_computations:
        for inner in comp.instructions:
            yield inner
            yield from _fused_instructions(inner)


def _fold_unmatched(xla, kernel_names: list[str], kernel_cost: list[float],
                    per_kernel: Mapping[int, list[int]]) -> list[float]:
    """Kernel costs with each kernel that matched nothing folded into a neighbour that did.

    XLA inserts kernels of its own (layout ``copy``s of outputs, ``wrapped_*`` fusions, ...)
    with no ``op_name``. Such a kernel's time goes to the kernel producing its operand
    (through ``bitcast``/``get-tuple-element``/``tuple``), else to the first kernel reading
    its result; with neither, it stays unattributed.
    """
    index = {n: k for k, n in enumerate(kernel_names)}
    cost = list(kernel_cost)
    passthrough = ("bitcast", "get-tuple-element", "tuple", "opt-barrier", "copy-start", "copy-done")

    def producer(inst, depth=0):
        if inst.name in index and index[inst.name] in per_kernel:
            return index[inst.name]
        if inst.opcode in passthrough and depth < 16:
            for o in inst.operands:
                k = producer(o, depth + 1)
                if k is not None:
                    return k
        return None

    users: dict[str, list] = {}
    for comp in schedulable_computations(xla):
        for inst in comp.instructions:
            for o in inst.operands:
                users.setdefault(o.name, []).append(inst)

    def consumer(inst, depth=0):
        for u in users.get(inst.name, ()):
            if u.name in index and index[u.name] in per_kernel:
                return index[u.name]
            if u.opcode in passthrough and depth < 16:
                k = consumer(u, depth + 1)
                if k is not None:
                    return k
        return None

    for comp in schedulable_computations(xla):
        for inst in comp.instructions:
            k = index.get(inst.name)
            if k is None or k in per_kernel:
                continue
            target = next((t for t in (producer(o) for o in inst.operands) if t is not None), None)
            if target is None:
                target = consumer(inst)
            if target is not None:
                cost[target] += cost[k]
                cost[k] = 0.0
    return cost


def fused_costs(post_spmd_module, xla_scheduled, cost_model: CostModel, *, rule: str = "anchor",
                eliminated_opcodes: frozenset[str] = ELIMINATED_OPCODES, unmapped: str = "estimate") -> FusedCosts:
    """Costs of the post-SPMD module's compute instructions under XLA's fusion of the same program.

    Args:
      post_spmd_module: the post-SPMD module (``hlo_passes`` ``HloModule`` or its text).
      xla_scheduled: XLA's scheduled (fused) module of the same program, text or module
        (``TargetCompile.scheduled_text``; an after-LHS or final module works too).
      cost_model: the cost model applied to XLA's kernels (and to the unmapped instructions).
      rule: ``"anchor"`` or ``"proportional"`` (module docstring).
      eliminated_opcodes: opcodes costed 0 when unmapped (XLA made them bitcasts).
      unmapped: cost of the other unmapped instructions: ``"estimate"`` (the unfused
        estimate; conservative placement) or ``"zero"`` (every XLA kernel's time is already
        assigned to mapped instructions, so this makes the total equal XLA's kernel time
        minus ``unattributed_us``; see docs/DECISIONS.md D21).

    Returns:
      A ``FusedCosts``.

    Raises:
      ValueError: unknown ``rule`` or ``unmapped``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if unmapped not in ("estimate", "zero"):
        raise ValueError(f"unmapped must be 'estimate' or 'zero', got {unmapped!r}")
    unmapped_mode = unmapped
    pre = parse_module(post_spmd_module) if isinstance(post_spmd_module, str) else post_spmd_module
    xla = parse_module(xla_scheduled) if isinstance(xla_scheduled, str) else xla_scheduled
    gpu, copts = cost_model.gpu, cost_model.options.compute
    cache: dict = {}

    def own_us(inst) -> float:  # roofline time of the op alone, without launch overhead
        try:
            info = op_info(inst, cache)
            return work_time_us(work_of(info), 0, gpu, class_options(info, copts))
        except (IndexError, KeyError, ValueError, ZeroDivisionError):
            return 0.0

    # XLA's kernels and their instances: (instance, kernel index).
    kernel_names: list[str] = []
    kernel_cost: list[float] = []
    instances: list[tuple[object, int]] = []
    for comp in schedulable_computations(xla):
        for inst in comp.instructions:
            if not is_kernel(inst):
                continue
            k = len(kernel_names)
            kernel_names.append(inst.name)
            kernel_cost.append(cost_model.compute_us(op_info(inst, cache)))
            instances.append((inst, k))
            instances.extend((inner, k) for inner in _fused_instructions(inst)
                             if inner.opcode not in ("parameter", "constant", "tuple", "get-tuple-element",
                                                     "bitcast"))

    # Post-SPMD compute instructions.
    members: list = [i for comp in schedulable_computations(pre) for i in comp.instructions if is_kernel(i)]
    unfused = {i.name: cost_model.compute_us(op_info(i, cache)) for i in members}
    by_key: dict[tuple[str, str], list] = {}
    for i in members:
        by_key.setdefault((i.opcode, op_name(i)), []).append(i)

    # Tier 1 by (opcode, op_name), tier 2 by op_name among the leftovers.
    inst_group: list[tuple[str, object] | None] = []
    matched_keys: set[tuple[str, str]] = set()
    for inst, _ in instances:
        key = (inst.opcode, op_name(inst))
        if key in by_key:
            inst_group.append(("k", key))
            matched_keys.add(key)
        else:
            inst_group.append(None)
    left_by_name: dict[str, list] = {}
    for key, group in by_key.items():
        if key not in matched_keys and key[1]:
            left_by_name.setdefault(key[1], []).extend(group)
    for j, (inst, _) in enumerate(instances):
        if inst_group[j] is None and op_name(inst) in left_by_name:
            inst_group[j] = ("n", op_name(inst))

    # Share each kernel's time among its matched instances.
    per_kernel: dict[int, list[int]] = {}
    for j, (_, k) in enumerate(instances):
        if inst_group[j] is not None:
            per_kernel.setdefault(k, []).append(j)
    kernel_cost = _fold_unmatched(xla, kernel_names, kernel_cost, per_kernel)
    group_us: dict[tuple[str, object], float] = {}
    group_kernels: dict[tuple[str, object], set[int]] = {}
    unattributed = 0.0
    for k, cost in enumerate(kernel_cost):
        js = per_kernel.get(k)
        if not js:
            unattributed += cost
            continue
        if rule == "anchor" and any(_is_anchor(instances[j][0]) for j in js):
            js = [j for j in js if _is_anchor(instances[j][0])]
        weights = [own_us(instances[j][0]) for j in js]
        total = sum(weights)
        if total <= 0:
            weights, total = [1.0] * len(js), float(len(js))
        for j, w in zip(js, weights, strict=True):
            g = inst_group[j]
            group_us[g] = group_us.get(g, 0.0) + cost * w / total
        for j in per_kernel[k]:
            group_kernels.setdefault(inst_group[j], set()).add(k)

    # Spread each group's time over its post-SPMD members.
    us: dict[str, float] = {}
    kernels: dict[str, tuple[str, ...]] = {}
    groups: list[tuple[tuple[str, object], list]] = [(("k", key), g) for key, g in by_key.items()
                                                     if key in matched_keys]
    groups += [(("n", name), g) for name, g in left_by_name.items() if ("n", name) in group_kernels]
    for gkey, group in groups:
        weights = [own_us(i) for i in group]
        total = sum(weights)
        if total <= 0:
            weights, total = [1.0] * len(group), float(len(group))
        names = tuple(sorted({kernel_names[k] for k in group_kernels.get(gkey, ())}))
        for i, w in zip(group, weights, strict=True):
            us[i.name] = group_us.get(gkey, 0.0) * w / total
            kernels[i.name] = names
    left, eliminated = [], []
    for i in members:
        if i.name in us:
            continue
        if i.opcode in eliminated_opcodes:
            us[i.name] = 0.0
            eliminated.append(i.name)
        else:
            us[i.name] = unfused[i.name] if unmapped_mode == "estimate" else 0.0
            left.append(i.name)
    out = FusedCosts(us=us, unfused_us=unfused, kernels=kernels, unmapped=tuple(left),
                     eliminated=tuple(eliminated), kernel_us=sum(kernel_cost), unattributed_us=unattributed,
                     rule=rule)
    log.info("fused costs of %s: %s", pre.name, out.summary())
    return out
