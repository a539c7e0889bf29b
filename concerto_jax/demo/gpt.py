"""A small GPT train step with Megatron tensor parallelism, for the main job and examples.

Causal decoder (token + position embeddings, pre-LN blocks, tied LM head), AdamW, written
in plain JAX with explicit shardings on a mesh with axes ``("data", "model")``: the batch
over ``data``; attention heads, the MLP hidden dimension and the vocabulary over ``model``
(Megatron: one all-reduce after attention and one after the MLP, forward and backward).

``train_step(config, mesh)`` gives the jitted step ``step(state, batch) -> (state,
metrics)`` with its state donated, ``abstract_inputs`` its abstract arguments (nothing
allocated: enough for ``compile_for_target``), ``init_state`` / ``example_batch`` real ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes, global batch and activation dtype of one train step (params are float32)."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 8
    seq_len: int = 32
    batch_size: int = 8
    dtype: Any = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_params(self) -> int:
        h, v = self.hidden, self.vocab_size
        return v * h + self.seq_len * h + self.num_layers * (12 * h * h + 13 * h) + 2 * h


def _param_specs(cfg: GPTConfig) -> dict:
    """PartitionSpec of every parameter (Megatron: heads, MLP hidden and vocab over model)."""
    ln = {"scale": P(), "bias": P()}
    layer = {"ln1": ln, "qkv": P(None, None, "model", None), "out": P("model", None, None),
             "out_b": P(), "ln2": ln, "w1": P(None, "model"), "b1": P("model"),
             "w2": P("model", None), "b2": P()}
    return {"wte": P("model", None), "wpe": P(), "layers": [layer] * cfg.num_layers, "ln_f": ln}


def _init_params(cfg: GPTConfig, key: jax.Array) -> dict:
    h, f, nh, hd = cfg.hidden, 4 * cfg.hidden, cfg.num_heads, cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 4 * cfg.num_layers))

    def normal(shape, std):
        return jax.random.normal(next(keys), shape, jnp.float32) * std

    def ln():
        return {"scale": jnp.ones((h,), jnp.float32), "bias": jnp.zeros((h,), jnp.float32)}

    out_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    layers = [{"ln1": ln(), "qkv": normal((h, 3, nh, hd), 0.02), "out": normal((nh, hd, h), out_std),
               "out_b": jnp.zeros((h,), jnp.float32), "ln2": ln(), "w1": normal((h, f), 0.02),
               "b1": jnp.zeros((f,), jnp.float32), "w2": normal((f, h), out_std),
               "b2": jnp.zeros((h,), jnp.float32)} for _ in range(cfg.num_layers)]
    return {"wte": normal((cfg.vocab_size, h), 0.02), "wpe": normal((cfg.seq_len, h), 0.01),
            "layers": layers, "ln_f": ln()}


def _layer_norm(x, p):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]).astype(x.dtype)


def _forward(cfg: GPTConfig, params: dict, tokens: jax.Array, mesh) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` (float32)."""
    dt = cfg.dtype

    def constrain(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    x = jnp.take(params["wte"], tokens, axis=0) + params["wpe"][None, : tokens.shape[1]]
    x = constrain(x.astype(dt), "data", None, None)
    mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    for p in params["layers"]:
        h = _layer_norm(x, p["ln1"])
        q, k, v = (constrain(t, "data", None, "model", None) for t in
                   jnp.unstack(jnp.einsum("bse,etnd->tbsnd", h, p["qkv"].astype(dt)), axis=0))
        att = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / math.sqrt(cfg.head_dim)
        att = jax.nn.softmax(jnp.where(mask, att, jnp.finfo(jnp.float32).min), axis=-1).astype(dt)
        h = jnp.einsum("bnqk,bknd->bqnd", att, v)
        x = constrain(x + jnp.einsum("bqnd,nde->bqe", h, p["out"].astype(dt)) + p["out_b"].astype(dt),
                      "data", None, None)
        h = constrain(_layer_norm(x, p["ln2"]) @ p["w1"].astype(dt) + p["b1"].astype(dt),
                      "data", None, "model")
        h = jax.nn.gelu(h) @ p["w2"].astype(dt) + p["b2"].astype(dt)
        x = constrain(x + h, "data", None, None)
    x = _layer_norm(x, params["ln_f"])
    logits = jnp.einsum("bse,ve->bsv", x, params["wte"].astype(dt))
    return constrain(logits, "data", None, "model").astype(jnp.float32)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.sum(logits * jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jnp.mean(logz - picked)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A jitted GPT train step and what feeds it.

    Attributes:
      config: the model's sizes.
      step: ``step(state, batch) -> (state, {"loss": ...})``, state donated.
      abstract_inputs: ``(state, batch)`` as ``jax.ShapeDtypeStruct``s with shardings.
      init_state: ``init_state(seed)`` -> a placed state (allocates).
      example_batch: ``example_batch(seed)`` -> a placed batch of tokens and next tokens.
    """

    config: GPTConfig
    step: Any
    abstract_inputs: tuple
    init_state: Any
    example_batch: Any


def train_step(config: GPTConfig, mesh, learning_rate: float = 1e-3) -> TrainStep:
    """The jitted train step of ``config`` on ``mesh`` (axes ``("data", "model")``)."""
    if tuple(mesh.axis_names) != ("data", "model"):
        raise ValueError(f"the demo GPT needs mesh axes ('data', 'model'), got {mesh.axis_names}")
    tx = optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.01)
    specs = _param_specs(config)
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                            is_leaf=lambda s: isinstance(s, P))
    abstract_params = jax.eval_shape(functools.partial(_init_params, config), jax.random.key(0))
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # Adam's moments are sharded like their parameters; scalars (the count) replicated.
    opt_sh = _moments_like_params(abstract_opt, param_sh, mesh)
    state_sh = {"params": param_sh, "opt": opt_sh}
    tokens_sh = NamedSharding(mesh, P("data", None))
    batch_sh = {"inputs": tokens_sh, "targets": tokens_sh}
    replicated = NamedSharding(mesh, P())

    def step(state, batch):
        def loss_fn(params):
            return _cross_entropy(_forward(config, params, batch["inputs"], mesh), batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh),
                     out_shardings=(state_sh, {"loss": replicated}), donate_argnums=(0,))
    shape = (config.batch_size, config.seq_len)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  {"params": abstract_params, "opt": abstract_opt}, state_sh)
    abstract_batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=tokens_sh) for k in batch_sh}

    def init_state(seed: int = 0):
        params = jax.jit(functools.partial(_init_params, config))(jax.random.key(seed))
        return jax.device_put({"params": params, "opt": tx.init(params)}, state_sh)

    def example_batch(seed: int = 0):
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, config.vocab_size, size=(shape[0], shape[1] + 1), dtype=np.int32)
        return {"inputs": jax.device_put(tokens[:, :-1], tokens_sh),
                "targets": jax.device_put(tokens[:, 1:], tokens_sh)}

    return TrainStep(config, jitted, (abstract_state, abstract_batch), init_state, example_batch)


def _moments_like_params(abstract_opt, param_sh, mesh):
    """Shardings of the optimizer state: any subtree shaped like the params takes theirs."""
    params_def = jax.tree.structure(param_sh)
    replicated = NamedSharding(mesh, P())

    def walk(node):
        if jax.tree.structure(node) == params_def:
            return param_sh
        if isinstance(node, tuple):
            children = [walk(c) for c in node]
            return type(node)(*children) if hasattr(node, "_fields") else tuple(children)
        return jax.tree.map(lambda _: replicated, node)

    return walk(abstract_opt)
