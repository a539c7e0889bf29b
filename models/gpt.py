"""GPT: causal decoder (token + position embeddings, pre-LN blocks, tied LM head).

References: Concerto (ASPLOS'25) section 6, GPT with hidden 2048-12288 and 18 layers
(0.9B-32.6B parameters); the sizes are 12*h^2*L plus the tied embedding table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.layers import (
    Attention,
    LayerNorm,
    Mlp,
    constrain,
    cross_entropy,
    param_init,
    repeat_blocks,
)
from models.spec import ModelSpec

_RESIDUAL = ("activation_batch", "activation_norm_length", "activation_embed")
_INNER = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT sizes and the global batch of one train step."""

    vocab_size: int = 32000  # tied input/output embedding
    hidden: int = 2048  # model width h
    num_layers: int = 18  # decoder blocks
    num_heads: int = 16  # attention heads (head_dim = hidden // num_heads)
    mlp_ratio: int = 4  # MLP width = mlp_ratio * hidden
    seq_len: int = 1024  # tokens per example
    batch_size: int = 16  # global batch (examples per step)
    dtype: Any = jnp.bfloat16  # activation / matmul dtype (params are float32)
    # Blocks under one nn.scan (params stacked on a leading "layers" axis; one while
    # loop in the HLO) instead of unrolled; MaxText's scan_layers.
    scan_layers: bool = False
    # jax.checkpoint around each block: forward recomputed in the backward pass.
    remat: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


def _preset(hidden: int) -> GPTConfig:
    return GPTConfig(hidden=hidden, num_heads=hidden // 128)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(
        vocab_size=256,
        hidden=64,
        num_layers=2,
        num_heads=8,
        seq_len=32,
        batch_size=8,
        dtype=jnp.float32,
    ),
    "gpt_0_9b": _preset(2048),
    "gpt_3_6b": _preset(4096),
    "gpt_8_2b": _preset(6144),
    "gpt_14_5b": _preset(8192),
    "gpt_32_6b": _preset(12288),
}

STATED_PARAMS: dict[str, float] = {
    "gpt_0_9b": 0.9e9,
    "gpt_3_6b": 3.6e9,
    "gpt_8_2b": 8.2e9,
    "gpt_14_5b": 14.5e9,
    "gpt_32_6b": 32.6e9,
}


class Block(nn.Module):
    """Pre-LN decoder block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    config: GPTConfig
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = LayerNorm(dtype=cfg.dtype, name="ln_attn")(x)
        h = constrain(h, _INNER)
        h = Attention(
            cfg.num_heads,
            cfg.head_dim,
            lead_axes=("activation_batch",),
            causal=self.causal,
            dtype=cfg.dtype,
            name="attn",
        )(h)
        x = constrain(x + h, _RESIDUAL)
        h = LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x)
        h = constrain(h, _INNER)
        h = Mlp(
            cfg.mlp_ratio * cfg.hidden,
            lead_axes=("activation_batch", "activation_length"),
            dtype=cfg.dtype,
            name="mlp",
        )(h)
        return constrain(x + h, _RESIDUAL)


class GPT(nn.Module):
    """Causal decoder; returns logits [batch, seq, vocab]."""

    config: GPTConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        cfg = self.config
        embedding = self.param(
            "token_embedding",
            param_init(nn.initializers.normal(0.02), ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden),
            jnp.float32,
        )
        positions = self.param(
            "position_embedding",
            param_init(nn.initializers.normal(0.01), ("pos", "embed")),
            (cfg.seq_len, cfg.hidden),
            jnp.float32,
        )
        x = jnp.take(embedding, inputs, axis=0) + positions[None, : inputs.shape[1]]
        x = constrain(x.astype(cfg.dtype), _RESIDUAL)
        x = repeat_blocks(
            Block, cfg.num_layers, x, scan=cfg.scan_layers, remat=cfg.remat, name="block", config=cfg
        )
        x = LayerNorm(dtype=cfg.dtype, name="ln_final")(x)
        x = constrain(x, _INNER)
        logits = jnp.einsum("ble,ve->blv", x, embedding.astype(cfg.dtype))
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


def batch_shapes(cfg: GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.batch_size, cfg.seq_len)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
    }


def batch_axes(cfg: GPTConfig) -> dict[str, tuple[str | None, ...]]:
    axes = ("activation_batch", "activation_length")
    return {"inputs": axes, "targets": axes}


def example_batch(cfg: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic tokens; targets are the inputs shifted by one (next-token)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss(module: GPT, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    logits = module.apply({"params": params}, batch["inputs"])
    return cross_entropy(logits, batch["targets"])


SPEC = ModelSpec(
    name="gpt",
    presets=PRESETS,
    stated_params=STATED_PARAMS,
    build=GPT,
    batch_shapes=batch_shapes,
    batch_axes=batch_axes,
    example_batch=example_batch,
    loss=loss,
    layouts=("dp", "tp", "tp_sp", "dp_tp", "zero2", "zero3", "shard_map_dp"),
)
