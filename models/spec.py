"""``ModelSpec``: what the registry needs to know about one model family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from models.layers import LogicalAxes


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family: configs, how to build it, its batch and loss, its layouts."""

    # Short name used by the registry ("gpt", "vit", "evoformer", "wideresnet").
    name: str
    # Named configs: the paper's sizes plus "tiny" (a train step compiles in seconds on CPU).
    presets: Mapping[str, Any]
    # Preset name -> size the paper states, in parameters (checked by the tests within 10 %).
    stated_params: Mapping[str, float]
    # config -> Flax module.
    build: Callable[[Any], nn.Module]
    # config -> {batch key: ShapeDtypeStruct} (global shapes, no sharding).
    batch_shapes: Callable[[Any], dict[str, jax.ShapeDtypeStruct]]
    # config -> {batch key: logical axis names of that array}.
    batch_axes: Callable[[Any], dict[str, LogicalAxes]]
    # (config, seed) -> {batch key: numpy array}, deterministic.
    example_batch: Callable[[Any, int], dict[str, np.ndarray]]
    # (module, params, batch) -> scalar float32 loss.
    loss: Callable[[nn.Module, Any, dict[str, jax.Array]], jax.Array]
    # Layout names (see models.layouts.LAYOUTS) this model supports.
    layouts: tuple[str, ...]

    def config(self, name_or_config: Any) -> Any:
        """Resolves a preset name (or passes a config object through)."""
        if isinstance(name_or_config, str):
            if name_or_config not in self.presets:
                raise ValueError(
                    f"unknown config {name_or_config!r} for model {self.name!r}; "
                    f"expected one of {sorted(self.presets)}"
                )
            return self.presets[name_or_config]
        return name_or_config
