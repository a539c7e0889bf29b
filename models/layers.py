"""Shared Flax layers with logical axis names on every parameter and activation.

Every parameter is created through :func:`param_init` (``nn.with_logical_partitioning``)
and every important activation goes through :func:`constrain`
(``nn.with_logical_constraint``). Which logical name maps to which mesh axis is not
decided here: that is the job of :mod:`models.layouts` (MaxText ``logical_axis_rules``).

Logical names used by the models (the shared vocabulary the layouts map):

* parameters: ``vocab``, ``embed``, ``mlp``, ``heads``, ``kv``, ``norm``, ``pos``,
  ``patch``, ``classes``, ``opm``, ``conv_h``, ``conv_w``, ``conv_in``, ``conv_out``,
  ``exp`` (an MoE layer's experts);
* activations: ``activation_batch``, ``activation_length`` (sequence inside attention /
  MLP), ``activation_norm_length`` (sequence on the residual stream; sharded by
  sequence parallelism), ``activation_embed``, ``activation_heads``, ``activation_kv``,
  ``activation_mlp``, ``activation_vocab``, ``activation_dap`` (the Evoformer axis
  that dynamic axial parallelism splits), ``activation_exp`` (experts of dispatched tokens),
  ``activation_conv`` (image channels),
  ``activation_height``, ``activation_width``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

Dtype = Any
LogicalAxes = tuple[str | None, ...]


def param_init(init: nn.initializers.Initializer, names: LogicalAxes):
    """Wraps an initializer so that the parameter carries logical axis names."""
    return nn.with_logical_partitioning(init, names)


def constrain(x: jax.Array, names: LogicalAxes) -> jax.Array:
    """Sharding constraint by logical names; a no-op when no rules are active."""
    if len(names) != x.ndim:
        raise ValueError(
            f"constrain: {len(names)} logical names {names} for an array of rank {x.ndim}"
        )
    return nn.with_logical_constraint(x, names)


def _fan_in_init(n_in: int, n_out: int, scale: float = 1.0):
    return nn.initializers.variance_scaling(
        scale,
        "fan_in",
        "truncated_normal",
        in_axis=tuple(range(n_in)),
        out_axis=tuple(range(n_in, n_in + n_out)),
    )


class DenseGeneral(nn.Module):
    """Contracts the last ``len(in_axes)`` dims of ``x`` with a kernel of named axes.

    ``kernel_axes`` names the kernel's dims: the contracted input dims first, then the
    output ``features``.
    """

    features: tuple[int, ...]
    kernel_axes: LogicalAxes
    n_in: int = 1
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_scale: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = tuple(self.features)
        if len(self.kernel_axes) != self.n_in + len(features):
            raise ValueError(
                f"DenseGeneral {self.name}: kernel_axes {self.kernel_axes} must name "
                f"{self.n_in} input dims and {len(features)} output dims"
            )
        in_shape = x.shape[x.ndim - self.n_in :]
        kernel = self.param(
            "kernel",
            param_init(_fan_in_init(self.n_in, len(features), self.kernel_scale), self.kernel_axes),
            in_shape + features,
            self.param_dtype,
        )
        contract_x = tuple(range(x.ndim - self.n_in, x.ndim))
        contract_k = tuple(range(self.n_in))
        y = lax.dot_general(
            x.astype(self.dtype), kernel.astype(self.dtype), ((contract_x, contract_k), ((), ()))
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                param_init(nn.initializers.zeros_init(), self.kernel_axes[self.n_in :]),
                features,
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


class LayerNorm(nn.Module):
    """LayerNorm over the last dim; scale and bias are named ``norm``."""

    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    epsilon: float = 1e-5
    use_bias: bool = True  # False where a bias could only shift logits (zero gradient)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.LayerNorm(
            epsilon=self.epsilon,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            scale_init=param_init(nn.initializers.ones_init(), ("norm",)),
            bias_init=param_init(nn.initializers.zeros_init(), ("norm",)),
        )(x)


class Attention(nn.Module):
    """Multi-head self-attention over the second-to-last dim of ``x`` [*lead, L, E].

    ``lead_axes`` are the logical names of the leading dims, ``length_axis`` the name
    of the attended dim. ``bias`` (optional) broadcasts against logits
    [*lead, heads, L, L]. Softmax is computed in float32.
    """

    num_heads: int
    head_dim: int
    lead_axes: LogicalAxes
    length_axis: str | None = "activation_length"
    causal: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        lead = tuple(self.lead_axes)
        hd_axes = lead + (self.length_axis, "activation_heads", "activation_kv")
        dense = lambda name: DenseGeneral(  # noqa: E731
            (self.num_heads, self.head_dim),
            ("embed", "heads", "kv"),
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )
        q = constrain(dense("query")(x), hd_axes)
        k = constrain(dense("key")(x), hd_axes)
        v = constrain(dense("value")(x), hd_axes)
        q = q / jnp.sqrt(jnp.asarray(self.head_dim, self.dtype))
        logits = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(jnp.float32)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        if self.causal:
            length = x.shape[-2]
            mask = jnp.tril(jnp.ones((length, length), dtype=bool))
            logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = jnp.einsum("...hqk,...khd->...qhd", probs, v)
        out = constrain(out, hd_axes)
        return DenseGeneral(
            (x.shape[-1],),
            ("heads", "kv", "embed"),
            n_in=2,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )(out)


class Mlp(nn.Module):
    """Two-layer GELU MLP over the last dim (Megatron column then row parallel)."""

    hidden_dim: int
    lead_axes: LogicalAxes
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = DenseGeneral(
            (self.hidden_dim,),
            ("embed", "mlp"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="wi",
        )(x)
        h = constrain(h, tuple(self.lead_axes) + ("activation_mlp",))
        h = nn.gelu(h)
        return DenseGeneral(
            (x.shape[-1],),
            ("mlp", "embed"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="wo",
        )(h)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels, computed in float32.

    The label logit is picked with a one-hot product (as MaxText does), not a gather:
    under the 2-D data x dap layout XLA's SPMD partitioner gave a wrong gradient for
    the ``take_along_axis`` form inside the Evoformer (not reproduced in isolation).
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.sum(logits * jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jnp.mean(logz - picked)


def count_params(tree: Any) -> int:
    """Number of scalars in a (possibly abstract, possibly boxed) parameter tree."""
    leaves = jax.tree_util.tree_leaves(nn.meta.unbox(tree))
    total = 0
    for leaf in leaves:
        size = 1
        for d in leaf.shape:
            size *= d
        total += size
    return total


def shapes(
    names_to_shapes: dict[str, tuple[Sequence[int], Any]],
) -> dict[str, jax.ShapeDtypeStruct]:
    """Builds a dict of ``ShapeDtypeStruct`` from ``{name: (shape, dtype)}``."""
    return {k: jax.ShapeDtypeStruct(tuple(s), d) for k, (s, d) in names_to_shapes.items()}


# Logical name of the leading axis that ``nn.scan`` adds to every stacked parameter.
# No layout maps it, so the stacked params are unsharded along the layers and keep the
# per-layer sharding of their other axes (MaxText's "layers" axis).
LAYERS_AXIS = "layers"


def repeat_blocks(
    block: type[nn.Module],
    count: int,
    carry: Any,
    *,
    scan: bool,
    remat: bool,
    name: str,
    **attrs: Any,
) -> Any:
    """Applies ``count`` blocks ``carry -> carry``, unrolled or under one ``nn.scan``.

    Must be called inside a compact method. ``block(**attrs)`` maps a carry (an
    array or a tuple of arrays) to a carry of the same structure.

    Args:
      block: a Flax module class whose ``__call__(carry)`` returns the new carry (a
        tuple carry is passed as positional arguments: ``__call__(*carry)``).
      count: number of blocks (layers).
      carry: input of the first block.
      scan: stack the blocks' params along a leading ``LAYERS_AXIS`` axis and run
        them under ``nn.scan`` (one ``while`` loop in the HLO) instead of unrolling
        ``count`` separately named blocks ``f"{name}_{i}"``.
      remat: wrap each block in ``nn.remat`` (``jax.checkpoint``): its forward
        activations are recomputed in the backward pass instead of being stored.
      name: scope name of the scanned stack (``name``) or prefix of the unrolled
        blocks (``name_0``, ``name_1``, ...).
      **attrs: the block's attributes.

    Returns:
      The carry after the last block.
    """
    # Inside a scan the loop boundary already keeps XLA from CSE-ing the recomputation
    # into the forward pass (MaxText: prevent_cse=not scan_layers).
    cls = nn.remat(block, prevent_cse=not scan) if remat else block
    if not scan:
        for i in range(count):
            carry = _apply(cls(name=f"{name}_{i}", **attrs), carry)
        return carry
    stacked = nn.scan(
        _ScanAdapter,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=count,
        metadata_params={nn.PARTITION_NAME: LAYERS_AXIS},
    )
    carry, _ = stacked(block=cls, attrs=tuple(sorted(attrs.items())), name=name)(carry, None)
    return carry


class _ScanAdapter(nn.Module):
    """Adapts a block ``carry -> carry`` to ``nn.scan``'s ``(carry, x) -> (carry, y)``."""

    block: Any  # module class (possibly nn.remat-wrapped)
    attrs: tuple[tuple[str, Any], ...]  # the block's attributes, as sorted items

    @nn.compact
    def __call__(self, carry: Any, _: Any) -> tuple[Any, None]:
        return _apply(self.block(name="block", **dict(self.attrs)), carry), None


def _apply(module: nn.Module, carry: Any) -> Any:
    """A tuple carry is passed as positional arguments (Evoformer's (msa, pair))."""
    return module(*carry) if isinstance(carry, tuple) else module(carry)
