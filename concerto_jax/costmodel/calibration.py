"""Kernel rates fitted to kernels measured on a GPU type: the cost model's defaults there.

The datasheet defaults of ``ComputeOptions`` (GEMMs at 0.7 of tensor-core peak, streaming
kernels at 0.8 of HBM bandwidth, 2 µs per kernel) are configured figures. A ``Calibration``
replaces them for one GPU type with figures fitted to that GPU's own kernels, and says where
they come from. ``CostModel`` takes them by default for a cluster of that GPU
(``defaults_for``); ``CostOptions(calibrated=False)`` keeps the datasheet figures.

How the H200 figures were made (``docs/DECISIONS.md`` D44; the tables in
``bench/results/gpu/h200-2026-11-28/fit/``): the nine suite cases' per-device programs, stock
XLA's and ours, compiled on one H200 with XLA's autotuning (jax 0.11.2), collectives stood in,
every kernel timed from a profile (command buffers off) and every step timed with XLA's defaults.
``python -m bench.gpu.fit_calibration`` fits, per kernel class, the achieved fraction of the
peak rate and a fixed time per kernel on five cases, and reports the error on the other four.
The time a whole step spends outside its kernels (launch gaps, with command buffers as XLA uses
them by default) is charged in two parts (D52): a marginal cost per kernel, the figure at which
the model reproduces the compute a split adds on the GPU (``bench/gpu/split_cost_model.py``),
and a time per step, the median of the measured steps less their kernels' price (the fit's
"two-term step model"). Charged all per kernel (5.7 us before D52) it priced a split's kernels
at about three times what the GPU showed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from concerto_jax.costmodel.compute import ComputeOptions
from concerto_jax.costmodel.specs import GpuSpec


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Kernel rates of one GPU type, fitted to measured kernels.

    Attributes:
      gpu_names: the ``GpuSpec.name`` values it applies to.
      compute: the fitted ``ComputeOptions``.
      measured: what was measured, where and with what.
      fit: the command that fitted the figures, and where its tables are.
      not_modelled: what the measurements showed that these figures do not capture.
    """

    gpu_names: tuple[str, ...]
    compute: ComputeOptions
    measured: str
    fit: str
    not_modelled: str = ""

    def provenance(self) -> str:
        return f"{self.measured}; {self.fit}"


H200 = Calibration(
    gpu_names=("NVIDIA H200 SXM 141GB",),
    compute=ComputeOptions(
        matmul_efficiency=0.84,       # cuBLAS/Triton GEMMs, fixed 1.6 us (621 kernels fitted)
        convolution_efficiency=0.75,  # cuDNN convolutions (Wide-ResNet only: no held-out case)
        reduction_efficiency=0.74,    # XLA's reduction emitter, fixed 1.8 us
        memory_efficiency=0.85,       # loop fusions, fixed 1.3 us; copies and the rest
        # the marginal cost of a kernel: the figure at which the model, with the time per step
        # below, reproduces the compute a split adds (split probe, two compiles each, command
        # buffers on: Evoformer 2.55 us, TP NVLink 2.07 us; split-model-2/, D52)
        launch_overhead_us=2.5,
        # the rest of a step's time outside its kernels, once per step: the median over the 18
        # programs of the step (XLA's defaults) less its kernels' price at 2.5 us each (D52)
        step_overhead_us=1096.0,
    ),
    measured=("one NVIDIA H200 (CUDA driver 13.0), jax/jaxlib 0.11.2, 2026-11-27 and 2026-11-28: the nine "
              "suite cases' per-device programs (stock and ours) compiled with XLA's autotuning, "
              "collectives stood in, 5,474 kernel rows (bench/results/gpu/h200-2026-11-28/calibration-*)"),
    fit=("python -m bench.gpu.fit_calibration calibration-2 calibration-3 calibration-4 calibration-5 "
         "--out fit (fitted on five cases, errors on the four held out: bench/results/gpu/h200-2026-11-28/fit/); "
         "per kernel: the split probe's figure (bench/results/gpu/h200-2026-11-28/split-model-2/)"),
    not_modelled=("transposes XLA emits with several outputs (an optimizer's update of a convolution "
                  "kernel stored in another layout) ran 4-6x slower than HBM bandwidth allows; atomic "
                  "scatters 4-8x; the time per step is one figure for every program, where what the measured "
                  "steps leave beyond their kernels' price runs from 840 to 1,530 us on 12 of the 18 "
                  "programs and 2,470-3,420 us on Evoformer's and TP PCIe's (12,000 on Wide-ResNet's: "
                  "its transposes)"),
)

CALIBRATIONS: tuple[Calibration, ...] = (H200,)
"""Every GPU type with measured kernel rates."""


def for_gpu(gpu: GpuSpec) -> Calibration | None:
    """The calibration of ``gpu``'s type, or None (its datasheet defaults stand)."""
    return next((c for c in CALIBRATIONS if gpu.name in c.gpu_names), None)


def defaults_for(gpu: GpuSpec) -> ComputeOptions:
    """The ``ComputeOptions`` a cost model of ``gpu`` starts from: the calibration of its type
    where there is one, else the datasheet defaults."""
    c = for_gpu(gpu)
    return c.compute if c is not None else ComputeOptions()


def rebase(compute: ComputeOptions, gpu: GpuSpec, set_on_purpose: Sequence[str] | None = None) -> ComputeOptions:
    """``compute`` on ``gpu``: the figures named in ``set_on_purpose`` as they are (None: those
    that differ from the datasheet defaults), the others from ``gpu``'s calibration (a
    plausible-model variant such as "launches at 4 us" changes one figure of whatever model is
    nominal there)."""
    base = defaults_for(gpu)
    if base == ComputeOptions():
        return compute
    names = {f.name for f in dataclasses.fields(ComputeOptions)}
    if set_on_purpose is None:
        default = ComputeOptions()
        set_on_purpose = [n for n in names if getattr(compute, n) != getattr(default, n)]
    unknown = sorted(set(set_on_purpose) - names)
    if unknown:
        raise ValueError(f"compute_set names {unknown}, which are not ComputeOptions fields "
                         f"(expected some of {sorted(names)})")
    changed = {n: getattr(compute, n) for n in set_on_purpose}
    return dataclasses.replace(base, **changed)
