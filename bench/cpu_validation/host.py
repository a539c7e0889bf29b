"""The host's side of a CPU measurement: freed memory kept, page faults counted, one pinned core."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory mapped (``mallopt``), as a caching device allocator does.

    XLA:CPU allocates a program's temporary buffer per execution. glibc serves an
    allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
    unmaps it on free, so every execution first-touches every page again: the
    Evoformer block train step (32.9 MiB of temporaries) took 8,414 minor page faults
    per run (its whole buffer) and ~36 % longer than with this setting, time that no
    kernel measured alone contains. With ``M_MMAP_MAX=0`` and a 1 GiB trim threshold
    freed blocks stay in the heap and are reused, which is what the GPU runtime's BFC
    allocator does.

    Returns:
      True if both settings were accepted (False off glibc, with a warning).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 1 << 30))  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.warning("mallopt not available: large temporaries are mapped and faulted in per execution")
    return ok


def page_faults_per_run(run: Callable[[], object], repeats: int = 3) -> int:
    """Fewest minor page faults of the process during one call of ``run``."""
    import resource

    best = None
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run()
        n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        best = n if best is None else min(best, n)
    return int(best or 0)


def pin_to_one_cpu(cpu: int | None = None) -> int:
    """Restrict this process to one CPU core, so that XLA:CPU runs every kernel on one thread.

    ``--xla_cpu_multi_thread_eigen=false`` only affects Eigen: XLA:CPU still sizes its
    intra-op pool from the process's CPU affinity, splits loop fusions across it
    (``outer_dimension_partitions``), runs YNNPACK fusions (dots, reductions) on it and
    runs independent thunks concurrently. With one core in the affinity mask the pool has
    one thread and the compiler partitions nothing. Call before JAX creates its CPU client
    (threads made earlier keep their affinity).

    Args:
      cpu: the core; default the first one of the current affinity mask.

    Returns:
      The core the process is now restricted to.
    """
    import os
    import sys

    if cpu is None:
        cpu = min(os.sched_getaffinity(0))
    if "jax" in sys.modules:
        try:
            from concerto_jax import jax_compat

            if jax_compat.backends_initialized():
                log.warning("pin_to_one_cpu after JAX started: its thread pools keep their size")
        except (ImportError, AttributeError):
            pass
    os.sched_setaffinity(0, {cpu})
    return cpu
