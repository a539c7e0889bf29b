"""Which values of a per-device SPMD module hold the same data on every device of a group.

A value is *uniform over a partition* ``P`` of the devices (a label per device) when every
two devices with the same label hold equal bits of it. This is XLA's replication analysis
(``HloReplicationAnalysis``, with partial replication) re-derived for our IR and asked
for one partition at a time:

* an entry parameter is uniform where its ``sharding`` gives the devices of a group the
  same tile (``{replicated}``, the replicated subgroup of ``last_tile_dim_replicate`` /
  ``last_tile_dims={replicated}``; in the mesh form XLA >= 0.11 prints,
  ``{mesh['data'=2,'model'=4], [{'data'}, {}]}``, the devices that differ only in axes no
  dimension is sharded over and none is ``unreduced``); ``{maximal ...}``, ``{manual}``,
  manual subgroups and a parameter without sharding are not (``capture`` restores the
  entry parameters' shardings XLA 0.12 no longer prints after partitioning);
* constants and iotas are; stateful ``rng``, ``custom-call`` (its target is opaque),
  ``infeed``, ``recv``/``send`` and every async op are not;
* small integer values are evaluated per device (``KNOWN_MAX_ELEMENTS``): ``partition-id``
  is the device's id, and the partitioner's offset tables (``dynamic-slice`` of a constant
  by the partition id), their converts, compares, selects and arithmetic are uniform where
  the group's devices compute equal values (a table ``{0,0,0,0,1,1,1,1}`` read by the
  partition id is uniform over the groups ``{0..3}``, ``{4..7}``);
* ``all-reduce`` / ``all-gather`` over groups ``Q``: uniform when every ``P`` group lies in
  one ``Q`` group (whatever the operand), or when the operand is uniform and two devices
  with one label see their ``Q`` groups' members with the same labels in the same order;
  ``reduce-scatter`` / ``all-to-all`` also need the devices at the same position of their
  groups; ``collective-permute``: a uniform operand whose sources of one label's devices
  share a label (or are all absent);
* ``while``: the state slots that stay uniform through the body (a fixed point from the
  init's), provided the condition is uniform on them (else the trip counts may differ);
  ``conditional``: a uniform selector and every branch's result; ``call`` / ``fusion``:
  the callee on its operands' uniformity; any other op: all of its operands.

Values are a ``bool`` per array (or, for a small integer array, its contents per device)
and nested tuples of them for tuples. The analysis is sound, not complete: ``False``
means "not proven".
"""

from __future__ import annotations

import re

import numpy as np

from hlo_passes.ir.sharding import sharding_tile_keys

__all__ = ["Uniformity"]

KNOWN_MAX_ELEMENTS = 64
"""Integer and predicate arrays up to this size are evaluated per device."""

_NOT_UNIFORM_OPS = frozenset({
    "partition-id", "replica-id", "rng", "rng-get-and-update-state", "custom-call", "infeed",
    "recv", "recv-done", "send", "send-done", "outfeed", "async-start", "async-update",
    "async-done", "all-reduce-start", "all-reduce-done", "all-gather-start", "all-gather-done",
    "collective-permute-start", "collective-permute-done", "copy-start", "copy-done",
    "ragged-all-to-all", "collective-broadcast",
})
_NUMPY_INTS = {"pred": np.bool_, "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
               "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}
_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "and": np.bitwise_and,
           "or": np.bitwise_or, "xor": np.bitwise_xor, "maximum": np.maximum, "minimum": np.minimum}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}
def _fill(shape, flag: bool):
    if shape.is_tuple:
        return tuple(_fill(s, flag) for s in shape.elements)
    return flag


def _literal_values(inst) -> np.ndarray | None:
    """The contents of a small integer / predicate ``constant``, or None."""
    dtype = _NUMPY_INTS.get(inst.shape.dtype) if inst.shape.is_array else None
    if dtype is None or inst.literal is None or inst.shape.num_elements > KNOWN_MAX_ELEMENTS:
        return None
    tokens = re.findall(r"-?\d+|true|false", inst.literal)
    if len(tokens) != inst.shape.num_elements:
        return None
    values = [1 if t == "true" else 0 if t == "false" else int(t) for t in tokens]
    return np.array(values).astype(dtype).reshape(inst.shape.dims)


class Uniformity:
    """Uniformity of a module's values over one partition of its devices.

    Args:
      module: a per-device SPMD module (``replica_count`` 1: device ids are partition ids).
      labels: per device id, its group's label (``labels_of_groups``).
    """

    def __init__(self, module, labels: np.ndarray):
        self.module = module
        self.labels = np.asarray(labels)
        self.num_devices = len(self.labels)
        self._groups = [np.flatnonzero(self.labels == g) for g in np.unique(self.labels)]
        self._computations: dict[tuple, dict] = {}

    # -- public ------------------------------------------------------------------------
    def value(self, inst):
        """The uniformity of ``inst`` (a bool per array, nested tuples for a tuple) in the
        context its computation runs in (entry: the parameters' shardings; a callee: what
        its callers pass, met over every call site reached from the entry)."""
        comp = inst.parent
        if not self._computations:
            self._evaluate_entry()
        contexts = [vals for (name, _), vals in self._computations.items() if name == comp.name]
        if not contexts:
            return _fill(inst.shape, False)
        out = self._bools(contexts[0][inst.name])
        for vals in contexts[1:]:
            out = self._meet(out, vals[inst.name])
        return out

    def uniform(self, inst) -> bool:
        """True when every leaf of ``inst`` is uniform over the partition."""
        return self._true(self.value(inst))

    # -- values --------------------------------------------------------------------------
    def _true(self, value) -> bool:
        if isinstance(value, tuple):
            return all(self._true(v) for v in value)
        if isinstance(value, np.ndarray):  # contents per device: equal within each group?
            return all((value[g] == value[g[0]]).all() for g in self._groups)
        return bool(value)

    def _bools(self, value):
        if isinstance(value, tuple):
            return tuple(self._bools(v) for v in value)
        return self._true(value)

    def _meet(self, a, b):
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
            return tuple(self._meet(x, y) for x, y in zip(a, b, strict=True))
        return self._true(a) and self._true(b)

    def _coerce(self, shape, value):
        if shape.is_tuple:
            if isinstance(value, tuple) and len(value) == len(shape.elements):
                return tuple(self._coerce(s, v) for s, v in zip(shape.elements, value, strict=True))
            return _fill(shape, self._true(value))
        return value if isinstance(value, np.ndarray) else self._true(value)

    # -- evaluation --------------------------------------------------------------------
    def _evaluate_entry(self) -> None:
        entry = self.module.entry
        params = []
        for p in entry.parameters:
            keys = sharding_tile_keys(p.attr("sharding"), p.shape, self.num_devices)
            params.append(self._from_keys(keys))
        self._evaluate(entry, tuple(params))

    def _from_keys(self, keys):
        if isinstance(keys, tuple):
            return tuple(self._from_keys(k) for k in keys)
        return all(len(np.unique(keys[g])) == 1 for g in self._groups)

    @staticmethod
    def _key(value):
        if isinstance(value, tuple):
            return tuple(Uniformity._key(v) for v in value)
        if isinstance(value, np.ndarray):
            return (value.dtype.str, value.shape, value.tobytes())
        return value

    def _evaluate(self, comp, params: tuple) -> dict:
        key = (comp.name, self._key(params))
        done = self._computations.get(key)
        if done is not None:
            return done
        vals: dict = {}
        self._computations[key] = vals
        for inst in comp.post_order():
            if inst.opcode == "parameter":
                n = inst.parameter_number
                vals[inst.name] = params[n] if n is not None and n < len(params) \
                    else _fill(inst.shape, False)
            else:
                vals[inst.name] = self._rule(inst, [vals[o.name] for o in inst.operands])
        return vals

    def _root(self, comp, params: tuple):
        return self._evaluate(comp, params)[comp.root.name]

    def _rule(self, inst, ops: list):
        op = inst.opcode
        known = self._known(inst, ops)
        if known is not None:
            return known
        if op in ("constant", "iota"):
            return _fill(inst.shape, True)
        if op in _NOT_UNIFORM_OPS:
            return _fill(inst.shape, False)
        if op == "tuple":
            return tuple(ops)
        if op == "get-tuple-element":
            src = ops[0]
            return src[inst.tuple_index] if isinstance(src, tuple) else _fill(inst.shape, self._true(src))
        if op == "opt-barrier":
            return ops[0]
        if op in ("call", "fusion"):
            callee = inst.attr("to_apply") or inst.attr("calls")
            if callee is None or isinstance(callee, list):
                return _fill(inst.shape, False)
            return self._coerce(inst.shape, self._root(callee, tuple(ops)))
        if op == "while":
            return self._while(inst, ops[0])
        if op == "conditional":
            return self._conditional(inst, ops)
        if op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            return _fill(inst.shape, self._collective(inst, all(self._true(v) for v in ops)))
        if op == "select" and len(inst.operands) == 3 and inst.operands[1] is inst.operands[2]:
            return self._true(ops[1])  # select(p, a, a) is a whatever p is
        # Any other op is a pure function of its operands (called computations such as
        # reduce's to_apply are scalar combiners or comparators of their operands' elements).
        for callee in inst.called_computations:
            if self._impure(callee):
                return _fill(inst.shape, False)
        return _fill(inst.shape, all(self._true(v) for v in ops))

    def _known(self, inst, ops: list) -> np.ndarray | None:
        """Per-device contents (shape ``(devices, *dims)``) of a small integer array, or None."""
        shape = inst.shape
        dtype = _NUMPY_INTS.get(shape.dtype) if shape.is_array else None
        if dtype is None or shape.num_elements > KNOWN_MAX_ELEMENTS:
            return None
        n, op = self.num_devices, inst.opcode
        if op == "partition-id":
            return np.arange(n, dtype=dtype)
        if op == "replica-id" and self.module.replica_count == 1:
            return np.zeros(n, dtype=dtype)
        if op == "constant":
            lit = _literal_values(inst)
            return None if lit is None else np.broadcast_to(lit, (n, *lit.shape)).copy()
        if not ops or not all(isinstance(v, np.ndarray) for v in ops):
            return None
        dims = tuple(shape.dims)
        try:
            if op in ("reshape", "bitcast") and (op == "reshape" or inst.operands[0].shape.dtype == shape.dtype):
                out = ops[0].reshape((n, *dims))
            elif op == "convert":
                out = ops[0].astype(dtype)
            elif op == "broadcast":
                mapped = list(inst.dimensions or [])
                if mapped != sorted(mapped):
                    return None
                expand = [slice(None)] + [slice(None) if d in mapped else None for d in range(len(dims))]
                out = np.broadcast_to(ops[0][tuple(expand)], (n, *dims))
            elif op == "dynamic-slice":
                sizes = [int(x) for x in re.findall(r"\d+", inst.attr("dynamic_slice_sizes") or "")]
                src = ops[0]
                rows = []
                for d in range(n):
                    starts = [int(np.clip(int(np.asarray(v[d]).reshape(())), 0, src.shape[1 + k] - sizes[k]))
                              for k, v in enumerate(ops[1:])]
                    rows.append(src[(d, *[slice(s, s + z) for s, z in zip(starts, sizes, strict=True)])])
                out = np.stack(rows)
            elif op == "compare":
                out = _COMPARE[(inst.attr("direction") or "").strip()](ops[0], ops[1])
            elif op == "select":
                out = np.where(ops[0], ops[1], ops[2])
            elif op in _BINARY:
                out = _BINARY[op](ops[0], ops[1])
            elif op == "negate":
                out = np.negative(ops[0])
            elif op == "not":
                out = np.logical_not(ops[0]) if shape.dtype == "pred" else np.invert(ops[0])
            else:
                return None
        except (KeyError, ValueError, IndexError, TypeError, AttributeError):
            return None
        out = np.asarray(out).astype(dtype)
        return out if out.shape == (n, *dims) else None

    def _impure(self, comp, _seen: set | None = None) -> bool:
        """True when ``comp`` (or a computation it calls) reads a device-dependent source."""
        seen = set() if _seen is None else _seen
        if comp.name in seen:
            return False
        seen.add(comp.name)
        for inst in comp.instructions:
            if inst.opcode in _NOT_UNIFORM_OPS or inst.opcode in (
                    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
                return True
            if any(self._impure(c, seen) for c in inst.called_computations):
                return True
        return False

    def _while(self, inst, init):
        body, cond = inst.attr("body"), inst.attr("condition")
        if body is None or cond is None:
            return _fill(inst.shape, False)
        state = self._bools(self._coerce(inst.shape, init))
        for _ in range(64):
            out = self._coerce(inst.shape, self._root(body, (state,)))
            nxt = self._meet(state, out)
            if nxt == state:
                break
            state = nxt
        else:
            return _fill(inst.shape, False)
        if not self._true(self._root(cond, (state,))):
            return _fill(inst.shape, False)
        return state

    def _conditional(self, inst, ops):
        if not self._true(ops[0]):
            return _fill(inst.shape, False)
        branches = inst.attr("branch_computations")
        if branches is None:
            branches = [inst.attr("true_computation"), inst.attr("false_computation")]
        if not isinstance(branches, list) or any(b is None for b in branches) \
                or len(branches) != len(ops) - 1:
            return _fill(inst.shape, False)
        out = None
        for b, arg in zip(branches, ops[1:], strict=True):
            r = self._bools(self._coerce(inst.shape, self._root(b, (arg,))))
            out = r if out is None else self._meet(out, r)
        return _fill(inst.shape, False) if out is None else out
    def _collective(self, inst, operands_uniform: bool) -> bool:
        labels, n = self.labels, self.num_devices
        if self.module.replica_count != 1:
            return False  # replica x partition groups: not expanded here
        if inst.channel_id is None:
            # Cross-replica mode with one replica: every device reduces / gathers alone.
            return operands_uniform and inst.opcode in ("all-reduce", "all-gather")
        if inst.opcode == "collective-permute":
            if not operands_uniform:
                return False
            src = {}
            for s, t in inst.source_target_pairs or []:
                src[int(t)] = int(s)
            for label in np.unique(labels):
                members = np.flatnonzero(labels == label)
                seen = {(labels[src[d]] if d in src else None) for d in members.tolist()}
                if len(seen) > 1:
                    return False
            return True
        groups = inst.replica_groups
        if not groups:
            groups = [list(range(n))]
        where: dict[int, tuple[int, int]] = {}
        for k, g in enumerate(groups):
            for pos, d in enumerate(g):
                where[int(d)] = (k, pos)
        if len(where) != n:
            return False
        scatter = inst.opcode in ("reduce-scatter", "all-to-all")
        same_group = not scatter
        same_sequence = operands_uniform
        for label in np.unique(labels):
            members = np.flatnonzero(labels == label).tolist()
            k0, p0 = where[members[0]]
            seq0 = [labels[int(d)] for d in groups[k0]]
            for d in members[1:]:
                k, p = where[d]
                if k != k0:
                    same_group = False
                if scatter and p != p0:
                    same_sequence = False
                if same_sequence and [labels[int(e)] for e in groups[k]] != seq0:
                    same_sequence = False
            if not same_group and not same_sequence:
                return False
        return same_group or same_sequence
