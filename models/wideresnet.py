"""WideResNet: bottleneck ResNet with a width factor, GroupNorm, classification head.

GroupNorm instead of BatchNorm: no running statistics in the train state and no
batch-dependent forward collectives, so the step is a pure function of
(params, batch) under every layout. Convolution kernels carry logical axes
(``conv_h``, ``conv_w``, ``conv_in``, ``conv_out``), activations
(``activation_batch``, ``activation_height``, ``activation_width``, ``activation_conv``).

References: Zagoruyko & Komodakis, Wide Residual Networks; the Alpa WResNet suite;
Concerto (ASPLOS'25) section 6, WideResNet with 1.2B-10.5B parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.layers import DenseGeneral, constrain, cross_entropy, param_init
from models.spec import ModelSpec

_ACT = ("activation_batch", "activation_height", "activation_width", "activation_conv")


@dataclasses.dataclass(frozen=True)
class WideResNetConfig:
    """WideResNet sizes and the global batch of one train step."""

    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)  # bottleneck blocks per stage (ResNet-50)
    base_channels: int = 320  # filters of the first stage (doubled per stage)
    width_factor: int = 2  # inner (3x3) width = filters * width_factor; block output = 4 * filters
    num_groups: int = 32  # GroupNorm groups
    image_size: int = 224  # square input images
    num_classes: int = 1000  # classification classes
    batch_size: int = 32  # global batch
    dtype: Any = jnp.bfloat16  # activation / matmul dtype (params are float32)


PRESETS: dict[str, WideResNetConfig] = {
    "tiny": WideResNetConfig(
        stage_sizes=(1, 1),
        base_channels=8,
        width_factor=2,
        num_groups=4,
        image_size=16,
        num_classes=16,
        batch_size=8,
        dtype=jnp.float32,
    ),
    "wideresnet_1_2b": WideResNetConfig(base_channels=192, width_factor=3),
    "wideresnet_2_4b": WideResNetConfig(base_channels=384, width_factor=2),
    "wideresnet_5_5b": WideResNetConfig(base_channels=320, width_factor=4),
    "wideresnet_10_5b": WideResNetConfig(
        stage_sizes=(3, 4, 23, 3), base_channels=320, width_factor=4
    ),
}

STATED_PARAMS: dict[str, float] = {
    "wideresnet_1_2b": 1.2e9,
    "wideresnet_2_4b": 2.4e9,
    "wideresnet_5_5b": 5.5e9,
    "wideresnet_10_5b": 10.5e9,
}


class Conv(nn.Module):
    """Convolution (no bias) with a logically named kernel, then GroupNorm."""

    features: int
    kernel: int
    strides: int
    num_groups: int
    dtype: Any
    relu: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(
            self.features,
            (self.kernel, self.kernel),
            strides=(self.strides, self.strides),
            padding="SAME",
            use_bias=False,
            dtype=self.dtype,
            kernel_init=param_init(
                nn.initializers.he_normal(), ("conv_h", "conv_w", "conv_in", "conv_out")
            ),
        )(x)
        x = constrain(x, _ACT)
        x = nn.GroupNorm(
            num_groups=min(self.num_groups, self.features),
            dtype=self.dtype,
            scale_init=param_init(nn.initializers.ones_init(), ("norm",)),
            bias_init=param_init(nn.initializers.zeros_init(), ("norm",)),
        )(x)
        return nn.relu(x) if self.relu else x


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, widened) -> 1x1 with a projected shortcut when shapes change."""

    filters: int
    strides: int
    config: WideResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        inner, out = self.filters * cfg.width_factor, 4 * self.filters
        g, dt = cfg.num_groups, cfg.dtype
        y = Conv(inner, 1, 1, g, dt, name="conv1")(x)
        y = Conv(inner, 3, self.strides, g, dt, name="conv2")(y)
        y = Conv(out, 1, 1, g, dt, relu=False, name="conv3")(y)
        if x.shape[-1] != out or self.strides != 1:
            x = Conv(out, 1, self.strides, g, dt, relu=False, name="shortcut")(x)
        return constrain(nn.relu(x + y), _ACT)


class WideResNet(nn.Module):
    """WideResNet; returns class logits [batch, num_classes]."""

    config: WideResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        x = constrain(images.astype(cfg.dtype), _ACT[:3] + (None,))
        x = Conv(
            cfg.base_channels,
            3,
            2 if cfg.image_size >= 64 else 1,
            cfg.num_groups,
            cfg.dtype,
            name="stem",
        )(x)
        for i, blocks in enumerate(cfg.stage_sizes):
            for j in range(blocks):
                strides = 2 if (i > 0 and j == 0) else 1
                x = Bottleneck(cfg.base_channels * 2**i, strides, cfg, name=f"stage{i}_block{j}")(x)
        pooled = constrain(jnp.mean(x, axis=(1, 2)), ("activation_batch", "activation_conv"))
        logits = DenseGeneral(
            (cfg.num_classes,), ("embed", "classes"), dtype=cfg.dtype, name="head"
        )(pooled)
        return constrain(logits, ("activation_batch", None))


def batch_shapes(cfg: WideResNetConfig) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "images": jax.ShapeDtypeStruct(
            (cfg.batch_size, cfg.image_size, cfg.image_size, 3), jnp.float32
        ),
        "targets": jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32),
    }


def batch_axes(cfg: WideResNetConfig) -> dict[str, tuple[str | None, ...]]:
    return {"images": ("activation_batch", None, None, None), "targets": ("activation_batch",)}


def example_batch(cfg: WideResNetConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic images whose label shifts their mean (learnable)."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal(
        (cfg.batch_size, cfg.image_size, cfg.image_size, 3), dtype=np.float32
    )
    labels = rng.integers(0, cfg.num_classes, size=(cfg.batch_size,), dtype=np.int32)
    images += (labels / cfg.num_classes)[:, None, None, None].astype(np.float32)
    return {"images": images, "targets": labels}


def loss(module: WideResNet, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return cross_entropy(module.apply({"params": params}, batch["images"]), batch["targets"])


SPEC = ModelSpec(
    name="wideresnet",
    presets=PRESETS,
    stated_params=STATED_PARAMS,
    build=WideResNet,
    batch_shapes=batch_shapes,
    batch_axes=batch_axes,
    example_batch=example_batch,
    loss=loss,
    layouts=("dp", "dp_tp", "zero2", "zero3"),
)
