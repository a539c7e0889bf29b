"""Where tuned values go: XLA compiler options / XLA_FLAGS and NCCL environment variables.

* Bucket sizes. On GPU, XLA fuses collectives up to
  ``xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes``
  (those thresholds *are* bucket sizes). XLA:CPU has no threshold; its pass
  ``cpu-all-reduce-combiner`` merges every independent all-reduce, so for a
  chosen bucket plan to survive it must be disabled
  (``xla_disable_hlo_passes=cpu-all-reduce-combiner``) and the bucketing is
  done in the program (``dp_step.py``).
* NCCL settings, process-wide, from the environment: ``NCCL_ALGO``,
  ``NCCL_PROTO``, ``NCCL_MIN_CTAS``/``NCCL_MAX_CTAS`` (channels),
  ``NCCL_NTHREADS``, ``NCCL_BUFFSIZE`` and the transport switches. They are
  read when a communicator is created, so they must be set before JAX
  initialises its GPU backend (a new process, in practice). Per-collective
  choices go through the tuner plugin instead (``plugin.py``).

References:
  AutoCCL NSDI'25 §4.1 (parameters), §5 (implementation on NCCL).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "COMMAND_BUFFER_FLAG",
    "CPU_COMBINER_PASS",
    "XLA_DEFAULT_COMMAND_BUFFER",
    "command_buffer_options",
    "cpu_compiler_options",
    "gpu_combine_threshold_options",
    "nccl_env",
    "xla_flags",
]

CPU_COMBINER_PASS = "cpu-all-reduce-combiner"
_GPU_THRESHOLD = {
    "all-reduce": "xla_gpu_all_reduce_combine_threshold_bytes",
    "all-gather": "xla_gpu_all_gather_combine_threshold_bytes",
    "reduce-scatter": "xla_gpu_reduce_scatter_combine_threshold_bytes",
}
NCCL_STEPS = 8  # NCCL splits its per-peer buffer into this many steps (chunks)
COMMAND_BUFFER_FLAG = "xla_gpu_enable_command_buffer"
# XLA:GPU's default command-buffer types (xla/debug_options_flags.cc of the XLA in jaxlib 0.10.x;
# COLLECTIVES is not among them, so by default collectives already run outside CUDA graphs).
XLA_DEFAULT_COMMAND_BUFFER = (
    "FUSION",
    "CUBLAS",
    "CUBLASLT",
    "CUSTOM_CALL",
    "CUDNN",
    "DYNAMIC_SLICE_FUSION",
)
# types that can capture an NCCL call (a captured call keeps the config chosen at capture)
_COLLECTIVE_COMMANDS = ("COLLECTIVES", "DYNAMIC_SLICE_COPY_FUSION")


def command_buffer_options(
    user_options: Mapping[str, Any] | None = None, tuning: bool = True
) -> dict[str, Any]:
    """Compiler options that keep collectives out of XLA's command buffers while tuning.

    NCCL asks the tuner plugin once per collective *launch*; a collective
    captured in a CUDA graph (XLA command buffer) replays the configuration
    chosen at capture, so a live table would not reach it. While tuning, the
    command-buffer types are the user's (or XLA's default) minus
    ``COLLECTIVES``; once frozen, the user's options are returned unchanged
    (their setting restored; the step is compiled once more, see README).

    Args:
      user_options: the compiler options the user compiles the step with.
      tuning: True while tuning, False once frozen.

    Returns:
      The compiler options for this phase (a new dict).

    Raises:
      ValueError: the user's value is not a comma-separated list of type names.
    """
    opts = dict(user_options or {})
    if not tuning:
        return opts
    value = opts.get(COMMAND_BUFFER_FLAG)
    if value is None:
        types = list(XLA_DEFAULT_COMMAND_BUFFER)
    elif isinstance(value, str):
        types = [t.strip().upper() for t in value.split(",") if t.strip()]
    else:
        raise ValueError(
            f"{COMMAND_BUFFER_FLAG} must be a comma-separated string of command types, "
            f"got {value!r}; e.g. 'FUSION,CUBLAS'."
        )
    opts[COMMAND_BUFFER_FLAG] = ",".join(t for t in types if t not in _COLLECTIVE_COMMANDS)
    return opts


def gpu_combine_threshold_options(thresholds: Mapping[str, int]) -> dict[str, int]:
    """Compiler options for XLA:GPU combine thresholds.

    Args:
      thresholds: bytes per collective kind, keys among "all-reduce",
        "all-gather", "reduce-scatter".

    Returns:
      ``{"xla_gpu_all_reduce_combine_threshold_bytes": ..., ...}`` for
      ``lowered.compile(compiler_options=...)``.

    Raises:
      ValueError: unknown collective kind or negative size.
    """
    out = {}
    for kind, nbytes in thresholds.items():
        if kind not in _GPU_THRESHOLD:
            raise ValueError(
                f"unknown collective {kind!r}; expected one of {sorted(_GPU_THRESHOLD)}."
            )
        if int(nbytes) < 0:
            raise ValueError(f"threshold for {kind} must be >= 0 bytes, got {nbytes}.")
        out[_GPU_THRESHOLD[kind]] = int(nbytes)
    return out


def cpu_compiler_options(disable_combiner: bool = True) -> dict[str, Any]:
    """Compiler options for XLA:CPU that keep our bucket plan (combiner pass off)."""
    return {"xla_disable_hlo_passes": CPU_COMBINER_PASS} if disable_combiner else {}


def xla_flags(options: Mapping[str, Any]) -> str:
    """Renders compiler options as an ``XLA_FLAGS`` string (``--name=value`` ...)."""
    parts = []
    for k, v in options.items():
        v = ("true" if v else "false") if isinstance(v, bool) else v
        parts.append(f"--{k}={v}")
    return " ".join(parts)


def nccl_env(config: Mapping[str, Any]) -> dict[str, str]:
    """NCCL environment variables for a config of ``nccl_model.NCCL_SPACE`` shape.

    Keys used (each optional): ``algorithm`` ("Ring"/"Tree"), ``protocol``
    ("LL"/"LL128"/"Simple"), ``transport`` ("P2P" disables SHM, "SHM"
    disables P2P), ``nchannels`` (min = max CTAs), ``nthreads``,
    ``chunk_bytes`` (NCCL has no chunk-size variable; the buffer is
    ``NCCL_STEPS`` chunks, so ``NCCL_BUFFSIZE = 8 * chunk_bytes``).

    Returns:
      Environment entries to set before the GPU backend starts.
    """
    env: dict[str, str] = {}
    if "algorithm" in config:
        env["NCCL_ALGO"] = str(config["algorithm"])
    if "protocol" in config:
        env["NCCL_PROTO"] = str(config["protocol"])
    if config.get("transport") == "P2P":
        env["NCCL_SHM_DISABLE"] = "1"
    elif config.get("transport") == "SHM":
        env["NCCL_P2P_DISABLE"] = "1"
    if "nchannels" in config:
        env["NCCL_MIN_CTAS"] = env["NCCL_MAX_CTAS"] = str(int(config["nchannels"]))
    if "nthreads" in config:
        env["NCCL_NTHREADS"] = str(int(config["nthreads"]))
    if "chunk_bytes" in config:
        env["NCCL_BUFFSIZE"] = str(int(config["chunk_bytes"]) * NCCL_STEPS)
    return env
