"""Train state and full train steps (loss, value_and_grad, optax AdamW) for a layout.

``build_train_step`` turns (model spec, config, layout, mesh) into a jitted
``step(state, batch) -> (state, metrics)`` with explicit in/out shardings derived
from the layout's logical-axis rules and the state donated, plus the abstract
(ShapeDtypeStruct-with-sharding) state and batch, so that large presets can be
traced and lowered without allocating anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.layouts import Layout, Rules
from models.spec import ModelSpec


@flax.struct.dataclass
class TrainState:
    """Everything a train step carries from one step to the next."""

    step: jax.Array
    params: Any
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """AdamW hyper-parameters used by every train step."""

    learning_rate: float = 1e-3  # constant learning rate
    b1: float = 0.9  # first-moment decay
    b2: float = 0.95  # second-moment decay
    eps: float = 1e-8  # denominator epsilon
    weight_decay: float = 0.01  # decoupled weight decay

    def make(self) -> optax.GradientTransformation:
        return optax.adamw(
            self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay
        )


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A built train step and everything needed to feed it."""

    step: Callable  # jitted step(state, batch) -> (state, metrics); state donated
    init: Callable  # jitted init(rng key) -> TrainState placed with state_shardings
    abstract_state: TrainState  # ShapeDtypeStructs with shardings
    abstract_batch: dict[str, jax.ShapeDtypeStruct]  # ShapeDtypeStructs with shardings
    state_shardings: TrainState  # NamedSharding per leaf
    batch_shardings: dict[str, NamedSharding]
    grad_shardings: Any  # NamedSharding per param: where gradients live after reduction
    logical_state: TrainState  # logical PartitionSpec per leaf (before the rules)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules):
    """Activates the layout's rules and the mesh (abstract, so it also works inside jit)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
        yield


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def build_train_step(
    spec: ModelSpec,
    config: Any,
    layout: Layout,
    mesh: Mesh,
    optimizer: OptimizerOptions | None = None,
) -> TrainStep:
    """Builds the jitted train step of ``spec`` under ``layout`` on ``mesh``.

    Nothing is allocated: parameters are only traced (``jax.eval_shape``).

    Raises:
      ValueError: the mesh's axis names differ from the layout's.
    """
    if tuple(mesh.axis_names) != tuple(layout.mesh_axes):
        raise ValueError(
            f"layout {layout.name!r} expects mesh axes {layout.mesh_axes}, got {tuple(mesh.axis_names)}; "
            "build the mesh with models.make_mesh(layout, shape)"
        )
    module = spec.build(config)
    tx = (optimizer or OptimizerOptions()).make()
    batch_shapes = spec.batch_shapes(config)
    rules = layout.rules

    def init_boxed(rng: jax.Array) -> TrainState:
        dummy = {k: jnp.zeros(v.shape, v.dtype) for k, v in batch_shapes.items()}
        with sharding_context(mesh, rules):
            params = module.init(rng, **_model_inputs(spec, dummy))["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    abstract_boxed = jax.eval_shape(init_boxed, jax.random.key(0))
    logical = nn.get_partition_spec(abstract_boxed)
    param_sh = nn.logical_to_mesh_sharding(logical.params, mesh, rules)
    opt_sh = nn.logical_to_mesh_sharding(logical.opt_state, mesh, layout.grad_rules)
    grad_sh = nn.logical_to_mesh_sharding(logical.params, mesh, layout.grad_rules)
    replicated = NamedSharding(mesh, P())
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh)
    batch_sh = {
        k: NamedSharding(mesh, nn.logical_to_mesh_axes(axes, rules))
        for k, axes in spec.batch_axes(config).items()
    }
    if layout.style == "shard_map":
        batch_sh = {k: NamedSharding(mesh, P(layout.mesh_axes[0])) for k in batch_shapes}

    abstract_state = _with_shardings(nn.meta.unbox(abstract_boxed), state_sh)
    abstract_batch = _with_shardings(batch_shapes, batch_sh)

    init = jax.jit(lambda rng: nn.meta.unbox(init_boxed(rng)), out_shardings=state_sh)

    def loss_fn(params, batch):
        return spec.loss(module, params, batch).astype(jnp.float32)

    def update(state: TrainState, grads: Any, loss: jax.Array):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if layout.style == "jit":

        def train_step(state: TrainState, batch: dict[str, jax.Array]):
            with sharding_context(mesh, rules):
                loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
                # ZeRO-2: gradients reduce-scattered onto their optimizer-state shards,
                # the update computed on shards, the new params all-gathered by out_shardings.
                grads = jax.lax.with_sharding_constraint(grads, grad_sh)
                if layout.state_rules is not None:
                    state = state.replace(
                        params=jax.lax.with_sharding_constraint(state.params, grad_sh)
                    )
                new_state, metrics = update(state, grads, loss)
                new_state = new_state.replace(
                    params=jax.lax.with_sharding_constraint(new_state.params, param_sh)
                )
            return new_state, metrics

    elif layout.style == "shard_map":
        axis = layout.mesh_axes[0]

        def local_step(state: TrainState, batch: dict[str, jax.Array]):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            grads = jax.lax.pmean(grads, axis)
            loss = jax.lax.pmean(loss, axis)
            return update(state, grads, loss)

        # check_vma=False: per-device (pmap-style) gradients, reduced by the explicit
        # pmean. With vma checking on, JAX would already psum the gradient of the
        # replicated params in the transpose and the pmean would leave an n-fold sum.
        sharded_step = jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P()), check_vma=False
        )

        def train_step(state: TrainState, batch: dict[str, jax.Array]):
            return sharded_step(state, batch)
    else:
        raise ValueError(
            f"layout {layout.name!r}: unknown style {layout.style!r}; expected 'jit' or 'shard_map'"
        )

    step = jax.jit(
        train_step,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, {"loss": replicated, "grad_norm": replicated}),
        donate_argnums=(0,),
    )
    return TrainStep(
        step=step,
        init=init,
        abstract_state=abstract_state,
        abstract_batch=abstract_batch,
        state_shardings=state_sh,
        batch_shardings=batch_sh,
        grad_shardings=grad_sh,
        logical_state=logical,
    )


def _model_inputs(spec: ModelSpec, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch entries the module's ``__call__`` takes (everything but targets)."""
    return {k: v for k, v in batch.items() if not k.startswith("target")}
