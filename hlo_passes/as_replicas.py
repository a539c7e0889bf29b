"""A per-device SPMD module as a replicated program: partition ids, channels, groups, header.

The executor compiles the emitted per-device module as ``n`` replicas on the step's devices
(``concerto_jax.executor``); these fixed rewrites (not passes: every emitted module gets
them) translate the SPMD module's partition ids, channel ids and mesh groups.
"""

from __future__ import annotations

from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.module import HloModule

__all__ = ["partition_id_to_replica_id", "spmd_to_replicated", "unique_all_reduce_channels"]


def partition_id_to_replica_id(module: HloModule) -> int:
    """Replaces every ``partition-id`` by a ``replica-id`` of the same shape.

    A per-device SPMD module compiled as a replicated program (``num_replicas=n,
    num_partitions=1``) sees partition id 0 everywhere; the replica id is the
    device's index, which is what the SPMD program meant.

    Returns:
      The number of instructions replaced.
    """
    count = 0
    for comp in module.computations:
        for inst in [i for i in comp.instructions if i.opcode == "partition-id"]:
            new = Instruction(module.unique_name("replica-id"), "replica-id", inst.shape)
            for key in ("metadata", "sharding"):
                if key in inst.attrs:
                    new.attrs[key] = inst.attrs[key]
            comp.replace_instruction(inst, new)
            count += 1
    return count


_HAS_GLOBAL_FLAG = ("all-reduce", "all-gather", "reduce-scatter")


def spmd_to_replicated(module: HloModule) -> int:
    """Rewrites a per-device SPMD module (1 replica x N partitions) so that it runs
    as a replicated program (N replicas x 1 partition) with the same meaning.

    * ``partition-id`` becomes ``replica-id`` (:func:`partition_id_to_replica_id`);
    * collectives in cross-partition mode (``channel_id`` without
      ``use_global_device_ids``: all-to-all, collective-permute, ...) lose their
      channel id, so their partition-id groups become the same replica-id groups;
    * collectives with ``use_global_device_ids=true`` (flattened ids) keep their groups
      and lose the channel id and the flag: with one replica, flattened ids are
      partition ids, with one partition replica ids, so the cross-replica form means the
      same. Outside SPMD mode XLA counts a collective with a channel id as side-effecting
      (``HloInstruction::HasSideEffectNoRecurse``), which the jitted (SPMD) program's
      collectives are not, and its passes then treat the program differently: e.g. the
      while-loop simplifier keeps a trip-count-1 loop whose body has one (it inlines it
      in the jitted program), and the scanned Evoformer x DAP step came out 1 ulp apart;
    * cross-replica-and-partition ones (a channel, the flag false) become one group
      of all replicas; cross-replica ones (no channel; one replica) become singletons;
      so no collective keeps a channel id (which also keeps XLA's non-SPMD layout
      assignment from tying all-reduces of one channel together, see
      :func:`unique_all_reduce_channels`, and from failing on tuple all-reduces with a
      channel, see ``fuse_collectives.rewrite.cross_replica_variadic_all_reduces``);
    * the header says ``num_partitions=1, replica_count=N``;
    * mesh-form replica groups (``mesh[...] {...}``) are written in list form: XLA's
      HLO -> StableHLO -> compile path runs some of them wrongly (checked with jax
      0.10.2: a scan's all-gather over ``mesh['axis_0'=1,'axis_1'=8] {'axis_1'}``
      gave wrong values, the list form the jitted function's bits).

    Returns:
      The number of instructions changed.

    Raises:
      ValueError: the module has more than one replica, or uses send/recv.
    """
    if module.replica_count != 1:
        raise ValueError(f"spmd_to_replicated expects 1 replica, the module has "
                         f"{module.replica_count}")
    num_devices = module.num_partitions
    changed = partition_id_to_replica_id(module)
    for inst in list(module.instructions()):
        kind = inst.collective_kind
        if kind is None or inst.async_role in ("done", "update"):
            continue
        target = inst.async_wrapped if inst.opcode == "async-start" else inst
        raw = target.attrs.get("replica_groups")
        if isinstance(raw, str) and raw.startswith("mesh"):
            target.replica_groups = target.replica_groups
            changed += 1
        if kind in ("send", "recv"):
            raise ValueError(f"%{inst.name}: send/recv cannot be rewritten to replicas")
        if target.use_global_device_ids:
            if target.channel_id is not None:
                target.channel_id = None
                target.use_global_device_ids = False
                changed += 1
            continue
        if target.channel_id is None:
            if "replica_groups" in target.attrs:
                target.replica_groups = [[i] for i in range(num_devices)]
                changed += 1
            continue
        target.channel_id = None
        if kind in _HAS_GLOBAL_FLAG:
            target.replica_groups = []
        changed += 1
    module.num_partitions = 1
    module.replica_count = num_devices
    return changed


def unique_all_reduce_channels(module: HloModule) -> int:
    """Gives every all-reduce that shares its ``channel_id`` with another one a new id.

    The SPMD partitioner emits all the all-reduces of one ``psum`` over a pytree
    inside ``shard_map`` with the same channel id. Outside SPMD mode
    (``use_spmd_partitioning=false``, as the replicated program is compiled) XLA's
    layout assignment treats an all-reduce with a channel id as a cross-module
    one and forces one layout on all the all-reduces of a channel
    (``IsCrossModuleAllReduce() && !use_spmd_partitioning()`` ->
    ``ChannelLayoutConstraints``), which fails for operands of different ranks
    (``layout minor_to_major field contains 3 elements, but shape has 1
    dimensions``). Within one program the id only selects the collective's mode,
    so distinct ids keep the meaning.

    Returns:
      The number of all-reduces renumbered.
    """
    targets = []
    for inst in module.instructions():
        if inst.opcode in ("all-reduce", "all-reduce-start"):
            targets.append(inst)
        elif inst.opcode == "async-start" and inst.async_wrapped is not None \
                and inst.async_wrapped.opcode == "all-reduce":
            targets.append(inst.async_wrapped)
    all_ids = [i.channel_id for i in module.instructions() if i.channel_id is not None]
    all_ids += [t.channel_id for t in targets if t.channel_id is not None]
    next_id = max(all_ids, default=0) + 1
    seen: set[int] = set()
    changed = 0
    for target in targets:
        cid = target.channel_id
        if cid is None:
            continue
        if cid in seen:
            target.channel_id = next_id
            next_id += 1
            changed += 1
        else:
            seen.add(cid)
    return changed
