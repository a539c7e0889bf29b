"""``python -m concerto_jax.gpu_check --out DIR``: the GPU route checked on the machine at hand.

One prepared command for a GPU machine (at most ``--budget-s``, 480 s by default, with that
machine's own JAX), that also runs on a CPU machine, where it does the deviceless half and says
what it skipped. Every check is a row of ``DIR/checks.csv`` and ``DIR/checks.md`` (status
``pass``, ``FAIL`` or ``skipped: why``); the command exits non-zero on any ``FAIL``.

CPU half (any machine with the CUDA plugin; ``JAX_PLATFORMS=cpu``, 8 CPU devices):

* ``deviceless/<case>``: the route's compile stages for a suite case without a GPU
  (``gpu_route.compile_deviceless``): stock compile, our order of XLA's scheduled module,
  backend-only compile, ``PJRT_Executable_Serialize``; the bytes are the plugin's framing, the
  backend kept our order, and the load's checks accept them for that target only.
* ``rehearsal/*``: the JAX side of the load with CPU executables (``gpu_route.CpuRehearsal``):
  3 steps bitwise equal with donation, host callbacks, the step's device assignment put back.
* ``negative/*``: raw bytes without a header, another device count, another compute
  capability: a clear error before the runtime sees the bytes, and a fallback.

GPU half (``jax.default_backend() == "gpu"``, one GPU):

* ``a/<step>``: the full route (``optimize``) on 1-device GPT-block train steps with AdamW
  (f32, bf16, one with a host callback, one with donation): 3 steps bitwise equal to plain
  ``jax.jit`` on the same GPU, the route used (no fallback), our entry order present in the
  loaded executable's module; plus a deliberately different legal order (``perturbed``) that
  must survive too.
* ``b/*``: the negative cases on the real client (each in a subprocess, so that an abort is a
  FAIL, not the end of the run).
* ``c/<case>``: kernel calibration. Per suite case, XLA's scheduled module of stock and of ours
  (prepared here or on a CPU machine with ``--prepare``), every collective replaced by a local
  stand-in of the same output shape (``standin_collectives``: no communication), compiled
  backend-only for the single GPU, run and timed per kernel with the profiler: per kernel class,
  the cost model's error; per case, the compute-only step time of ours vs stock, measured
  against predicted (the extra compute our decomposition adds). Rows in ``DIR/kernels.csv``,
  ``DIR/calibration.csv`` and ``.md``; the raw profiles under ``DIR/profile``.

Progress goes through logging (``--log-level``).
"""

from concerto_jax.gpu_check.check import main

__all__ = ["main"]
