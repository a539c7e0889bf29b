"""Bucket plan: group an ordered list of gradient sizes into fused collectives of at most B bytes.

The bucket size is the knob that decides how many bytes go into one fused
collective: small buckets pay the per-collective latency many times, large
buckets delay the start of communication (less overlap) and need bigger
staging buffers. There is no universal optimum (Concerto ASPLOS'25 Fig. 2),
which is why it is tuned. This module is pure planning: it knows nothing
about JAX, so the data-parallel step (``dp_step.py``) and an HLO-level
fusion pass can share it.

Rules: buckets are contiguous runs of the given order (order = the order in
which gradients become ready); a bucket is closed when adding the next
gradient would exceed ``bucket_bytes``; a gradient larger than
``bucket_bytes`` forms a bucket of its own (it is never split).
``bucket_bytes <= 0`` means one bucket per gradient (no fusion).

References:
  AutoCCL NSDI'25 §5 (tuned parameters in training); Concerto ASPLOS'25 §4.3 (fusion).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Bucket", "plan_buckets"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One fused collective: a contiguous run of gradients."""

    indices: tuple[int, ...]  # positions in the input order
    nbytes: int  # total bytes

    def __repr__(self) -> str:
        return f"Bucket({self.indices[0]}..{self.indices[-1]}, {self.nbytes} B)"


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Groups ``sizes`` (bytes, in ready order) into buckets of at most ``bucket_bytes``.

    Args:
      sizes: byte size of every gradient, in the order they should be reduced.
      bucket_bytes: capacity B of a bucket; ``<= 0`` gives one bucket per gradient.

    Returns:
      Buckets covering every index exactly once, in order.

    Raises:
      ValueError: a negative size.
    """
    if any(int(s) < 0 for s in sizes):
        raise ValueError(f"gradient sizes must be >= 0 bytes, got {list(sizes)[:8]}...")
    buckets: list[Bucket] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, s in enumerate(int(s) for s in sizes):
        if cur and (bucket_bytes <= 0 or cur_bytes + s > bucket_bytes):
            buckets.append(Bucket(tuple(cur), cur_bytes))
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += s
    if cur:
        buckets.append(Bucket(tuple(cur), cur_bytes))
    return buckets
