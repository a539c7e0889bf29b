"""Small IR rewrites that other passes and the executor need."""

from __future__ import annotations

from hlo_passes.ir import HloModule, Instruction

__all__ = ["partition_id_to_replica_id"]


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
