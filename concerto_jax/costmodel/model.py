"""``CostModel``: one object answering "how long does this instruction take on this target"."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax.costmodel import calibration
from concerto_jax.costmodel.cluster import Cluster
from concerto_jax.costmodel.collectives import (
    CollectiveCost,
    CollectiveOptions,
    all_reduce_kernel_cost,
    collective_cost,
)
from concerto_jax.costmodel.compute import ComputeOptions, OpInfo, compute_time_us
from concerto_jax.costmodel.profile_store import ProfileStore
from concerto_jax.costmodel.specs import GpuSpec

DEFAULT_OVERLAP_SLOWDOWN = 1.1
"""Compute slowdown while a collective is in flight: configured, not measured (it needs two GPUs).
The Concerto paper hard-codes 1.2."""


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """Everything configurable about the cost model, reported with every result.

    Attributes:
      compute: efficiency factors and launch overhead of compute kernels.
      collectives: algorithm choice and link efficiency of collectives.
      overlap_slowdown: factor by which compute slows while communication is in
        flight (configured, not measured: it needs two GPUs; paper: 1.2).
      calibrated: on a GPU type with measured kernel rates (``costmodel.calibration``), the
        figures of ``compute`` not set on purpose take the measured ones; False keeps the
        datasheet figures there too.
      compute_set: the names of ``compute``'s figures set on purpose, kept as they are over a
        calibration (a plausible-model variant's, even where it equals the datasheet default);
        None: those that differ from the datasheet defaults.
    """

    compute: ComputeOptions = ComputeOptions()
    collectives: CollectiveOptions = CollectiveOptions()
    overlap_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    calibrated: bool = True
    compute_set: tuple[str, ...] | None = None


class CostModel:
    """Instruction and collective times on a target cluster; measured times override the model.

    On a GPU type with measured kernel rates (``costmodel.calibration``) those are the defaults.

    Args:
      cluster: the target cluster.
      options: efficiency factors, algorithm choice, overlap slowdown.
      store: measured kernel times by signature (taken before the analytical model).
      gpu: a GPU spec to use instead of ``cluster.gpu_spec`` (e.g. a measured host CPU).
    """

    def __init__(self, cluster: Cluster, options: CostOptions = CostOptions(),
                 store: ProfileStore | None = None, gpu: GpuSpec | None = None):
        self.cluster = cluster
        self.store = store
        self.gpu = gpu if gpu is not None else cluster.gpu_spec
        if options.calibrated:
            options = dataclasses.replace(options, compute=calibration.rebase(
                options.compute, self.gpu, options.compute_set))
        self.options = options
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return (f"CostModel({self.cluster.name}, gpu={self.gpu.name!r}, "
                f"store={self.store!r}, overlap_slowdown={self.options.overlap_slowdown})")

    def compute_us(self, op: OpInfo) -> float:
        """Time of a compute instruction: measured if the store has it, modelled otherwise."""
        if self.store is not None:
            measured = self.store.lookup(op)
            if measured is not None:
                self.hits += 1
                return measured
            self.misses += 1
        return self.modelled_compute_us(op)

    def modelled_compute_us(self, op: OpInfo) -> float:
        """The model's time of a compute instruction, the store left aside (what a subclass
        with another compute model, e.g. ``cpu.cpu_kernel_model``, overrides)."""
        return compute_time_us(op, self.gpu, self.options.compute)

    def collective(self, op: str, nbytes: float, groups: Sequence[Sequence[int]]) -> CollectiveCost:
        """Cost of collective ``op`` moving ``nbytes`` per device; the slowest replica group counts.

        Args:
          op: normalised collective kind (``all-reduce``, ...).
          nbytes: per-device payload (see ``collectives``).
          groups: the replica groups (global device ids); for a permute, the
            source-target pairs.
        """
        best: CollectiveCost | None = None
        seen: set[tuple[int, ...]] = set()
        for g in groups:
            placement = tuple(sorted(self.cluster.host_of(int(d)) for d in g))
            if placement in seen:
                continue
            seen.add(placement)
            c = collective_cost(op, nbytes, list(g), self.cluster, self.options.collectives)
            if best is None or c.time_us > best.time_us:
                best = c
        return best if best is not None else CollectiveCost(0.0, "none", "none", 0.0, 0.0)

    def all_reduce_kernel(self, nbytes: float, groups: Sequence[Sequence[int]],
                          strategy: str | None = None) -> CollectiveCost:
        """Cost of XLA:GPU's all-reduce kernel (``collectives.all_reduce_kernel_cost``: the
        Triton collective kernel fusion of jaxlib >= 0.11) moving ``nbytes`` per device; the
        slowest replica group counts. ``strategy``: ``"one_shot"``/``"two_shot"`` as XLA
        chose it, None for XLA's rule."""
        best: CollectiveCost | None = None
        seen: set[tuple[int, ...]] = set()
        for g in groups:
            placement = tuple(sorted(self.cluster.host_of(int(d)) for d in g))
            if placement in seen:
                continue
            seen.add(placement)
            c = all_reduce_kernel_cost(nbytes, list(g), self.cluster, strategy,
                                       self.options.compute.launch_overhead_us, self.options.collectives)
            if best is None or c.time_us > best.time_us:
                best = c
        return best if best is not None else CollectiveCost(0.0, "none", "none", 0.0, 0.0)

    def describe(self) -> dict:
        """Figures, sources and options, for reports."""
        return {
            "cluster": self.cluster.name,
            "cluster_description": self.cluster.description,
            "gpu": self.gpu.name,
            "gpu_sources": list(self.gpu.sources),
            "intra_link": f"{self.cluster.intra_link.name} {self.cluster.intra_link.bytes_per_s / 1e9:.0f} GB/s/dir "
                          f"({self.cluster.intra_link.source})",
            "inter_link": (f"{self.cluster.inter_link.bytes_per_s * 8 / 1e9:.0f} Gb/s per GPU "
                           f"({self.cluster.inter_link.source})") if self.cluster.inter_link else None,
            "options": dataclasses.asdict(self.options),
            "store": repr(self.store) if self.store is not None else None,
        }
