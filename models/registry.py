"""Registry of (model, layout) train-step cases used by the rest of the project."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from models import evoformer, gpt, moe, vit, wideresnet
from models.layouts import Layout, get_layout, make_mesh
from models.spec import ModelSpec
from models.train import OptimizerOptions, TrainState, TrainStep, build_train_step

logger = logging.getLogger(__name__)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (gpt.SPEC, vit.SPEC, evoformer.SPEC, wideresnet.SPEC, moe.SPEC)
}


def list_cases() -> list[tuple[str, str]]:
    """All supported (model, layout) pairs, in a stable order."""
    return [(name, layout) for name, spec in MODELS.items() for layout in spec.layouts]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model x layout x config train step, ready to run or to lower.

    ``state`` and ``batch`` are None when the case was made with
    ``materialize=False`` (the default for every config but "tiny"); the abstract
    versions are always there, so ``case.lower()`` never allocates.
    """

    name: str  # "model/layout/config", e.g. "gpt/tp/tiny"
    model: str
    layout: str
    config_name: str  # preset name, or "custom" for a config object
    config: Any  # the model's frozen config dataclass
    mesh: Mesh
    step: Callable  # jitted step(state, batch) -> (state, metrics); donates state
    state: TrainState | None  # initialised and placed (None if not materialized)
    batch: dict[str, jax.Array] | None  # placed example batch (None if not materialized)
    abstract_state: TrainState  # ShapeDtypeStructs with shardings
    abstract_batch: dict[str, jax.ShapeDtypeStruct]  # ShapeDtypeStructs with shardings
    train_step: TrainStep  # shardings, logical specs, init function
    spec: ModelSpec
    optimizer: OptimizerOptions

    def init_state(self, seed: int = 0) -> TrainState:
        """A fresh train state placed with the layout's shardings.

        The values are computed once per (model, config, seed, optimizer) on one
        device and cached on the host, so every layout starts from the same numbers
        (and the step, which donates its input, always gets fresh buffers). For a
        large preset on a real accelerator mesh prefer the sharded
        ``case.train_step.init(jax.random.key(seed))``.
        """
        host = _host_initial_state(self.model, self.config, self.optimizer, seed)
        return jax.device_put(host, self.train_step.state_shardings)

    def make_batch(self, seed: int = 0) -> dict[str, jax.Array]:
        """The deterministic example batch for ``seed``, placed with its shardings."""
        host = self.spec.example_batch(self.config, seed)
        return {k: jax.device_put(v, self.train_step.batch_shardings[k]) for k, v in host.items()}

    def lower(self):
        """Traces and lowers the step on the abstract state/batch (allocates nothing)."""
        return self.step.trace(self.abstract_state, self.abstract_batch).lower()


@functools.lru_cache(maxsize=32)
def _host_initial_state(
    model: str, config: Any, optimizer: OptimizerOptions | None, seed: int
) -> TrainState:
    """Initial state as numpy arrays, computed on a single device (same for every layout)."""
    spec = MODELS[model]
    layout = get_layout("dp")
    devices = jax.devices()[:1]
    built = build_train_step(spec, config, layout, make_mesh(layout, (1,), devices), optimizer)
    key = jax.random.key(seed)
    # LLVM -O0: several times faster to compile for the many small RNG kernels of an
    # init, and it runs once per (model, config, seed).
    init = built.init.lower(key).compile(compiler_options={"xla_backend_optimization_level": 0})
    return jax.tree.map(np.asarray, init(key))


def make_case(
    model: str,
    layout: str | Layout,
    config: str | Any = "tiny",
    mesh_shape: Sequence[int] | None = None,
    *,
    mesh: Mesh | None = None,
    materialize: bool | None = None,
    seed: int = 0,
    optimizer: OptimizerOptions | None = None,
    scan_layers: bool | None = None,
    remat: bool | None = None,
) -> Case:
    """Builds the train-step case ``model`` x ``layout`` x ``config``.

    Args:
      model: a key of ``MODELS`` ("gpt", "vit", "evoformer", "wideresnet").
      layout: a key of ``models.LAYOUTS`` (or a Layout) that the model supports.
      config: preset name (``"tiny"``, ``"gpt_0_9b"``, ...) or a config object.
      mesh_shape: mesh shape over ``jax.devices()``; default: the layout's default.
      mesh: a ready mesh instead (e.g. from a deviceless GPU topology); its axis
        names must be the layout's ``mesh_axes``.
      materialize: allocate state and batch; default True only for ``"tiny"``.
      seed: seed of the initial params and of the example batch.
      optimizer: AdamW hyper-parameters.
      scan_layers: override the config's ``scan_layers`` (blocks under one
        ``nn.scan``, params stacked on a leading unsharded ``"layers"`` axis); the
        case name gets ``+scan``. None keeps the config's value.
      remat: override the config's ``remat`` (``jax.checkpoint`` per block); the case
        name gets ``+remat``. None keeps the config's value.

    Raises:
      ValueError: unknown model/layout/config, a layout the model does not support,
        or scan_layers/remat for a model without those variants.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {sorted(MODELS)}")
    spec = MODELS[model]
    layout_obj = get_layout(layout)
    if layout_obj.name not in spec.layouts:
        raise ValueError(
            f"model {model!r} does not support layout {layout_obj.name!r}; supported: {spec.layouts}"
        )
    cfg = spec.config(config)
    config_name = config if isinstance(config, str) else "custom"
    variant = ""
    for field, value in (("scan_layers", scan_layers), ("remat", remat)):
        if value is None:
            continue
        if not hasattr(cfg, field):
            raise ValueError(
                f"model {model!r} has no {field} variant; models with one: "
                f"{sorted(n for n, s in MODELS.items() if hasattr(s.config('tiny'), field))}"
            )
        cfg = dataclasses.replace(cfg, **{field: value})
    if getattr(cfg, "scan_layers", False):
        variant += "+scan"
    if getattr(cfg, "remat", False):
        variant += "+remat"
    if mesh is not None and mesh_shape is not None:
        raise ValueError("give either mesh or mesh_shape, not both")
    if mesh is None:
        mesh = make_mesh(layout_obj, mesh_shape)
    built = build_train_step(spec, cfg, layout_obj, mesh, optimizer)
    if materialize is None:
        materialize = config_name == "tiny"
    state = batch = None
    case = Case(
        name=f"{model}/{layout_obj.name}/{config_name}{variant}",
        model=model,
        layout=layout_obj.name,
        config_name=config_name,
        config=cfg,
        mesh=mesh,
        step=built.step,
        state=None,
        batch=None,
        abstract_state=built.abstract_state,
        abstract_batch=built.abstract_batch,
        train_step=built,
        spec=spec,
        optimizer=optimizer or OptimizerOptions(),
    )
    if materialize:
        state = case.init_state(seed)
        batch = case.make_batch(seed)
        case = dataclasses.replace(case, state=state, batch=batch)
    logger.debug("made case %s on mesh %s", case.name, dict(mesh.shape))
    return case
