"""The README's main job (`python -m concerto_jax`) runs, checks bitwise equality and stays on the CPU."""

import os
import subprocess
import sys


def test_main_job_runs_on_cpu_and_reports():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "concerto_jax", "--no-baseline", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "bitwise equal to the original: True" in proc.stdout
    assert "status: " in proc.stdout and "FELL BACK" not in proc.stdout
    # The GPU plugin is only used deviceless; it must not be started as a backend.
    assert "Jax plugin configuration error" not in out
