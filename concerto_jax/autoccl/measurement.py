"""Robust aggregation of noisy step-time samples (median after MAD outlier rejection).

Online measurements inside a training loop are noisy: the first step after a
config change pays for compilation and cold caches, and other processes on
the machine (or a data-loader hiccup) produce occasional slow outliers.
The tuner therefore discards a few warm-up samples per config (``online.py``)
and reduces the rest with ``robust_time``: samples further than ``k`` scaled
median absolute deviations from the median are dropped, and the median of
what remains is the config's time.

References:
  AutoCCL NSDI'25 §4.3 (online profiling under interference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["SampleStats", "robust_time"]

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this = its standard deviation


@dataclasses.dataclass(frozen=True)
class SampleStats:
    """Summary of the samples of one config."""

    time: float  # robust estimate (median of the kept samples), seconds
    kept: int  # samples kept
    rejected: int  # samples rejected as outliers
    spread: float  # relative spread of the kept samples: (max - min) / median


def robust_time(samples: Sequence[float], k: float = 3.0) -> SampleStats:
    """Median of the samples after rejecting those more than ``k`` scaled MADs from the median.

    Args:
      samples: positive times in seconds (at least one).
      k: rejection threshold in robust standard deviations; ``inf`` keeps everything.

    Returns:
      The ``SampleStats``.

    Raises:
      ValueError: no samples.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        raise ValueError("robust_time needs at least one sample, got none.")
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med))) * _MAD_TO_SIGMA
    if x.size >= 3 and mad > 0 and np.isfinite(k):
        keep = np.abs(x - med) <= k * mad
    else:
        keep = np.ones_like(x, dtype=bool)
    kept = x[keep]
    t = float(np.median(kept))
    spread = float((kept.max() - kept.min()) / t) if t > 0 else 0.0
    return SampleStats(time=t, kept=int(keep.sum()), rejected=int((~keep).sum()), spread=spread)
