"""Data-parallel train step whose gradient all-reduces follow a bucket plan.

The step is ``jax.jit(shard_map(...))`` over one mesh axis: each device
computes the gradient of its batch shard, the gradient leaves are flattened
(in reverse order, the order in which back-propagation produces them),
grouped by ``plan_buckets`` into buckets of at most ``bucket_bytes``, and
each bucket is reduced by *one* ``lax.psum`` over a concatenated vector, then
split back; parameters get a plain SGD update. Compiled with XLA:CPU's
``cpu-all-reduce-combiner`` disabled, the number of all-reduces in the
compiled module equals the number of buckets (``count_all_reduces``), so the
bucket size chosen by the tuner is what runs.

References:
  AutoCCL NSDI'25 §5 (tuning inside training); Concerto ASPLOS'25 §4.3 (fusion).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from concerto_jax.autoccl.buckets import Bucket, plan_buckets
from concerto_jax.autoccl.knobs import cpu_compiler_options

__all__ = ["bucketed_psum", "compile_dp_step", "count_all_reduces", "make_dp_step"]

_ALL_REDUCE = re.compile(r" all-reduce(?:-start)?\(")  # opcode position; names are followed by " ="


def bucketed_psum(
    leaves: list[jax.Array], buckets: list[Bucket], axis_name: str
) -> list[jax.Array]:
    """All-reduces ``leaves`` with one ``psum`` per bucket (call inside ``shard_map``).

    Args:
      leaves: arrays to reduce (same dtype within a bucket is assumed; mixed
        dtypes are promoted by the concatenation and cast back).
      buckets: a plan covering every leaf index once (``plan_buckets``).
      axis_name: mesh axis to reduce over.

    Returns:
      The reduced arrays, in the order of ``leaves``.
    """
    out: list[Any] = [None] * len(leaves)
    for b in buckets:
        parts = [leaves[i] for i in b.indices]
        if len(parts) == 1:
            out[b.indices[0]] = jax.lax.psum(parts[0], axis_name)
            continue
        flat = jnp.concatenate([p.ravel() for p in parts])
        red = jax.lax.psum(flat, axis_name)
        offsets = np.cumsum([0] + [p.size for p in parts])
        for i, p, lo, hi in zip(b.indices, parts, offsets[:-1], offsets[1:], strict=True):
            out[i] = red[lo:hi].reshape(p.shape).astype(p.dtype)
    return out


def make_dp_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    axis_name: str,
    bucket_bytes: int,
    params_example: Any,
    learning_rate: float = 1e-2,
) -> tuple[Callable[[Any, Any], tuple[Any, jax.Array]], list[Bucket]]:
    """Builds ``step(params, batch) -> (new_params, per_device_loss)`` with bucketed gradient sync.

    Args:
      loss_fn: ``loss_fn(params, local_batch) -> scalar``.
      mesh: mesh containing ``axis_name``; params are replicated, the batch's
        leading dimension is sharded over ``axis_name``.
      axis_name: data-parallel axis.
      bucket_bytes: bucket capacity; ``<= 0`` = one all-reduce per gradient.
      params_example: pytree with the parameter shapes/dtypes (for the plan).
      learning_rate: SGD step size.

    Returns:
      (the jitted step, the bucket plan it uses).
    """
    leaves, treedef = jax.tree.flatten(params_example)
    order = list(reversed(range(len(leaves))))  # backward produces the last layer's gradient first
    sizes = [int(np.prod(leaves[i].shape)) * jnp.dtype(leaves[i].dtype).itemsize for i in order]
    buckets = plan_buckets(sizes, bucket_bytes)
    n = mesh.shape[axis_name]

    def local(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        g = jax.tree.leaves(grads)
        reduced = bucketed_psum([g[i] for i in order], buckets, axis_name)
        g_sum = [None] * len(g)
        for pos, i in enumerate(order):
            g_sum[i] = reduced[pos]
        new = [
            p - learning_rate * (gs / n)
            for p, gs in zip(jax.tree.leaves(params), g_sum, strict=True)
        ]
        return jax.tree.unflatten(treedef, new), loss[None]

    # check_vma=False: no implicit psum of replicated-parameter gradients; ours are the only ones.
    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(axis_name)),
        out_specs=(P(), P(axis_name)),
        check_vma=False,
    )
    return jax.jit(step), buckets


def compile_dp_step(step, params, batch, disable_combiner: bool = True):
    """AOT-compiles the step for these arguments (XLA:CPU combiner off unless told otherwise)."""
    return step.lower(params, batch).compile(
        compiler_options=cpu_compiler_options(disable_combiner)
    )


def count_all_reduces(hlo_text: str) -> int:
    """Number of all-reduce instructions (sync or async start) in an HLO module's text."""
    return len(_ALL_REDUCE.findall(hlo_text))
