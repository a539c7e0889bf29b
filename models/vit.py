"""ViT: patch embedding, pre-LN encoder blocks (GPT's block, not causal), mean-pool head.

References: Concerto (ASPLOS'25) section 6, ViT with 0.8B-5.0B parameters; the presets
use 16 blocks and hidden 2048-5120 (12*h^2*L plus patch embedding and head).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.gpt import Block
from models.layers import (
    DenseGeneral,
    LayerNorm,
    constrain,
    cross_entropy,
    param_init,
    repeat_blocks,
)
from models.spec import ModelSpec

_RESIDUAL = ("activation_batch", "activation_norm_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT sizes and the global batch of one train step."""

    image_size: int = 224  # square input images
    patch_size: int = 16  # square patches; (image_size / patch_size)^2 tokens
    channels: int = 3  # input channels
    hidden: int = 2048  # model width h
    num_layers: int = 16  # encoder blocks
    num_heads: int = 16  # attention heads (head_dim = hidden // num_heads)
    mlp_ratio: int = 4  # MLP width = mlp_ratio * hidden
    num_classes: int = 1000  # classification classes
    batch_size: int = 32  # global batch
    dtype: Any = jnp.bfloat16  # activation / matmul dtype (params are float32)
    # Blocks under one nn.scan (params stacked on a leading "layers" axis) instead of unrolled.
    scan_layers: bool = False
    # jax.checkpoint around each block: forward recomputed in the backward pass.
    remat: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _preset(hidden: int) -> ViTConfig:
    return ViTConfig(hidden=hidden, num_heads=hidden // 128)


PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(
        image_size=32,
        patch_size=8,
        hidden=64,
        num_layers=2,
        num_heads=8,
        num_classes=16,
        batch_size=8,
        dtype=jnp.float32,
    ),
    "vit_0_8b": _preset(2048),
    "vit_1_8b": _preset(3072),
    "vit_3_2b": _preset(4096),
    "vit_5_0b": _preset(5120),
}

STATED_PARAMS: dict[str, float] = {
    "vit_0_8b": 0.8e9,
    "vit_1_8b": 1.8e9,
    "vit_3_2b": 3.2e9,
    "vit_5_0b": 5.0e9,
}


class ViT(nn.Module):
    """Vision transformer; returns class logits [batch, num_classes]."""

    config: ViTConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        b, h, w, c = images.shape
        p = cfg.patch_size
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, (h // p) * (w // p), p * p * c)
        x = DenseGeneral(
            (cfg.hidden,), ("patch", "embed"), dtype=cfg.dtype, name="patch_embedding"
        )(x)
        positions = self.param(
            "position_embedding",
            param_init(nn.initializers.normal(0.02), ("pos", "embed")),
            (cfg.num_patches, cfg.hidden),
            jnp.float32,
        )
        x = constrain(x + positions[None].astype(cfg.dtype), _RESIDUAL)
        x = repeat_blocks(
            Block,
            cfg.num_layers,
            x,
            scan=cfg.scan_layers,
            remat=cfg.remat,
            name="block",
            config=cfg,
            causal=False,
        )
        x = LayerNorm(dtype=cfg.dtype, name="ln_final")(x)
        pooled = constrain(jnp.mean(x, axis=1), ("activation_batch", "activation_embed"))
        logits = DenseGeneral(
            (cfg.num_classes,), ("embed", "classes"), dtype=cfg.dtype, name="head"
        )(pooled)
        return constrain(logits, ("activation_batch", None))


def batch_shapes(cfg: ViTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "images": jax.ShapeDtypeStruct(
            (cfg.batch_size, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32
        ),
        "targets": jax.ShapeDtypeStruct((cfg.batch_size,), jnp.int32),
    }


def batch_axes(cfg: ViTConfig) -> dict[str, tuple[str | None, ...]]:
    return {"images": ("activation_batch", None, None, None), "targets": ("activation_batch",)}


def example_batch(cfg: ViTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic images whose label is a function of their mean (learnable)."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal(
        (cfg.batch_size, cfg.image_size, cfg.image_size, cfg.channels), dtype=np.float32
    )
    labels = rng.integers(0, cfg.num_classes, size=(cfg.batch_size,), dtype=np.int32)
    images += (labels / cfg.num_classes)[:, None, None, None].astype(np.float32)
    return {"images": images, "targets": labels}


def loss(module: ViT, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return cross_entropy(module.apply({"params": params}, batch["images"]), batch["targets"])


SPEC = ModelSpec(
    name="vit",
    presets=PRESETS,
    stated_params=STATED_PARAMS,
    build=ViT,
    batch_shapes=batch_shapes,
    batch_axes=batch_axes,
    example_batch=example_batch,
    loss=loss,
    layouts=("dp", "tp", "tp_sp", "dp_tp", "zero2", "zero3"),
)
