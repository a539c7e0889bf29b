"""Benchmark cases (model x layout x target cluster) as frozen dataclasses, with a legend.

Legend (the Concerto paper's settings, shrunk so that each step compiles
deviceless in well under a minute on a 2-core CPU):

=====================  =========================================================
case                   what it is
=====================  =========================================================
gpt_tp8_nvlink         GPT h=2048 (0.9B preset) x 2 layers, Megatron TP=8, bf16, 8x H100 SXM (NVLink)
gpt_tp8_pcie_fp32      same model in fp32, TP=8, 8x H100 PCIe (no NVLink: PCIe Gen5)
gpt_dp2_tp8_2hosts     GPT h=2048 x 2 layers, DP=2 across hosts x TP=8 in a host, 2x8 H100 SXM
gpt_zero3_8            GPT h=2048 x 2 layers, ZeRO-3/FSDP over 8x H100 SXM
gpt_zero3_16           GPT h=2048 x 2 layers, ZeRO-3/FSDP over 2x8 H100 SXM (network between hosts)
vit_dp8                ViT h=2048 (vit_0_8b preset) x 2 layers, DP=8, 8x A100 80GB (cuBLAS GEMMs)
evoformer_dap8         Evoformer (evoformer_0_04b preset) x 1 block, DAP=8, 8x H100 SXM
wideresnet_dp8         WideResNet (wideresnet_1_2b preset), one block per stage, DP=8, 8x A100 80GB
moe_ep8                MoE decoder d=2048, 8 experts of width 5632 (moe_8x_d2048) x 2 layers, expert
                       parallel EP=8 (dispatch and combine by all-to-all), bf16, 8x H100 SXM
=====================  =========================================================

The paper uses 18 GPT layers; every layer has the same collectives, so 2
layers show the same overlap opportunities at 1/9 of the compile time. Global
batch and sequence length are the presets' (GPT: 16 x 1024 tokens). A case
whose model is not registered in ``models`` yet is reported as skipped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One benchmark case.

    Attributes:
      name: short unique name (CSV key, ``--case``).
      model: key of ``models.registry.MODELS``.
      layout: key of ``models.layouts.LAYOUTS``.
      cluster: key of ``concerto_jax.costmodel.CLUSTERS``.
      mesh_shape: one size per layout mesh axis (outermost first).
      config: preset name of the model; None takes the model's first non-tiny preset.
      overrides: config fields to replace (only those the config has), e.g. fewer layers.
      dtype: activation/matmul dtype override (``"bfloat16"``, ``"float32"``) or None.
      xla_options: extra XLA compile options for this case (Python bools where boolean).
      note: one line for the legend.
    """

    name: str
    model: str
    layout: str
    cluster: str
    mesh_shape: tuple[int, ...]
    config: str | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    dtype: str | None = None
    xla_options: tuple[tuple[str, object], ...] = ()
    note: str = ""


_FEW_LAYERS = (("num_layers", 2),)

SUITE: tuple[BenchCase, ...] = (
    BenchCase(name="gpt_tp8_nvlink", model="gpt", layout="tp", cluster="h100_sxm_8", mesh_shape=(8,),
              config="gpt_0_9b", overrides=_FEW_LAYERS, dtype="bfloat16", note="Megatron TP=8 with NVLink, bf16"),
    BenchCase(name="gpt_tp8_pcie_fp32", model="gpt", layout="tp", cluster="h100_pcie_8", mesh_shape=(8,),
              config="gpt_0_9b", overrides=_FEW_LAYERS, dtype="float32", note="TP=8 without NVLink, fp32"),
    BenchCase(name="gpt_dp2_tp8_2hosts", model="gpt", layout="dp_tp", cluster="h100_sxm_2x8", mesh_shape=(2, 8),
              config="gpt_0_9b", overrides=_FEW_LAYERS, dtype="bfloat16",
              note="DP across 2 hosts x TP=8 inside each"),
    BenchCase(name="gpt_zero3_8", model="gpt", layout="zero3", cluster="h100_sxm_8", mesh_shape=(8,),
              config="gpt_0_9b", overrides=_FEW_LAYERS, dtype="bfloat16", note="ZeRO-3 on 8 GPUs"),
    BenchCase(name="gpt_zero3_16", model="gpt", layout="zero3", cluster="h100_sxm_2x8", mesh_shape=(16,),
              config="gpt_0_9b", overrides=_FEW_LAYERS, dtype="bfloat16", note="ZeRO-3 on 16 GPUs over 2 hosts"),
    # Deviceless XLA cannot autotune; its default Triton GEMM tiling rejects some ViT dots on A100,
    # so this case uses cuBLAS GEMMs (the cost model costs both the same way).
    BenchCase(name="vit_dp8", model="vit", layout="dp", cluster="a100_80_8", mesh_shape=(8,),
              config="vit_0_8b", overrides=_FEW_LAYERS, xla_options=(("xla_gpu_enable_triton_gemm", False),),
              note="ViT, DP=8"),
    BenchCase(name="evoformer_dap8", model="evoformer", layout="dap", cluster="h100_sxm_8", mesh_shape=(8,),
              config="evoformer_0_04b", overrides=(("num_blocks", 1),), note="Evoformer with DAP=8"),
    BenchCase(name="wideresnet_dp8", model="wideresnet", layout="dp", cluster="a100_80_8", mesh_shape=(8,),
              config="wideresnet_1_2b", overrides=(("stage_sizes", (1, 1, 1, 1)),), note="WideResNet, DP=8"),
    BenchCase(name="moe_ep8", model="moe", layout="ep", cluster="h100_sxm_8", mesh_shape=(8,),
              config="moe_8x_d2048", overrides=_FEW_LAYERS, dtype="bfloat16",
              note="MoE, expert parallel EP=8 (all-to-all dispatch and combine)"),
)
"""The v1 baseline suite."""

QUICK: tuple[str, ...] = ("gpt_tp8_nvlink",)
"""Cases run by ``--quick``."""


def get_case(name: str) -> BenchCase:
    """The suite case called ``name``; raises ``ValueError`` listing the known names."""
    for c in SUITE:
        if c.name == name:
            return c
    raise ValueError(f"unknown case {name!r}; known: {[c.name for c in SUITE]}")


def select_cases(names: Sequence[str] | None = None, quick: bool = False) -> list[BenchCase]:
    """The cases a bench runs: ``names`` if given, else ``QUICK`` if ``quick``, else the whole suite."""
    if names:
        return [get_case(n) for n in names]
    if quick:
        return [get_case(n) for n in QUICK]
    return list(SUITE)


def run_each(cases: Sequence[BenchCase], run_case: Callable[..., dict], columns: Sequence[str],
             trace_case: str | None, on_done: Callable[[int, BenchCase, dict], None]) -> list[dict]:
    """Run ``run_case(case, export_trace=...)`` for every case, keeping going when one fails.

    A failed case becomes a row with ``status = "error: ..."`` (one broken case must not lose
    the others' results). The trace is exported for ``trace_case``, or, when it is None, for
    the first case that succeeds. ``on_done(k, case, row)`` reports progress.
    """
    rows: list[dict] = []
    traced = False
    for k, case in enumerate(cases, 1):
        log.info("[%d/%d] %s: %s %s on %s, mesh %s", k, len(cases), case.name, case.model,
                 case.layout, case.cluster, case.mesh_shape)
        want = case.name == trace_case or (trace_case is None and not traced)
        try:
            row = run_case(case, export_trace=want)
        except Exception as e:  # noqa: BLE001 - reported in the row
            log.exception("%s failed", case.name)
            row = dict.fromkeys(columns, "")
            row.update(case=case.name, cluster=case.cluster, mesh="x".join(map(str, case.mesh_shape)),
                       status=f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}")
        traced = traced or (want and str(row["status"]).startswith("ok"))
        rows.append(row)
        on_done(k, case, row)
    return rows

