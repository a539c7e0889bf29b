"""All-reduces, reduce-scatters and all-gathers of replicated operands: move ``1/h`` of the
bytes over the group, gather the rest over the orthogonal one.

Under data x tensor parallelism every tensor-parallel rank holds the same gradient of a
replicated parameter (a position embedding, a norm's scale, a row-parallel bias) and
all-reduces all of it over the data-parallel group: ``h`` ranks move the same bytes,
each over its own link. When the data-parallel groups cross hosts and the tensor-parallel
ones do not, that is ``h`` times the network traffic that is needed:

    all-reduce_G(x)  ==  all-gather_H(all-reduce_G(slice_{rank in H}(x)))

and likewise ``reduce-scatter_G(x) == all-gather_H(reduce-scatter_G(sub-block_{rank in H}
of every block of x))`` (sharded data parallelism over hosts with tensor parallelism in a
host: a replicated parameter's gradient reduce-scattered over the data axis) and
``all-gather_G(x) == transpose(all-gather_H(all-gather_G(slice_{rank in H}(x))))`` (that
parameter's shard gathered over the data axis). All three hold whenever ``x`` is equal on
the devices of each group of ``H`` (the tensor-parallel groups: ``hlo_passes.ir.uniformity``
proves it from the parameters' shardings and the ops in between) and the members of each
``G`` group sit at one position of their ``H`` groups.
Every element is still reduced over the same devices in the same order (bitwise where
the all-reduce's own order is fixed; exactly for two-device groups, whose sum does not
depend on order). XLA does not do this: its replication analysis is not used to shrink
collectives, and BlueConnect (``xla_gpu_all_reduce_blueconnect_num_devices_per_host``)
only splits a group that itself spans hosts.

The rewrite is kept where the cost model says the sliced collective plus the all-gather
take less time than the original by ``MIN_SAVING`` (so never on one NVLink host, where
the gather costs what the slice saves).
"""

from __future__ import annotations

import logging

import numpy as np

from hlo_passes.ir import Uniformity, is_partition_of, labels_of_groups

log = logging.getLogger(__name__)

MIN_SAVING = 0.1
"""Smallest saving kept, as a fraction of the original collective's time."""
MIN_SAVING_US = 5.0
"""Smallest saving kept, in microseconds (below it the extra kernels are not worth it)."""


def complement_groups(groups: list[list[int]]) -> list[list[int]] | None:
    """``H_p = [g_0[p], g_1[p], ...]``: the devices at one position of every group of ``G``."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or len(groups) < 2:
        return None
    size = sizes.pop()
    return [[int(g[p]) for g in groups] for p in range(size)]


def aligned(groups: list[list[int]], gather: list[list[int]], num_devices: int) -> bool:
    """True when ``gather`` (groups of ``h``, in slice order) fits the all-reduce groups
    ``groups``: every device is in one gather group; the members of one all-reduce group
    all sit at one position of their gather groups (they reduce one slice); and the
    device at position ``j`` of ``d``'s gather group reduces over a group whose members
    have, in order, the gather labels of ``d``'s group's members (so with a uniform
    operand it sums the same values in the same order as ``d`` did)."""
    labels = labels_of_groups(gather, num_devices)
    where = labels_of_groups(groups, num_devices)
    if labels is None or where is None or len({len(g) for g in gather}) != 1 or len(gather[0]) < 2:
        return False
    pos = np.zeros(num_devices, dtype=np.int64)
    for g in gather:
        for j, d in enumerate(g):
            pos[int(d)] = j
    for g in groups:
        if len({int(pos[int(d)]) for d in g}) != 1:
            return False
    seq = {k: [int(labels[int(e)]) for e in g] for k, g in enumerate(groups)}
    for d in range(num_devices):
        mine = seq[int(where[d])]
        for e in gather[int(labels[d])]:
            if seq[int(where[int(e)])] != mine:
                return False
    return True


def same_block(groups: list[list[int]], gather: list[list[int]]) -> bool:
    """For a reduce-scatter over ``groups``: every gather group's members sit at one position
    of their reduce-scatter groups (they receive the same block of the result)."""
    pos = {int(d): p for g in groups for p, d in enumerate(g)}
    return all(len({pos.get(int(d)) for d in g}) == 1 for g in gather)


def _slice_dim(shape, h: int) -> int | None | bool:
    """The major-most dimension that divides by ``h``; None: flatten; False: no way."""
    order = list(reversed(shape.minor_to_major)) if shape.minor_to_major else list(range(shape.rank))
    for d in order:
        if shape.dims[d] % h == 0 and shape.dims[d] >= h:
            return d
    return None if shape.num_elements % h == 0 else False


def _candidate_partitions(module) -> list[list[list[int]]]:
    """Device partitions the module's own collectives use (its mesh axes and their products)."""
    n = module.num_devices
    seen, out = set(), []
    for inst in module.instructions():
        if inst.opcode not in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
            continue
        groups = inst.replica_groups
        if not groups or not is_partition_of(groups, n):
            continue
        key = tuple(tuple(int(d) for d in g) for g in groups)
        if key not in seen:
            seen.add(key)
            out.append([list(g) for g in key])
    return out


def plan_replicated_reductions(module, cost_model) -> list[dict]:
    """The all-reduces, reduce-scatters and all-gathers of ``module`` to rewrite, each with
    its gather groups and times.

    Returns one dict per kept collective: ``instruction``, ``computation``, ``gather_groups``,
    ``dim`` (all-reduce: the dimension sliced, None = flattened; reduce-scatter, all-gather:
    theirs), ``h``, ``bytes`` (the cost model's payload: operand of a reduction, result of a
    gather), ``before_us``, ``after_us``.
    """
    n = module.num_devices
    if module.replica_count != 1 or module.num_partitions != n or n < 2:
        return []
    partitions = _candidate_partitions(module)
    analyses: dict[tuple, Uniformity] = {}
    plans = []
    for comp in module.computations:
        for inst in comp.instructions:
            op = inst.opcode
            if op not in ("all-reduce", "reduce-scatter", "all-gather") or not inst.shape.is_array \
                    or len(inst.operands) != 1 or not inst.use_global_device_ids:
                continue
            groups = inst.replica_groups
            if not groups or not is_partition_of(groups, n):
                continue
            # The cost model's payload: the operand of a reduction, the result of a gather.
            nbytes = (inst.shape if op == "all-gather" else inst.operands[0].shape).byte_size
            before = cost_model.collective(op, nbytes, groups).time_us
            options = []
            for gather in [complement_groups(groups), *partitions]:
                if gather is None or not aligned(groups, gather, n):
                    continue
                h = len(gather[0])
                if op == "all-reduce":
                    dim = _slice_dim(inst.shape, h)
                    if dim is False:
                        continue
                else:
                    dims = inst.dimensions or []
                    if len(dims) != 1:
                        continue
                    dim = dims[0]
                    if op == "reduce-scatter" and (not same_block(groups, gather)
                                                   or inst.shape.dims[dim] % h):
                        continue
                    if op == "all-gather" and inst.operands[0].shape.dims[dim] % h:
                        continue
                after = (cost_model.collective(op, nbytes / h, groups).time_us
                         + cost_model.collective("all-gather", inst.shape.byte_size, gather).time_us)
                if before - after >= max(MIN_SAVING * before, MIN_SAVING_US):
                    options.append((after, -h, gather, dim))
            for after, neg_h, gather, dim in sorted(options, key=lambda o: (o[0], o[1])):
                key = tuple(tuple(g) for g in gather)
                if key not in analyses:
                    labels = labels_of_groups(gather, n)
                    analyses[key] = Uniformity(module, labels)
                if analyses[key].uniform(inst.operands[0]):
                    plans.append({"instruction": inst, "computation": comp.name, "gather_groups": gather,
                                  "dim": dim, "h": -neg_h, "bytes": nbytes,
                                  "before_us": round(before, 1), "after_us": round(after, 1)})
                    break
    return plans
