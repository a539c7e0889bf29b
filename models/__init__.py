"""Flax models of the Concerto evaluation (GPT, ViT, Evoformer, WideResNet) and an MoE decoder, their parallel layouts and train steps.

Pipeline of this package::

    ModelSpec (config presets, Flax module with logical axis names, batch, loss)
      + Layout (mesh axes, logical-axis rules: logical name -> mesh axis)
      + Mesh   (jax.make_mesh with Auto axes, or a deviceless topology mesh)
      | build_train_step   eval_shape -> logical specs -> NamedShardings
      v
    jitted step(state, batch) -> (state, metrics)   (in/out shardings, state donated)
    + abstract state / batch (ShapeDtypeStruct with shardings: lower without allocating)

Quick use::

    import models
    case = models.make_case("gpt", "tp")            # tiny config, 8 devices, allocated
    state, metrics = case.step(case.state, case.batch)

    big = models.make_case("gpt", "tp", "gpt_0_9b")  # nothing allocated
    lowered = big.lower()                             # step.trace(abstract...).lower()

    # deviceless GPU target: bring your own mesh with the layout's axis names
    mesh = topologies.make_mesh(topo, (8,), models.LAYOUTS["tp"].mesh_axes)
    big = models.make_case("gpt", "tp", "gpt_0_9b", mesh=mesh)

Public API:

* ``make_case(model, layout, config="tiny", mesh_shape=None, *, mesh=None,
  materialize=None, seed=0, optimizer=None, scan_layers=None, remat=None) -> Case``.
  ``scan_layers=True`` stacks the blocks' params on a leading unsharded ``"layers"``
  axis and runs them under one ``nn.scan`` (a while loop in the HLO); ``remat=True``
  wraps each block in ``jax.checkpoint``. Both default off (config fields of GPT,
  ViT and Evoformer; WideResNet's stages differ in shape and are not scanned).
* ``Case`` (frozen): ``name`` ("gpt/tp/tiny"), ``model``, ``layout``, ``config_name``,
  ``config``, ``mesh``, ``step`` (jitted; donates the state), ``state`` / ``batch``
  (placed; None unless materialized — default only for "tiny"), ``abstract_state`` /
  ``abstract_batch`` (ShapeDtypeStructs with shardings), ``train_step`` (a
  ``TrainStep``: shardings, grad shardings, logical specs, sharded ``init``),
  ``spec``, ``optimizer``; methods ``init_state(seed)`` (fresh placed state, same
  values under every layout), ``make_batch(seed)``, ``lower()``.
* ``list_cases() -> [(model, layout), ...]`` and ``MODELS`` (name -> ``ModelSpec``
  with ``presets``, ``stated_params``, ``layouts``).
* ``LAYOUTS`` (name -> ``Layout``), ``get_layout``, ``make_mesh(layout, shape=None,
  devices=None)``.
* ``build_train_step(spec, config, layout, mesh, optimizer=None) -> TrainStep``,
  ``TrainState`` (step, params, opt_state), ``OptimizerOptions`` (AdamW).

Supported cases (``list_cases()``): gpt x {dp, tp, tp_sp, dp_tp, zero2, zero3,
shard_map_dp}; vit x {dp, tp, tp_sp, dp_tp, zero2, zero3}; evoformer x {dp, dap,
dp_dap, zero2, zero3}; wideresnet x {dp, dp_tp, zero2, zero3}; moe x {dp, zero2, zero3, ep}.

Presets (paper sizes, checked by tests within 10 %): gpt_0_9b, gpt_3_6b, gpt_8_2b,
gpt_14_5b, gpt_32_6b (18 layers, h = 2048..12288); vit_0_8b, vit_1_8b, vit_3_2b,
vit_5_0b (16 layers, h = 2048..5120); evoformer_0_04b, evoformer_0_09b,
evoformer_0_19b; wideresnet_1_2b, wideresnet_2_4b, wideresnet_5_5b, wideresnet_10_5b; the MoE
decoder has no paper size (moe_8x_d2048: d 2048, 8 experts of width 5632).
Every model also has "tiny" (float32; a train step compiles in seconds on CPU).
Presets compute in bfloat16 with float32 params.
"""

from models.layouts import LAYOUTS, Layout, get_layout, make_mesh
from models.registry import MODELS, Case, list_cases, make_case
from models.spec import ModelSpec
from models.train import OptimizerOptions, TrainState, TrainStep, build_train_step

__all__ = [
    "LAYOUTS",
    "MODELS",
    "Case",
    "Layout",
    "ModelSpec",
    "OptimizerOptions",
    "TrainState",
    "TrainStep",
    "build_train_step",
    "get_layout",
    "list_cases",
    "make_case",
    "make_mesh",
]
