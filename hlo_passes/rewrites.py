"""Small IR rewrites that other passes and the executor need."""

from __future__ import annotations

from hlo_passes.ir import HloModule, Instruction

__all__ = ["partition_id_to_replica_id", "spmd_to_replicated"]


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
    * collectives with ``use_global_device_ids=true`` (flattened ids) are kept: with
      one replica, flattened ids are partition ids, with one partition replica ids;
    * cross-replica-and-partition ones (a channel, the flag false) become one group
      of all replicas; cross-replica ones (no channel; one replica) become singletons;
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
