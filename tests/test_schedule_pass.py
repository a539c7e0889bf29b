"""The "schedule" pass inside optimize: valid order, never slower under the cost model, bitwise results."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import concerto_jax.passes  # noqa: F401  (registers the passes)
import hlo_passes
from concerto_jax import pipeline
from concerto_jax.capture import capture
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph
from concerto_jax.passes.schedule_pass import order_from_events


def _dp_mlp_step():
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    @partial(jax.jit, in_shardings=(rep, dat), out_shardings=(rep, rep))
    def step(ws, x):
        v, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g, strict=True)], v

    ks = jax.random.split(jax.random.key(0), 5)
    ws = [jax.device_put(jax.random.normal(k, (64, 64)) * 0.1, rep) for k in ks[:4]]
    x = jax.device_put(jax.random.normal(ks[4], (32, 64)), dat)
    return step, ws, x


def test_schedule_pass_reorders_and_keeps_results():
    step, ws, x = _dp_mlp_step()
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), fallback=False))
    got = opt(ws, x)
    want = step(ws, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (record,) = opt.report().passes
    s = record.stats
    assert record.name == "schedule" and s["collectives"] >= 1
    assert s["lower_bound_us"] <= s["scheduled_us"] + 1e-6
    assert s["scheduled_us"] <= s["program_order_us"] + 1e-6, "the pass must never predict a slowdown"


def _latest_first_topological_order(graph):
    """A valid order unlike the text order: among ready tasks, take the highest index first."""
    import heapq

    indeg = [len(p) for p in graph.preds]
    heap = [-i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        i = -heapq.heappop(heap)
        order.append(i)
        for s in graph.succs[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, -s)
    return order


def test_order_from_events_is_a_valid_program_order():
    step, ws, x = _dp_mlp_step()
    cap = capture(step, (ws, x))
    module = hlo_passes.parse_module(cap.hlo_text)
    before = [i.name for i in module.entry.instructions]
    hg = build_taskgraph(module, CostModel(get_cluster("h100_sxm_8")), fold_aliases=False)
    events = hg.graph.synchronous_schedule(_latest_first_topological_order(hg.graph))
    hg.graph.check_schedule(events)
    order = order_from_events(hg, events, list(module.entry.instructions))
    assert sorted(i.name for i in order) == sorted(before)
    assert [i.name for i in order] != before
    module.entry.set_order(order)
    hlo_passes.verify(module)  # operands still come before their users
    bad = list(reversed(events))
    with pytest.raises(ValueError):
        hg.graph.check_schedule(bad)


def test_unknown_target_is_rejected():
    with pytest.raises(ValueError, match="unknown target"):
        concerto_jax.Options(target="tpu_v9")
    assert "schedule" in pipeline.PASSES
