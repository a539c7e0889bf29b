"""Run a Python module in several local processes joined by ``jax.distributed`` (CPU, gloo).

For tests, benchmarks and demos of multi-process behaviour on one machine:
each process gets ``--process-id``, ``--num-processes`` and ``--port`` (a free
loopback port for the coordinator) before the caller's own arguments, and runs
on the CPU. The worker is expected to call ``init_worker`` first.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import jax


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """What one local process printed and how it exited."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(module: str, args: Sequence[str] = (), *, num_processes: int = 2,
              timeout_s: float = 240.0) -> list[ProcessResult]:
    """Start ``python -m module`` ``num_processes`` times and wait for all of them.

    Raises:
      RuntimeError: a process exited non-zero or the timeout passed (all are killed);
        the message carries the tail of each failing process's stderr.
    """
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--process-id", str(i), "--num-processes",
             str(num_processes), "--port", str(port), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(num_processes)
    ]
    deadline = time.monotonic() + timeout_s
    results, errors = [], []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            errors.append(f"process {i} timed out after {timeout_s}s:\n{err[-3000:]}")
            continue
        results.append(ProcessResult(i, p.returncode, out, err))
        if p.returncode != 0:
            errors.append(f"process {i} exited with {p.returncode}:\n{err[-3000:]}")
    if errors:
        raise RuntimeError(f"{module} failed:\n" + "\n".join(errors))
    return results


def init_worker(process_id: int, num_processes: int, port: int, devices_per_process: int) -> None:
    """Join the local job: CPU devices, gloo collectives, ``jax.distributed.initialize``."""
    jax.config.update("jax_num_cpu_devices", devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id)
