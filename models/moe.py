"""MoE: a causal decoder whose MLPs are mixtures of experts, routed GShard-style.

Each block is a GPT block (``models.gpt``) with the MLP replaced by ``num_experts`` expert
MLPs. A router picks one expert per token (top-1, Switch Transformer); every expert takes at
most ``capacity`` tokens of each group (an example is a group), the others pass through the
residual only. Dispatch and combine are einsums with one-hot masks (GShard, Lepikhin et al.
2020), so every shape is static and the step lowers to plain HLO.

Under expert parallelism (layout ``ep``: experts and examples sharded over one ``expert``
mesh axis) the dispatched tokens ``[expert, group, capacity, embed]`` are resharded from
groups to experts, and XLA's SPMD partitioner writes that as an **all-to-all**; the combine
writes the one back. Those two all-to-alls per block sit between the router and the expert
GEMMs and between the expert GEMMs and the residual: nothing independent overlaps them, the
case a decomposition splits (by capacity slots or by the model dimension).

There is no load-balancing loss: the model exists to give the compiler the collectives of
expert parallelism, not to be trained to quality.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.gpt import batch_axes, batch_shapes, example_batch
from models.layers import (
    Attention,
    LayerNorm,
    constrain,
    cross_entropy,
    param_init,
    repeat_blocks,
)
from models.spec import ModelSpec

_RESIDUAL = ("activation_batch", "activation_norm_length", "activation_embed")
_INNER = ("activation_batch", "activation_length", "activation_embed")
# [expert, group, capacity, embed]: experts over the expert axis; a layout that also maps
# activation_batch there gives the expert axis to the experts (rule order), groups whole
_EXPERT = ("activation_exp", "activation_batch", None, "activation_embed")
# the same array where it is computed (each group's tokens on their group's device)
_GROUPED = (None, "activation_batch", None, "activation_embed")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """MoE decoder sizes and the global batch of one train step."""

    vocab_size: int = 32000
    hidden: int = 2048
    num_layers: int = 4
    num_heads: int = 16
    num_experts: int = 8
    expert_mlp: int = 4096  # each expert's MLP width
    capacity_factor: float = 1.25  # expert slots per group = ceil(seq_len * factor / experts)
    seq_len: int = 1024
    batch_size: int = 16
    dtype: Any = jnp.bfloat16
    scan_layers: bool = False
    remat: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def capacity(self) -> int:
        return max(1, math.ceil(self.seq_len * self.capacity_factor / self.num_experts))


PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_experts=8,
                      expert_mlp=128, capacity_factor=2.0, seq_len=32, batch_size=8, dtype=jnp.float32),
    # Mixtral-like proportions at the held-out width: d 2048, 8 experts of width 5632
    "moe_8x_d2048": MoEConfig(hidden=2048, num_heads=16, num_experts=8, expert_mlp=5632, num_layers=4,
                              seq_len=1024, batch_size=16),
}


class MoeMlp(nn.Module):
    """Top-1 routed experts over ``[group, seq, embed]``, capacity-limited per group."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        _, _, m = x.shape
        e, c = cfg.num_experts, cfg.capacity
        router = self.param("router", param_init(nn.initializers.normal(0.02), ("embed", None)), (m, e),
                            jnp.float32)
        probs = jax.nn.softmax(jnp.einsum("gsm,me->gse", x.astype(jnp.float32), router), axis=-1)
        choice = jnp.argmax(probs, axis=-1)
        gate = jnp.max(probs, axis=-1)
        mask = jax.nn.one_hot(choice, e, dtype=jnp.int32)  # [G, S, E]
        # a token's slot in its expert (in sequence order); slots past the capacity drop it
        slot = jnp.cumsum(mask, axis=1) * mask - 1
        dispatch = jax.nn.one_hot(jnp.where(slot < c, slot, -1), c, dtype=cfg.dtype)  # [G, S, E, C]
        combine = dispatch * gate[..., None, None].astype(cfg.dtype)
        # dispatched where the tokens are, then sent to their experts (the all-to-all)
        expert_in = constrain(jnp.einsum("gsec,gsm->egcm", dispatch, x.astype(cfg.dtype)), _GROUPED)
        expert_in = constrain(expert_in, _EXPERT)
        wi = self.param("wi", param_init(nn.initializers.normal(0.02), ("exp", "embed", "mlp")),
                        (e, m, cfg.expert_mlp), jnp.float32)
        wo = self.param("wo", param_init(nn.initializers.normal(0.02), ("exp", "mlp", "embed")),
                        (e, cfg.expert_mlp, m), jnp.float32)
        h = nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, wi.astype(cfg.dtype)))
        expert_out = constrain(jnp.einsum("egch,ehm->egcm", h, wo.astype(cfg.dtype)), _EXPERT)
        # ... and back to their groups (the second all-to-all), combined there
        expert_out = constrain(expert_out, _GROUPED)
        return jnp.einsum("gsec,egcm->gsm", combine, expert_out)


class Block(nn.Module):
    """Pre-LN decoder block: x + Attn(LN(x)), then x + MoE(LN(x))."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = constrain(LayerNorm(dtype=cfg.dtype, name="ln_attn")(x), _INNER)
        h = Attention(cfg.num_heads, cfg.head_dim, lead_axes=("activation_batch",), causal=True,
                      dtype=cfg.dtype, name="attn")(h)
        x = constrain(x + h, _RESIDUAL)
        h = constrain(LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x), _INNER)
        return constrain(x + MoeMlp(cfg, name="moe")(h), _RESIDUAL)


class MoE(nn.Module):
    """Causal MoE decoder with a tied LM head; returns logits [batch, seq, vocab]."""

    config: MoEConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        cfg = self.config
        embedding = self.param("token_embedding", param_init(nn.initializers.normal(0.02), ("vocab", "embed")),
                               (cfg.vocab_size, cfg.hidden), jnp.float32)
        positions = self.param("position_embedding", param_init(nn.initializers.normal(0.01), ("pos", "embed")),
                               (cfg.seq_len, cfg.hidden), jnp.float32)
        x = jnp.take(embedding, inputs, axis=0) + positions[None, : inputs.shape[1]]
        x = constrain(x.astype(cfg.dtype), _RESIDUAL)
        x = repeat_blocks(Block, cfg.num_layers, x, scan=cfg.scan_layers, remat=cfg.remat, name="block",
                          config=cfg)
        x = constrain(LayerNorm(dtype=cfg.dtype, name="ln_final")(x), _INNER)
        logits = jnp.einsum("ble,ve->blv", x, embedding.astype(cfg.dtype))
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


def loss(module: MoE, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return cross_entropy(module.apply({"params": params}, batch["inputs"]), batch["targets"])


SPEC = ModelSpec(
    name="moe",
    presets=PRESETS,
    stated_params={},
    build=MoE,
    batch_shapes=batch_shapes,
    batch_axes=batch_axes,
    example_batch=example_batch,
    loss=loss,
    layouts=("dp", "zero2", "zero3", "ep"),
)
