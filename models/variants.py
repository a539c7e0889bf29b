"""Train-step variants of the registry's cases: callbacks, dropout RNG keys, gradient accumulation, bf16.

Real training steps print, log, draw dropout masks from typed PRNG keys and
accumulate gradients over micro-batches; ``make_variant`` builds such a step
for any (model, layout) of the registry, from the case's own module, loss,
optimizer and shardings:

==============  ================================================================
feature         what the step does
==============  ================================================================
``callbacks``   ``jax.debug.print`` of the loss and an ordered
                ``io_callback`` of (step, grad norm) into ``VariantCase.log``
``dropout``     takes a typed key (``jax.random.key``, donated, returned split);
                DropConnect masks (keep 0.9) on every weight matrix
``grad_accum``  gradients summed over 2 micro-batches in a ``lax.scan``
``bf16``        bf16 compute with float32 params (the config's ``dtype``)
``scan_remat``  layers under ``nn.scan`` with ``jax.checkpoint`` (GPT, ViT, Evoformer)
==============  ================================================================

The step is ``step(state, batch, key) -> (state, metrics, key)`` (the key
argument always present; unused without ``dropout``), state and key donated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.layouts import get_layout
from models.registry import Case, make_case
from models.train import TrainState, sharding_context

FEATURES = ("callbacks", "dropout", "grad_accum", "bf16", "scan_remat")
_KEEP = 0.9
_MICRO = 2


@dataclasses.dataclass(frozen=True)
class VariantCase:
    """A variant train step and how to feed it.

    Attributes:
      name: ``"model/layout/tiny+feature+..."``.
      case: the registry case it was built from (config with the variant's dtype/scan).
      features: the features switched on.
      step: jitted ``step(state, batch, key) -> (state, metrics, key)``; donates state and key.
      log: what the ``callbacks`` feature's io_callback recorded, in call order.
    """

    name: str
    case: Case
    features: tuple[str, ...]
    step: Any
    log: list

    def make_args(self, seed: int = 0) -> tuple:
        """Fresh (state, batch, key), placed with the step's shardings."""
        key = jax.device_put(jax.random.key(seed + 1000), NamedSharding(self.case.mesh, P()))
        return self.case.init_state(seed), self.case.make_batch(seed), key


def _drop_connect(params: Any, key: jax.Array) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = [p * jax.random.bernoulli(k, _KEEP, p.shape).astype(p.dtype) / _KEEP if p.ndim >= 2 else p
           for p, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _micro_batches(batch: dict) -> dict | None:
    """The batch as (_MICRO, b/_MICRO, ...) slices, or None when it does not split evenly."""
    if any(v.shape[0] % _MICRO for v in batch.values()):
        return None
    return {k: v.reshape(_MICRO, v.shape[0] // _MICRO, *v.shape[1:]) for k, v in batch.items()}


def make_variant(model: str, layout: str, features: Sequence[str], *, config: str = "tiny",
                 mesh_shape: Sequence[int] | None = None) -> VariantCase:
    """Builds the variant step of ``model`` x ``layout`` with ``features`` on.

    Raises:
      ValueError: an unknown feature, or ``scan_remat`` for a model without scanned layers.
    """
    features = tuple(features)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown variant feature(s) {unknown}; expected some of {FEATURES}")
    from models.registry import MODELS

    spec = MODELS[model]
    cfg = spec.config(config)
    if "bf16" in features:
        cfg = dataclasses.replace(cfg, dtype=jnp.bfloat16)
    scan = "scan_remat" in features
    case = make_case(model, layout, cfg, mesh_shape, materialize=False,
                     scan_layers=True if scan else None, remat=True if scan else None)
    lay = get_layout(layout)
    ts = case.train_step
    mesh = case.mesh
    module = spec.build(case.config)
    tx = case.optimizer.make()
    dropout, accum, callbacks = ("dropout" in features, "grad_accum" in features,
                                 "callbacks" in features)
    log: list = []

    def loss_fn(params, batch, key):
        if dropout:
            params = _drop_connect(params, key)
        return spec.loss(module, params, batch).astype(jnp.float32)

    def value_and_grad(params, batch, key):
        if not accum:
            return jax.value_and_grad(loss_fn)(params, batch, key)
        micro = _micro_batches(batch)
        if micro is None:  # a per-device batch of one (shard_map): accumulate over repeats
            micro = jax.tree.map(lambda v: jnp.stack([v] * _MICRO), batch)
        keys = jax.random.split(key, _MICRO)

        def body(carry, xs):
            mb, k = xs
            value, grads = jax.value_and_grad(loss_fn)(params, mb, k)
            return jax.tree.map(jnp.add, carry, (value, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, zero, (micro, keys))
        return value / _MICRO, jax.tree.map(lambda g: g / _MICRO, grads)

    def update(state, grads, loss):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def record(step, grad_norm):
        log.append((int(step), np.asarray(grad_norm).item()))

    def report(state, metrics):
        if callbacks:
            jax.debug.print("step {s} loss {l}", s=state.step, l=metrics["loss"])
            jax.experimental.io_callback(record, None, state.step, metrics["grad_norm"],
                                         ordered=True)

    if lay.style == "jit":
        def train_step(state, batch, key):
            key, sub = jax.random.split(key)
            with sharding_context(mesh, lay.rules):
                loss, grads = value_and_grad(state.params, batch, sub)
                grads = jax.lax.with_sharding_constraint(grads, ts.grad_shardings)
                if lay.state_rules is not None:
                    state = state.replace(params=jax.lax.with_sharding_constraint(
                        state.params, ts.grad_shardings))
                new_state, metrics = update(state, grads, loss)
                new_state = new_state.replace(params=jax.lax.with_sharding_constraint(
                    new_state.params, ts.state_shardings.params))
            report(new_state, metrics)
            return new_state, metrics, key
    else:
        axis = lay.mesh_axes[0]

        def local_step(state, batch, key):
            loss, grads = value_and_grad(state.params, batch, key)
            grads = jax.lax.pmean(grads, axis)
            return update(state, grads, jax.lax.pmean(loss, axis))

        sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(axis), P()),
                                out_specs=(P(), P()), check_vma=False)

        def train_step(state, batch, key):
            key, sub = jax.random.split(key)
            new_state, metrics = sharded(state, batch, sub)
            report(new_state, metrics)
            return new_state, metrics, key

    replicated = NamedSharding(mesh, P())
    step = jax.jit(
        train_step,
        in_shardings=(ts.state_shardings, ts.batch_shardings, replicated),
        out_shardings=(ts.state_shardings, {"loss": replicated, "grad_norm": replicated}, replicated),
        donate_argnums=(0, 2))
    name = f"{model}/{layout}/{config}" + "".join(f"+{f}" for f in features)
    return VariantCase(name=name, case=case, features=features, step=step, log=log)
