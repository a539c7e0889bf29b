"""Synthetic NCCL performance model (alpha-beta + AutoCCL's two-phase bottleneck), for benches and tests.

This is *not* the project's cost model (that lives in ``concerto_jax/costmodel``);
it is a small, self-contained stand-in that gives the tuner a surface with the
shape AutoCCL measured on real GPUs, so that the search can be exercised and
benchmarked on a CPU-only machine. Every number below is an assumption.

Assumptions (stated so they can be attacked):

* Time of one collective = ``steps * (link latency + protocol latency)``
  + ``traffic / bandwidth``, the classic alpha-beta form.
  Traffic per rank on the bottleneck link: ring all-reduce ``2(n-1)/n * M``,
  ring all-gather / reduce-scatter ``(n-1)/n * M``; tree all-reduce ``2 * M``
  with ``2 log2 n`` latency steps (NCCL's double binary tree); tree is not
  offered for all-gather / reduce-scatter (time = inf, as in NCCL).
* Protocols trade latency for bandwidth: LL (8-byte flag words, 50 % of the
  link), LL128 (~94 %), Simple (100 %, highest latency).
* Transport: P2P uses the link directly; SHM stages through host memory
  (lower bandwidth, higher latency, but a congestion knee that is 1.5x further out).
* Resource parameters follow AutoCCL §4.2's two-phase bottleneck model,
  ``bw = min(bw_transport(NC, C), bw_protocol(NC, NT))``. Transport:
  ``x / (alpha + x/B + x^2/(B*K))`` with ``x = NC*C`` bytes in flight
  (latency-bound for small ``x``, then saturating, then falling once
  congestion sets in past the knee ``K``); protocol: ``r*y / (1 + (y/K_p)^2)``
  with ``y = NC*NT`` threads. Both unimodal in each of NC (channels), NT
  (threads), C (chunk bytes). A chunk larger than
  a channel's share of the message is only partly filled.
* Compute interference (``interference`` in [0, 1]) takes SMs away from the
  protocol phase (its throughput scales by ``1 - 0.5*interference``) and moves
  its congestion knee in, which moves the optimum: what a static model tuned
  without interference gets wrong (AutoCCL §2.3 / Table (b) of the slides).
* "NCCL default" = algorithm/protocol/transport chosen by minimising this very
  model without interference at NCCL's default resources (channels per link
  type, 512 threads, 512 KiB chunks = 4 MiB buffer / 8 steps), i.e. a
  well-informed static choice, not a strawman.

References:
  AutoCCL NSDI'25 §4.2 (two-phase bottleneck model, unimodality), §2.3.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from concerto_jax.autoccl.space import (
    Choice,
    Config,
    IntGrid,
    SearchSpace,
    geometric_grid,
    linear_grid,
)

__all__ = [
    "ClusterSpec",
    "NCCL_SPACE",
    "nccl_default_config",
    "nccl_time",
    "nccl_time_grid",
    "H100_NVLINK_8",
    "A40_PCIE_2x8",
]

_PROTO = {  # name: (bandwidth efficiency, latency per step [s])
    "LL": (0.50, 0.6e-6),
    "LL128": (0.94, 1.1e-6),
    "Simple": (1.00, 4.0e-6),
}
_TRANSPORT = {  # name: (bandwidth factor, latency factor, congestion-knee factor)
    "P2P": (1.00, 1.0, 1.0),
    "SHM": (0.70, 1.6, 1.5),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Hardware assumed by the synthetic model."""

    name: str  # label used in reports
    n_ranks: int  # GPUs in the communicator
    link_bw: float  # bottleneck link bandwidth per rank, bytes/s (unidirectional)
    link_latency: float  # per-step latency of the bottleneck link, seconds
    default_channels: int  # channels NCCL picks by default on this system
    alpha_transport: float = 6e-6  # per-round overhead of the transport phase, seconds
    knee_transport: float = 24 * 1024 * 1024  # bytes in flight (NC*C) where congestion starts
    proto_rate: float = (
        0.05e9  # protocol-phase throughput per thread, bytes/s (~25 GB/s per 512-thread CTA)
    )
    knee_protocol: float = 24 * 1024  # NC*NT where SM/memory contention starts (peak of that phase)


H100_NVLINK_8 = ClusterSpec(
    "8xH100-NVLink",
    8,
    370e9,
    1.0e-6,
    default_channels=16,
    alpha_transport=2e-6,
    knee_transport=64 * 1024 * 1024,
)
A40_PCIE_2x8 = ClusterSpec(
    "2x8xA40-PCIe-IB",
    16,
    12.5e9,
    5.0e-6,
    default_channels=4,
    knee_transport=6 * 1024 * 1024,
    proto_rate=0.03e9,
    knee_protocol=6 * 1024,
)

NCCL_SPACE = SearchSpace(
    strategy=(
        Choice("algorithm", ("Ring", "Tree")),
        Choice("protocol", ("LL", "LL128", "Simple")),
        Choice("transport", ("P2P", "SHM")),
    ),
    resources=(
        IntGrid("nchannels", linear_grid(1, 64), default=16),
        IntGrid("nthreads", linear_grid(64, 640, 32), default=512),
        IntGrid("chunk_bytes", geometric_grid(4096, 4 << 20, math.sqrt(2)), default=512 * 1024),
    ),
)


def _bottleneck(x, alpha, b, knee):
    return x / (alpha + x / b + x * x / (b * knee))


def nccl_time_grid(
    cluster: ClusterSpec,
    collective: str,
    nbytes: int,
    algorithm: str,
    protocol: str,
    transport: str,
    nchannels,
    nthreads,
    chunk_bytes,
    interference: float = 0.0,
):
    """Model time (seconds); the resource arguments may be numpy arrays (broadcast).

    Args:
      cluster: hardware assumptions.
      collective: "all-reduce", "all-gather" or "reduce-scatter".
      nbytes: message size M in bytes (all-gather: the gathered output).
      algorithm, protocol, transport: strategy values of ``NCCL_SPACE``.
      nchannels, nthreads, chunk_bytes: resource values (scalars or arrays).
      interference: compute interference in [0, 1].

    Returns:
      Time in seconds (float or array); ``inf`` where the combination is not offered.
    """
    n = cluster.n_ranks
    if collective == "all-reduce":
        ring_traffic, ring_steps = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    elif collective in ("all-gather", "reduce-scatter"):
        ring_traffic, ring_steps = (n - 1) / n * nbytes, n - 1
    else:
        raise ValueError(
            f"collective must be all-reduce, all-gather or reduce-scatter, got {collective!r}."
        )
    if algorithm == "Ring":
        traffic, steps = ring_traffic, ring_steps
    elif algorithm == "Tree":
        if collective != "all-reduce":
            return np.full(np.broadcast(nchannels, nthreads, chunk_bytes).shape, np.inf)[()]
        traffic, steps = 2.0 * nbytes, 2 * math.ceil(math.log2(n))
    else:
        raise ValueError(f"algorithm must be Ring or Tree, got {algorithm!r}.")
    eff, proto_lat = _PROTO[protocol]
    t_bw, t_lat, t_knee = _TRANSPORT[transport]
    nc = np.asarray(nchannels, dtype=np.float64)
    nt = np.asarray(nthreads, dtype=np.float64)
    c = np.asarray(chunk_bytes, dtype=np.float64)
    per_channel = traffic / nc / max(steps, 1)  # bytes one channel moves per step
    filled = np.minimum(c, np.maximum(per_channel, 1.0))
    bw_t = _bottleneck(
        nc * filled,
        cluster.alpha_transport,
        cluster.link_bw * t_bw,
        cluster.knee_transport * t_knee,
    )
    rate = cluster.proto_rate * (1.0 - 0.5 * interference)
    knee_p = cluster.knee_protocol * (1.0 - 0.4 * interference)
    y = nc * nt  # threads working on the protocol phase
    bw_p = y * rate / (1.0 + (y / knee_p) ** 2)  # peaks at y = knee_p
    bw = np.minimum(bw_t, bw_p) * eff
    latency = steps * (cluster.link_latency * t_lat + proto_lat)
    return (latency + traffic / bw)[()]


def nccl_time(
    cluster: ClusterSpec, collective: str, nbytes: int, config: Config, interference: float = 0.0
) -> float:
    """Model time (seconds) of one ``NCCL_SPACE`` config."""
    return float(
        nccl_time_grid(
            cluster,
            collective,
            nbytes,
            config["algorithm"],
            config["protocol"],
            config["transport"],
            config["nchannels"],
            config["nthreads"],
            config["chunk_bytes"],
            interference,
        )
    )


def nccl_default_config(cluster: ClusterSpec, collective: str, nbytes: int) -> Config:
    """What a static NCCL-like cost model picks: best strategy at default resources, no interference."""
    base = {"nchannels": cluster.default_channels, "nthreads": 512, "chunk_bytes": 512 * 1024}
    best = None
    for sub in NCCL_SPACE.subspaces():
        cfg = Config({**dict(sub), **base})
        t = nccl_time(cluster, collective, nbytes, cfg)
        if best is None or t < best[0]:
            best = (t, cfg)
    return best[1]
