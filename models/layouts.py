"""Parallel layouts as logical-axis rules, kept apart from the models (MaxText style).

A :class:`Layout` names the mesh axes it needs and maps the models' logical axis
names (see :mod:`models.layers`) to those mesh axes. Rules are ordered by priority:
for one array, the first rule whose logical name is present and whose mesh axis is
still free wins (flax ``logical_to_mesh_axes`` semantics), so ZeRO-3 can say
"shard ``embed`` over ``data``, else ``mlp``, else ...".

=============  ====================  ===================================================
layout         mesh axes (8 dev.)    what is sharded
=============  ====================  ===================================================
dp             data=8                batch; params/optimizer replicated (grad all-reduce)
tp             model=8               Megatron: heads, MLP hidden, vocab over ``model``
tp_sp          model=8               tp + residual-stream sequence over ``model``
dp_tp          data=2, model=4       batch over ``data``, Megatron TP over ``model``
zero2          data=8                batch; params replicated; grads and optimizer
                                     state sharded over ``data`` (reduce-scatter,
                                     sharded update, all-gather of new params)
zero3          data=8                batch; params, grads and optimizer state sharded
                                     over ``data`` (FSDP: all-gather before use)
dap            dap=8                 Evoformer dynamic axial parallelism: MSA / pair
                                     split along the residue or sequence axis,
                                     switching between row and column ops (all-to-all)
dp_dap         data=2, dap=4         batch over ``data``, DAP over ``dap``
shard_map_dp   data=8                DP written with ``jax.shard_map`` inside jit and an
                                     explicit ``lax.pmean`` of the gradients
ep             expert=8              expert parallel (MoE): experts over ``expert``, and
                                     the batch too; tokens go to their expert's device
                                     and back by all-to-all
=============  ====================  ===================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_DP: Rules = (("activation_batch", "data"),)

_TP: Rules = (
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("conv_out", "model"),
    ("activation_heads", "model"),
    ("activation_mlp", "model"),
    ("activation_vocab", "model"),
    ("activation_conv", "model"),
)

_SP: Rules = (("activation_norm_length", "model"),)

# Parameters sharded over the data axis, in order of preference (FSDP/ZeRO-3 style).
_OVER_DATA: Rules = (
    ("embed", "data"),
    ("conv_out", "data"),
    ("mlp", "data"),
    ("vocab", "data"),
    ("heads", "data"),
    ("classes", "data"),
    ("opm", "data"),
    ("norm", "data"),
)

_DAP: Rules = (("activation_dap", "dap"),)

# Experts first: an array holding both an expert and a batch axis shards its experts.
_EP: Rules = (("exp", "expert"), ("activation_exp", "expert"), ("activation_batch", "expert"))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout: mesh axes plus logical-axis rules."""

    # Registry key, e.g. "dp_tp".
    name: str
    # Mesh axis names, outermost first.
    mesh_axes: tuple[str, ...]
    # Rules for parameters and activations (and the batch).
    rules: Rules
    # Rules for gradients and optimizer state; None means the same as ``rules``
    # (ZeRO-2 keeps params replicated but shards these over ``data``).
    state_rules: Rules | None = None
    # "jit" (GSPMD with in/out shardings and constraints) or "shard_map" (manual SPMD).
    style: str = "jit"
    # One-line description.
    description: str = ""

    @property
    def grad_rules(self) -> Rules:
        return self.rules if self.state_rules is None else self.state_rules

    def default_mesh_shape(self, num_devices: int) -> tuple[int, ...]:
        """Mesh shape used when none is given: 2 x n/2 for 2-D layouts, n otherwise."""
        if len(self.mesh_axes) == 1:
            return (num_devices,)
        if num_devices % 2:
            raise ValueError(f"layout {self.name!r} needs an even device count, got {num_devices}")
        return (2, num_devices // 2)


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("dp", ("data",), _DP, description="data parallel (gradient all-reduce)"),
        Layout("tp", ("model",), _TP, description="Megatron tensor parallel"),
        Layout("tp_sp", ("model",), _TP + _SP, description="Megatron TP + sequence parallel"),
        Layout("dp_tp", ("data", "model"), _DP + _TP, description="2-D data x tensor parallel"),
        Layout(
            "zero2",
            ("data",),
            _DP,
            state_rules=_DP + _OVER_DATA,
            description="ZeRO-2: grads reduce-scattered, optimizer state sharded, params all-gathered",
        ),
        Layout(
            "zero3",
            ("data",),
            _DP + _OVER_DATA,
            description="ZeRO-3 / FSDP: params sharded over data",
        ),
        Layout("dap", ("dap",), _DAP, description="Evoformer dynamic axial parallelism"),
        Layout(
            "dp_dap", ("data", "dap"), _DP + _DAP, description="2-D data x dynamic axial parallel"
        ),
        Layout("ep", ("expert",), _EP, description="expert parallel: experts and batch over one axis"),
        Layout(
            "shard_map_dp",
            ("data",),
            (),
            style="shard_map",
            description="DP via shard_map inside jit with an explicit lax.pmean of gradients",
        ),
    )
}


def get_layout(name: str | Layout) -> Layout:
    """Returns the layout called ``name`` (or ``name`` itself if already a Layout)."""
    if isinstance(name, Layout):
        return name
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; expected one of {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def make_mesh(
    layout: str | Layout,
    shape: Sequence[int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds an Auto-axes mesh (classic GSPMD jit) for ``layout``.

    Args:
      layout: layout name or object; gives the axis names.
      shape: mesh shape; defaults to ``layout.default_mesh_shape(len(devices))``.
      devices: devices to use; defaults to ``jax.devices()``. A mesh of fewer devices
        than available takes the first ones.

    Raises:
      ValueError: the shape does not have one entry per mesh axis.
    """
    layout = get_layout(layout)
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(shape) if shape is not None else layout.default_mesh_shape(len(devices))
    if len(shape) != len(layout.mesh_axes):
        raise ValueError(
            f"layout {layout.name!r} has mesh axes {layout.mesh_axes}; got mesh shape {shape} "
            f"(give one size per axis)"
        )
    return jax.make_mesh(
        shape, layout.mesh_axes, axis_types=(AxisType.Auto,) * len(shape), devices=devices
    )
