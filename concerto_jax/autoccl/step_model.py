"""A data-parallel step on the synthetic NCCL model: buckets, overlap with backward, plugin rules.

Stands in for a GPU in tests and benches (no GPU is needed): the backward pass
produces gradients one after the other; XLA's combiner fuses consecutive
gradients into all-reduces of at most the combine threshold (``plan_buckets``);
a bucket can start once its last gradient is ready and the previous collective
is done (one communication stream); each collective takes
``nccl_model.nccl_time`` under the configuration the plugin's table gives it
(matched exactly as the C plugin does: first rule, size class, communicator
size, occurrence), with compute interference while the backward pass still
runs. Step time = max(backward end, last collective end) + optimizer update.

What it shows: small thresholds pay NCCL's per-collective latency many times,
large ones start communicating late and lose overlap (the bucket-size
trade-off), and the best (algorithm, protocol, channels) depends on each
collective's size and on interference (AutoCCL §2.3).

References:
  AutoCCL NSDI'25 §2.3, §4.2; Concerto ASPLOS'25 §4.3 (fusion vs overlap).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from concerto_jax.autoccl import nccl_model, plugin
from concerto_jax.autoccl.buckets import plan_buckets
from concerto_jax.autoccl.collectives import CollectiveKey, CollectiveSite, assign_keys
from concerto_jax.autoccl.nccl_online import CHANNEL_GRID, key_space

__all__ = ["MODEL_STEPS", "ModelStep", "match_row"]

_BASE = {"transport": "P2P", "nthreads": 512, "chunk_bytes": 512 * 1024}


@functools.lru_cache(maxsize=65536)
def _default_config(cluster: nccl_model.ClusterSpec, nbytes: int):
    return nccl_model.nccl_default_config(cluster, "all-reduce", nbytes)


def match_row(
    rows: Sequence[plugin.TableRow], kind: str, nbytes: int, nranks: int, occurrence: int
) -> plugin.TableRow | None:
    """The rule the C plugin would apply (first match), or None (NCCL's defaults)."""
    for r in rows:
        if r.collective not in ("*", kind) or not r.min_bytes <= nbytes <= r.max_bytes:
            continue
        if r.nranks is not None and r.nranks != nranks:
            continue
        if r.occurrence is not None and occurrence % r.occurrence[1] != r.occurrence[0]:
            continue
        return r
    return None


@dataclasses.dataclass(frozen=True)
class ModelStep:
    """One modelled data-parallel training step."""

    name: str  # label in reports
    cluster: nccl_model.ClusterSpec  # hardware of the NCCL model
    grad_bytes: tuple[int, ...]  # gradient sizes in the order backward produces them
    backward_s: float  # backward compute time, spread over gradients in proportion to size
    optimizer_s: float = 0.0  # update after the last gradient is reduced
    interference: float = 0.3  # compute interference on collectives that overlap backward

    def collectives(self, threshold: int) -> list[tuple[int, float]]:
        """(bytes, ready time) of each all-reduce for an XLA combine threshold."""
        sizes = list(self.grad_bytes)
        ready = np.cumsum(sizes) / sum(sizes) * self.backward_s
        return [(b.nbytes, float(ready[b.indices[-1]])) for b in plan_buckets(sizes, threshold)]

    def sites(self, threshold: int) -> list[CollectiveSite]:
        n = self.cluster.n_ranks
        return [
            CollectiveSite("all-reduce", nb, n, "dp", True) for nb, _ in self.collectives(threshold)
        ]

    def keys_for(self, thresholds: dict[str, int]):
        """``NcclTuningLoop.keys_for`` for this model: keys and bytes per key."""
        sites = self.sites(thresholds["all-reduce"])
        keys = assign_keys(sites)
        traffic: dict[CollectiveKey, int] = {}
        for k, s in zip(keys, sites, strict=True):
            traffic[k] = traffic.get(k, 0) + s.nbytes
        return keys, traffic

    def _config(self, row: plugin.TableRow | None, nbytes: int) -> dict:
        default = _default_config(self.cluster, nbytes)
        cfg = {**_BASE, "algorithm": default["algorithm"], "protocol": default["protocol"]}
        cfg["nchannels"] = self.cluster.default_channels
        if row is not None:
            if row.algorithm is not None:
                cfg["algorithm"], cfg["protocol"] = row.algorithm, row.protocol
            if row.channels > 0:
                cfg["nchannels"] = row.channels
        return cfg

    def comm_time(self, nbytes: int, cfg: dict, overlapped: bool) -> float:
        itf = self.interference if overlapped else 0.0
        return nccl_model.nccl_time(self.cluster, "all-reduce", nbytes, cfg, itf)

    def step_time(self, thresholds: dict[str, int], rows: Sequence[plugin.TableRow] = ()) -> float:
        """Modelled step time (seconds) with these thresholds and plugin rules."""
        t_comm, seen = 0.0, {}
        for nbytes, ready in self.collectives(thresholds["all-reduce"]):
            cls = plugin.size_class(nbytes)
            occ = seen.get(cls, 0)
            seen[cls] = occ + 1
            row = match_row(rows, "all-reduce", nbytes, self.cluster.n_ranks, occ)
            dur = self.comm_time(nbytes, self._config(row, nbytes), ready < self.backward_s)
            t_comm = max(t_comm, ready) + dur
        return max(t_comm, self.backward_s) + self.optimizer_s

    def exhaustive_optimum(self, thresholds: Sequence[int]) -> tuple[float, int]:
        """Lower bound: best threshold with *every collective* at its own best configuration.

        A collective's duration does not depend on the others' (interference is fixed by its
        ready time), and the step time only grows with any duration, so per-collective minima
        give the optimum for a threshold; keys that share a rule can only do worse.
        """
        best = (float("inf"), -1)
        space = key_space("all-reduce")
        for th in thresholds:
            t_comm = 0.0
            for nbytes, ready in self.collectives(th):
                durs = []
                for sub in space.subspaces():
                    for ch in CHANNEL_GRID:
                        ap = sub["algo_proto"]
                        row = None
                        if ap != "nccl" or ch:
                            a, p = (None, None) if ap == "nccl" else ap.split("/")
                            row = plugin.TableRow("all-reduce", 0, plugin.MAX_BYTES, a, p, ch)
                        durs.append(
                            self.comm_time(
                                nbytes, self._config(row, nbytes), ready < self.backward_s
                            )
                        )
                t_comm = max(t_comm, ready) + min(durs)
            t = max(t_comm, self.backward_s) + self.optimizer_s
            best = min(best, (t, th))
        return best


def _random_sizes(seed: int, n: int, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(lo, hi, n))


# Modelled DP steps used by the tests and by ``bench/autoccl_bench.py --suite gpu-model``.
MODEL_STEPS = (
    ModelStep(
        "gpt dp8 H100",
        nccl_model.H100_NVLINK_8,
        (4 << 20, 16 << 20, 16 << 20, 4 << 20) * 24,
        0.060,
        0.002,
        0.3,
    ),
    ModelStep(
        "resnet dp16 A40",
        nccl_model.A40_PCIE_2x8,
        _random_sizes(0, 160, 8 << 10, 9 << 20),
        0.120,
        0.003,
        0.3,
    ),
    ModelStep(
        "small mlp dp8 H100", nccl_model.H100_NVLINK_8, (256 << 10,) * 64, 0.004, 0.0005, 0.5
    ),
    ModelStep(
        "bert dp16 A40",
        nccl_model.A40_PCIE_2x8,
        (9 << 20, 9 << 20, 36 << 20, 36 << 20) * 12,
        0.150,
        0.004,
        0.5,
    ),
)
