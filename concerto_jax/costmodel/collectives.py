"""Alpha-beta time of a collective over its replica group's placement.

``time = base + steps * hop + bus_factor * bytes / bandwidth`` per algorithm
(ring, tree) and NCCL protocol (LL, LL128, Simple); ``algorithm="auto"``
takes the fastest, as NCCL's tuner does from its own cost table.

* Bus factors (nccl-tests ``PERFORMANCE.md``): all-reduce ``2(n-1)/n``,
  all-gather / reduce-scatter / all-to-all ``(n-1)/n``, collective-permute 1.
  ``bytes`` is the per-device payload: operand size for all-reduce,
  reduce-scatter, all-to-all and permute, result size for all-gather.
* Steps of a ring: all-reduce ``2(n-1)``, others ``n-1``, permute 1. A tree
  all-reduce (NCCL double binary tree) takes ``2((k-1) + log2 h)`` steps over
  ``k`` ranks per host and ``h`` hosts and moves ``2 * bytes`` per rank
  (NCCL's tree algbw ratio 0.5); trees only exist for all-reduce.
* Bandwidth: a group on one host uses the host's GPU link (NVLink or PCIe).
  A group spanning hosts is bottlenecked by ``min(intra, k * nic)``: every
  ring channel crosses each host boundary once, and the ``k`` ranks of the
  group on a host bring ``k`` NICs. Only the steps that cross a host
  boundary pay the network's per-step latency (as in NCCL's model).
  All-to-all splits its traffic into the on-host part over the GPU link and
  the off-host part over the rank's own NIC.
* NVLS (NVLink SHARP): on a host whose NVSwitch reduces in the switch (H100 SXM, NCCL >= 2.17,
  on by default where multicast is available) NCCL's tuner also prices an all-reduce within
  the host as ``25 us + bus_factor * bytes / (bw * link_efficiency * nvls_bus_ratio)``
  (``hwLat[NVLINK][NVLS][Simple]``, Simple protocol only) and takes the fastest: NVLS wins
  from about 1-2 MiB per rank. A group spanning hosts stays on ring/tree (NCCL's NVLSTree is
  not modelled). ``CollectiveOptions.nvls=False`` is a host without it (``NCCL_NVLS_ENABLE=0``,
  no fabric manager, a container without multicast).
* ``link_efficiency`` is the achieved fraction of a link's peak (configured,
  not measured: nccl-tests on 8x H100 SXM report about 360-370 GB/s all-reduce
  busbw of 450, i.e. ~0.8).

XLA:GPU's **all-reduce kernels** (jaxlib >= 0.11 on Hopper or newer: a small all-reduce
within one NVLink host runs as a Triton "collective kernel" fusion instead of NCCL;
``all_reduce_kernel_cost``). Each rank exposes its input in symmetric memory and reads the
peers' copies over NVLink, no NCCL ring:

* one-shot (read size ``n x bytes`` up to 2 MiB): every rank reads all ``n - 1`` peers'
  buffers whole and reduces locally: ``(n - 1) x bytes`` over its link, one signal round;
* two-shot (up to 32 MiB read): every rank reduces its ``1/n`` slice from all peers, then
  gathers the other reduced slices: ``2 (n - 1)/n x bytes``, two signal rounds.

``time = launch + rounds x signal + link bytes / (link bandwidth x link_efficiency)``: the
launch is the compute kernels' launch overhead, a signal round one flag store and poll over
the link (NCCL's LL per-hop latency on that link, the same mechanism). Assumed, not measured
(not measured on a GPU): the kernel's 32 blocks pull at the link's rate, and its local HBM traffic
(the input copied to symmetric memory, the output written) hides under the link transfer.
The strategy rule and the size limits are XLA's (``xla/backends/gpu/runtime/all_reduce.cc``:
``GetAllReduceStrategy``, ``kMaxOneShotAllReduceSizeBytes``, ``kMaxTwoShotAllReduceSizeBytes``;
``sync_count_increment = 1 + strategy``).

References: NCCL ``src/graph/tuning.cc`` (latencies, protocol model);
nccl-tests ``doc/PERFORMANCE.md`` (bus bandwidth); Thakur et al., "Optimization
of Collective Communication Operations in MPICH" (IJHPCA 2005).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from concerto_jax.costmodel import specs
from concerto_jax.costmodel.cluster import Cluster

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

PRICED_AS = {"ragged-all-to-all": "all-to-all"}
"""Collectives priced as another: a ``ragged-all-to-all`` (MoE token dispatch with per-peer
sizes known only at run time, MaxText's default MoE path) as an all-to-all of its whole input
buffer, the most it can send (the payload ``hlo_taskgraph`` gives it)."""
_PROTOCOLS = ("LL", "LL128", "Simple")


@dataclasses.dataclass(frozen=True)
class CollectiveOptions:
    """How collectives are modelled.

    Attributes:
      algorithm: ``auto`` (fastest of ring/tree), ``ring`` or ``tree``.
      protocols: NCCL protocols the tuner may pick from.
      link_efficiency: achieved fraction of peak link bandwidth (configured, ~0.8 from nccl-tests).
      nvls: NCCL may run a single-host all-reduce as NVLS where the link has it
        (``LinkSpec.nvls_bus_ratio``); only with ``algorithm="auto"``.
    """

    algorithm: str = "auto"
    protocols: tuple[str, ...] = _PROTOCOLS
    link_efficiency: float = 0.8
    nvls: bool = True


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """The chosen algorithm for one collective and its time."""

    time_us: float
    algorithm: str
    protocol: str
    bus_bytes_per_s: float
    latency_us: float


def bus_factor(op: str, n: int) -> float:
    """Bytes a rank sends per payload byte for a bandwidth-optimal ``op`` over ``n`` ranks."""
    op = PRICED_AS.get(op, op)
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if op == "collective-permute":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {COLLECTIVE_OPS}")


def _placement(group: Sequence[int], cluster: Cluster) -> tuple[int, int, int]:
    """(ranks, hosts spanned, most ranks on one host) of a replica group."""
    per_host: dict[int, int] = {}
    for d in group:
        h = cluster.host_of(int(d))
        per_host[h] = per_host.get(h, 0) + 1
    return len(group), len(per_host), max(per_host.values(), default=0)


def collective_cost(
    op: str,
    nbytes: float,
    group: Sequence[int],
    cluster: Cluster,
    options: CollectiveOptions = CollectiveOptions(),
) -> CollectiveCost:
    """Time of collective ``op`` moving ``nbytes`` per device over ``group`` on ``cluster``.

    Args:
      op: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
        ``collective-permute`` (for a permute pass one source-target pair).
      nbytes: per-device payload (see the module docstring).
      group: global device ids of one replica group.
      cluster: the target cluster (placement of devices on hosts, links).
      options: algorithm choice and link efficiency.

    Returns:
      The fastest (algorithm, protocol) allowed by ``options`` and its time. ``op`` may also
      be one of ``PRICED_AS`` (priced as the collective it names).
    """
    op = PRICED_AS.get(op, op)
    n, hosts, k = _placement(group, cluster)
    if n <= 1 or nbytes <= 0:
        return CollectiveCost(0.0, "none", "none", 0.0, 0.0)
    spans = hosts > 1
    if spans and cluster.inter_link is None:
        raise ValueError(f"group {list(group)} spans hosts but cluster {cluster.name!r} has no network")
    intra = cluster.intra_link
    link = cluster.inter_link if spans else intra
    eff = options.link_efficiency
    bw = intra.bytes_per_s if not spans else min(intra.bytes_per_s, k * cluster.inter_link.bytes_per_s)
    bw *= eff
    algorithms = ("ring", "tree") if options.algorithm == "auto" else (options.algorithm,)
    if op != "all-reduce":
        algorithms = ("ring",)
    base = dict(specs.NCCL_BASE_LATENCY_US)
    best: CollectiveCost | None = None
    for algo in algorithms:
        for p, proto in enumerate(_PROTOCOLS):
            if proto not in options.protocols:
                continue
            frac = specs.NCCL_PROTOCOL_BW_FRACTION[p]
            if algo == "ring":
                steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(op, n - 1)
                # NCCL: only the steps that cross a host boundary pay the network latency.
                inter_steps = 0
                if spans:
                    inter_steps = {"all-reduce": 2 * (hosts - 1), "collective-permute": 1}.get(op, hosts - 1)
                latency = (base["ring"][p] + (steps - inter_steps) * intra.hop_us("ring")[p]
                           + inter_steps * link.hop_us("ring")[p])
                if op == "all-to-all" and spans:
                    on_host = (k - 1) / n * nbytes / (intra.bytes_per_s * eff)
                    off_host = (n - k) / n * nbytes / (cluster.inter_link.bytes_per_s * eff)
                    transfer = max(on_host, off_host) / frac
                else:
                    transfer = bus_factor(op, n) * nbytes / (bw * frac)
            elif algo == "tree":
                base_lat = base["tree"][p]
                hops = (k - 1) * intra.hop_us("tree")[p]
                if spans:
                    hops += math.log2(hosts) * cluster.inter_link.hop_us("tree")[p]
                latency = base_lat + 2 * hops
                transfer = 2.0 * nbytes / (bw * frac)
            else:
                raise ValueError(f"unknown algorithm {algo!r}; expected auto, ring or tree")
            cost = CollectiveCost(latency + 1e6 * transfer, algo, proto, bw * frac, latency)
            if best is None or cost.time_us < best.time_us:
                best = cost
    if best is None:
        raise ValueError(f"no protocol allowed: {options.protocols}; expected a subset of {_PROTOCOLS}")
    if (op == "all-reduce" and not spans and options.nvls and options.algorithm == "auto"
            and intra.nvls_bus_ratio and "Simple" in options.protocols):
        bw_nvls = bw * intra.nvls_bus_ratio
        nvls = CollectiveCost(specs.NCCL_NVLS_LATENCY_US + 1e6 * bus_factor(op, n) * nbytes / bw_nvls,
                              "nvls", "Simple", bw_nvls, specs.NCCL_NVLS_LATENCY_US)
        if nvls.time_us < best.time_us:
            best = nvls
    return best


def collective_time_us(op: str, nbytes: float, group: Sequence[int], cluster: Cluster,
                       options: CollectiveOptions = CollectiveOptions()) -> float:
    """Shorthand for ``collective_cost(...).time_us``."""
    return collective_cost(op, nbytes, group, cluster, options).time_us


KERNEL_ONE_SHOT_MAX_READ_BYTES = 2 << 20
"""XLA ``kMaxOneShotAllReduceSizeBytes``: largest ``n x bytes`` an all-reduce kernel reads one-shot."""
KERNEL_TWO_SHOT_MAX_READ_BYTES = 32 << 20
"""XLA ``kMaxTwoShotAllReduceSizeBytes``: largest ``n x bytes`` of an all-reduce kernel at all."""
KERNEL_STRATEGIES = ("one_shot", "two_shot")


def all_reduce_kernel_strategy(nbytes: float, n: int) -> str:
    """The strategy XLA gives an all-reduce kernel of ``nbytes`` per rank over ``n`` ranks
    (``GetAllReduceStrategy``, multimem off): one-shot while it reads at most 2 MiB."""
    return "one_shot" if nbytes * n <= KERNEL_ONE_SHOT_MAX_READ_BYTES else "two_shot"


def all_reduce_kernel_cost(nbytes: float, group: Sequence[int], cluster: Cluster,
                           strategy: str | None = None, launch_us: float = 0.0,
                           options: CollectiveOptions = CollectiveOptions()) -> CollectiveCost:
    """Time of XLA:GPU's all-reduce kernel (module docstring) moving ``nbytes`` per device over
    ``group``; ``strategy`` ``"one_shot"``/``"two_shot"`` as XLA chose it (None: XLA's rule).
    A group spanning hosts has no such kernel (XLA uses NCCL there): ``collective_cost``."""
    n, hosts, _ = _placement(group, cluster)
    if n <= 1 or nbytes <= 0:
        return CollectiveCost(0.0, "none", "none", 0.0, 0.0)
    if hosts > 1:
        return collective_cost("all-reduce", nbytes, group, cluster, options)
    strategy = strategy or all_reduce_kernel_strategy(nbytes, n)
    if strategy not in KERNEL_STRATEGIES:
        raise ValueError(f"unknown all-reduce kernel strategy {strategy!r}; expected {KERNEL_STRATEGIES}")
    link = cluster.intra_link
    bw = link.bytes_per_s * options.link_efficiency
    rounds, moved = (1, (n - 1) * nbytes) if strategy == "one_shot" else (2, 2.0 * (n - 1) / n * nbytes)
    latency = launch_us + rounds * link.hop_us("ring")[0]
    return CollectiveCost(latency + 1e6 * moved / bw, "kernel", strategy, bw, latency)
