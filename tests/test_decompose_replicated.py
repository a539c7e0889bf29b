"""All-reduces of replicated operands (``hlo_passes.replicated_reductions.decide``): the uniformity
analysis (``hlo_passes.ir.uniformity``) on hand-written modules, and a DP x TP train step whose
replicated embedding table's gradient is reduced as slices + all-gather, bitwise equal to
plain jit."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax.capture import capture
from concerto_jax.costmodel import CostModel, get_cluster
from hlo_passes.decompose import DecomposeOptions
from hlo_passes.ir import Uniformity, labels_of_groups, sharding_tile_keys
from hlo_passes.replicated_reductions.decide import (
    aligned,
    complement_groups,
    plan_replicated_reductions,
)
from tests._helpers import assert_tree_bitwise

TP = [[0, 1, 2, 3], [4, 5, 6, 7]]  # the "model" groups of a (2, 4) mesh
DP = [[0, 4], [1, 5], [2, 6], [3, 7]]  # its "data" groups


def test_sharding_tile_keys_read_replicated_subgroups():
    shape = hlo_passes.parse_shape("f32[8,16]")
    same_within = lambda keys, groups: all(len({int(keys[d]) for d in g}) == 1 for g in groups)  # noqa: E731
    # Batch-sharded over "data", replicated over "model": one tile per TP group.
    keys = sharding_tile_keys("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", shape, 8)
    assert same_within(keys, TP) and not same_within(keys, DP)
    # Sharded over "model", replicated over "data" (a transposed iota): one tile per DP group.
    keys = sharding_tile_keys("{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", shape, 8)
    assert same_within(keys, DP) and not same_within(keys, TP)
    # The explicit device list form of the same.
    keys = sharding_tile_keys("{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}", shape, 8)
    assert same_within(keys, DP) and not same_within(keys, TP)
    assert same_within(sharding_tile_keys("{replicated}", shape, 8), [list(range(8))])
    # Manual subgroups, maximal and missing shardings prove nothing.
    for text in ("{devices=[2,1,4]<=[8] last_tile_dims={manual}}", "{maximal device=0}", "{manual}", None):
        keys = sharding_tile_keys(text, shape, 8)
        assert len(set(keys.tolist())) == 8, text
    tup = hlo_passes.parse_shape("(f32[8,16], s32[])")
    a, b = sharding_tile_keys("{{devices=[2,1,4]<=[8] last_tile_dim_replicate}, {replicated}}", tup, 8)
    assert same_within(a, TP) and same_within(b, [list(range(8))])


def test_sharding_tile_keys_read_mesh_form_shardings():
    """XLA >= 0.11 prints named shardings (``{mesh['data'=2,'model'=4], [{'data'}, {}]}``,
    ``{mesh[], replicated}``): devices with equal keys are those that differ only in axes no
    dimension is sharded over (sub-axes ``'x':(pre)size`` by their own coordinate) and
    none is ``unreduced``; a clause not read here proves nothing."""
    shape = hlo_passes.parse_shape("f32[8,8]")

    def classes(text):
        keys = sharding_tile_keys(text, shape, 8)
        return sorted(sorted(np.flatnonzero(keys == k).tolist()) for k in np.unique(keys))

    mesh = "mesh['data'=2,'model'=4]"
    assert classes("{mesh[], replicated}") == [list(range(8))]
    assert classes(f"{{{mesh}, [{{'data'}}, {{}}]}}") == TP
    assert classes(f"{{{mesh}, [{{}}, {{'model'}}]}}") == DP
    assert classes(f"{{{mesh}, [{{'model'}}, {{}}], replicated={{'data'}}}}") == DP
    for text in (f"{{{mesh}, [{{'data', 'model'}}, {{}}]}}", f"{{{mesh}, [{{'model'}}, {{'data'}}]}}",
                 f"{{{mesh}, [{{'data'}}, {{}}], unreduced={{'model'}}}}"):
        assert classes(text) == [[d] for d in range(8)], text
    # sub-axes: 'x':(1)2 is the minor factor of x (coordinate x % 2), 'x':(4)2 the major one
    assert classes("{mesh['x'=8], [{'x':(1)2}, {}]}") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert classes("{mesh['x'=8], [{'x':(4)2}, {}]}") == TP
    # a device order of its own (the replica-group form's device_ids)
    assert classes(f"{{{mesh}, device_ids=(0,2,4,6,1,3,5,7), [{{'data'}}, {{}}]}}") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for text in (f"{{{mesh}, [{{'data'}}, {{}}], manual_axes={{'model'}}}}",  # not read: unproven
                 "{mesh['data'=2,'model'=2], [{'data'}, {}]}",  # 4 devices of 8
                 "{mesh['d'=2,'e'=4], [{'f'}, {}]}"):  # an axis the mesh lacks
        assert classes(text) == [[d] for d in range(8)], text
    tup = hlo_passes.parse_shape("(f32[8,16], s32[])")
    a, b = sharding_tile_keys(f"{{{{{mesh}, [{{'data'}}, {{}}]}}, {{mesh[], replicated}}}}", tup, 8)
    assert len(set(a.tolist())) == 2 and len(set(b.tolist())) == 1


def test_captured_entry_parameters_keep_their_shardings():
    """The captured module's entry parameters carry shardings on every supported XLA (0.12
    drops them after partitioning: ``capture`` copies them from the partitioner's input),
    and the tile keys read from them group the devices as JAX places the shards (on a mesh
    whose devices are not in id order)."""
    devices = np.array(jax.devices()[:8])[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    specs = [P(), P("data"), P(None, "model"), P(("data", "model")), P("model", "data")]
    shardings = [NamedSharding(mesh, s) for s in specs]
    step = jax.jit(lambda *xs: [x * 2 for x in xs], in_shardings=shardings)
    args = [jax.device_put(np.zeros((8, 8), np.float32), sh) for sh in shardings]
    cap = capture(step, tuple(args))
    params = hlo_passes.parse_module(cap.hlo_text).entry.parameters
    assert len(params) == len(specs)
    for p, sh in zip(sorted(params, key=lambda p: p.parameter_number), shardings, strict=True):
        assert p.attr("sharding") is not None, p
        keys = sharding_tile_keys(p.attr("sharding"), p.shape, 8)
        index = sh.devices_indices_map((8, 8))
        # partition i runs on cap.device_list[i]: equal keys exactly where JAX puts equal tiles
        tiles = [str(index[d]) for d in cap.device_list]
        for i in range(8):
            for j in range(8):
                assert (keys[i] == keys[j]) == (tiles[i] == tiles[j]), (p.attr("sharding"), i, j)


def test_restore_parameter_shardings_copies_only_what_is_missing():
    """Each entry parameter without a sharding gets its partitioner-input one (by number);
    one that has a sharding, the other computations and a module whose parameters do not
    correspond are left alone."""
    from concerto_jax.capture import restore_parameter_shardings

    before = """HloModule m

%f (a: f32[]) -> f32[] {
  ROOT %a = f32[] parameter(0), sharding={replicated}
}

ENTRY %main (x: f32[8,8], y: f32[8]) -> f32[8,8] {
  %y = f32[8]{0} parameter(1), sharding={mesh['d'=8], [{'d'}]}, metadata={op_name="y"}
  ROOT %x = f32[8,8]{1,0} parameter(0), sharding={mesh[], replicated}
}
"""
    after = """HloModule m

%f (a: f32[]) -> f32[] {
  ROOT %a = f32[] parameter(0)
}

ENTRY %main (x: f32[8,8], y: f32[1]) -> f32[8,8] {
  %y = f32[1]{0} parameter(1), metadata={op_name="y"}
  ROOT %x = f32[8,8]{1,0} parameter(0), sharding={replicated}
}
"""
    got = restore_parameter_shardings(after, before)
    assert "%y = f32[1]{0} parameter(1), sharding={mesh['d'=8], [{'d'}]}, metadata={op_name=\"y\"}" in got
    assert "ROOT %x = f32[8,8]{1,0} parameter(0), sharding={replicated}\n" in got  # kept its own
    assert "ROOT %a = f32[] parameter(0)\n" in got  # not an entry parameter
    assert restore_parameter_shardings(after, before.replace("  %y = f32[8]{0} parameter(1)", "  %y = f32[8]{0} constant(1)")) == after
    assert restore_parameter_shardings(after, None) == after


_MODULE = """HloModule m, num_partitions=8

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

cond {
  st = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(st), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}

body {
  st = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(st), index=0
  v = f32[4] get-tuple-element(st), index=1
  one = s32[] constant(1)
  i1 = s32[] add(i, one)
  v1 = f32[4] multiply(v, v)
  ROOT out = (s32[], f32[4]) tuple(i1, v1)
}

body_pid {
  st = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(st), index=0
  v = f32[4] get-tuple-element(st), index=1
  one = s32[] constant(1)
  i1 = s32[] add(i, one)
  pid = u32[] partition-id()
  f = f32[] convert(pid)
  fb = f32[4] broadcast(f), dimensions={}
  v1 = f32[4] add(v, fb)
  ROOT out = (s32[], f32[4]) tuple(i1, v1)
}

ENTRY e {
  x = f32[4] parameter(0), sharding={devices=[2,4]<=[8] last_tile_dim_replicate}
  w = f32[4] parameter(1), sharding={replicated}
  pid = u32[] partition-id()
  f = f32[] convert(pid)
  fb = f32[4] broadcast(f), dimensions={}
  local = f32[4] add(w, fb)
  tp_sum = f32[4] all-reduce(local), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=add
  dp_sum = f32[4] all-reduce(x), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=add
  dp_local = f32[4] all-reduce(local), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=add
  zero = s32[] constant(0)
  init = (s32[], f32[4]) tuple(zero, x)
  loop = (s32[], f32[4]) while(init), condition=cond, body=body
  looped = f32[4] get-tuple-element(loop), index=1
  loop_pid = (s32[], f32[4]) while(init), condition=cond, body=body_pid
  looped_pid = f32[4] get-tuple-element(loop_pid), index=1
  ROOT t = (f32[4], f32[4], f32[4], f32[4], f32[4], f32[4]) tuple(local, tp_sum, dp_sum, dp_local, looped, looped_pid)
}
"""


def test_uniformity_rules_on_a_module():
    module = hlo_passes.parse_module(_MODULE)
    over_tp = Uniformity(module, labels_of_groups(TP, 8))
    over_dp = Uniformity(module, labels_of_groups(DP, 8))
    comp = module.entry
    get = comp.instruction
    assert over_tp.uniform(get("x")) and not over_dp.uniform(get("x"))  # batch sharded over data
    assert not over_tp.uniform(get("local"))  # reads partition-id
    assert over_tp.uniform(get("tp_sum"))  # every TP group reduces inside one group: same result
    assert not over_dp.uniform(get("tp_sum"))  # the two TP groups sum different partition ids
    assert over_tp.uniform(get("dp_sum"))  # uniform operand, groups aligned with the TP groups
    assert not over_tp.uniform(get("dp_local"))
    assert over_tp.uniform(get("looped"))  # the loop keeps its uniform state uniform
    assert not over_tp.uniform(get("looped_pid"))  # the body adds the partition id
    assert over_tp.value(get("loop_pid")) == (True, False)  # the counter stays uniform


def test_alignment_of_gather_groups():
    assert complement_groups(DP) == TP and complement_groups(TP) == DP
    assert aligned(DP, TP, 8)  # each DP pair sits at one position of the two TP groups
    assert not aligned(DP, [[0, 1, 2, 3], [5, 4, 7, 6]], 8)  # 0 and 4 would reduce different slices
    assert not aligned([[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]], 8)


V, D, F, T, B = 2048, 128, 256, 16, 8


def _step():
    """A DP x TP (2 x 4) step whose embedding table and norm scale are replicated and whose MLP
    is tensor-parallel, trained with AdamW."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = {"emb": P(), "scale": P(), "w1": P(None, "model"), "w2": P("model", None)}
    sh = {k: NamedSharding(mesh, s) for k, s in spec.items()}
    ks = jax.random.split(jax.random.key(0), 3)
    params = jax.device_put({"emb": jax.random.normal(ks[0], (V, D)) * 0.1, "scale": jnp.ones((D,)),
                             "w1": jax.random.normal(ks[1], (D, F)) * 0.1,
                             "w2": jax.random.normal(ks[2], (F, D)) * 0.1}, sh)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    rep = NamedSharding(mesh, P())
    state_sh = jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else rep,
                            (params, opt_state))
    state = jax.device_put((params, opt_state), state_sh)
    bsh = NamedSharding(mesh, P("data"))

    def loss(p, ids, y):
        x = jnp.take(p["emb"], ids, axis=0) * p["scale"]
        return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    @partial(jax.jit, in_shardings=(state_sh, bsh, bsh), out_shardings=(state_sh, rep))
    def step(state, ids, y):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, ids, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    rng = np.random.default_rng(0)
    batches = [(jax.device_put(rng.integers(0, V, (B, T)).astype(np.int32), bsh),
                jax.device_put(rng.standard_normal((B, T, D)).astype(np.float32), bsh))
               for _ in range(3)]
    return step, state, batches


def test_plan_slices_only_the_replicated_gradients():
    step, state, batches = _step()
    module = hlo_passes.parse_module(capture(step, (state, *batches[0])).hlo_text)
    # The analysis on every data-parallel all-reduce: the replicated parameters' gradients
    # (the embedding table's scatter-add, the norm scale's) and the loss are equal on the
    # 4 model ranks; the TP-sharded w1 / w2 gradients are not.
    over_tp = Uniformity(module, labels_of_groups(TP, 8))
    dp_reductions = [i for i in module.instructions() if i.opcode == "all-reduce"
                     and sorted(map(sorted, i.replica_groups or [])) == DP]
    assert {i.shape.dims for i in dp_reductions} == {(V, D), (D,), (D, F // 4), (F // 4, D), ()}
    for ar in dp_reductions:
        assert over_tp.uniform(ar.operands[0]) == (ar.shape.dims in ((V, D), (D,), ())), ar
    # The plan: only the 1 MiB table gradient pays for its gather across two hosts.
    two_hosts = plan_replicated_reductions(module, CostModel(get_cluster("h100_sxm_2x4")))
    assert [p["instruction"].shape.dims for p in two_hosts] == [(V, D)], two_hosts
    assert two_hosts[0]["h"] == 4 and two_hosts[0]["after_us"] < two_hosts[0]["before_us"]
    # On one NVLink host the gather costs what the slice saves: nothing is rewritten.
    assert plan_replicated_reductions(module, CostModel(get_cluster("h100_sxm_8"))) == []


def _decompose_on_two_hosts(step):
    """``step`` through ``optimize`` with the decompose pass alone, no region split, targeting
    2 hosts x 4 GPUs (the CPU mesh's 8 devices), no fallback."""
    return concerto_jax.optimize(step, concerto_jax.Options(
        passes=("decompose",), target="h100_sxm_2x4", fallback=False,
        decompose=DecomposeOptions(region_degree=None)))


def _replicated_record(opt, kind: str) -> dict:
    """The decompose pass's one record of a sliced ``kind``; it saves time with h = 4."""
    rec = {p.name: p for p in opt.report().passes}["decompose"]
    (r,) = [r for r in rec.stats["replicated"] if r["kind"] == kind]
    assert r["h"] == 4 and r["after_us"] < r["before_us"], rec.stats["replicated"]
    return r


def test_replicated_gradients_sliced_bitwise_over_three_steps():
    step, state, batches = _step()
    opt = _decompose_on_two_hosts(step)
    ref, got = state, jax.tree.map(jnp.copy, state)
    for ids, y in batches:
        ref, ref_loss = step(ref, ids, y)
        got, loss = opt(got, ids, y)
        assert_tree_bitwise(loss, ref_loss)
    assert_tree_bitwise(got, ref)
    report = opt.report()
    assert report.optimized, report.fallback_reason
    rec = {p.name: p for p in report.passes}["decompose"]
    assert rec.tolerance == 0.0, rec.stats
    assert _replicated_record(opt, "all-reduce")["bytes"] == V * D * 4
    _, emitted = opt.hlo_texts()
    assert "all-gather" in emitted


def test_reduce_scatter_of_a_replicated_operand_sliced_bitwise():
    """shard_map: a psum over "model" (equal on every model rank) reduce-scattered over "data"
    (across the hosts of h100_sxm_2x4): each model rank reduce-scatters 1/4 of every block
    and an all-gather over "model" puts its block together."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x):
        y = jax.lax.psum(jnp.tanh(x), "model")
        return jax.lax.psum_scatter(y, "data", scatter_dimension=0, tiled=True)

    @jax.jit
    def step(x):
        return jax.shard_map(body, mesh=mesh, in_specs=P(None, "model"),
                             out_specs=P("data", "model"))(x)

    x = jax.device_put(np.random.default_rng(0).standard_normal((4096, 1024)).astype(np.float32),
                       NamedSharding(mesh, P(None, "model")))
    opt = _decompose_on_two_hosts(step)
    assert_tree_bitwise(opt(x), step(x))
    _replicated_record(opt, "reduce-scatter")


def test_all_gather_of_a_replicated_operand_sliced_bitwise():
    """shard_map: a psum over "model" all-gathered over "data" (across the hosts): each model
    rank gathers 1/4 of every shard, an all-gather over "model" and a transpose rebuild it."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def body(x):
        y = jax.lax.psum(jnp.tanh(x), "model")
        return jax.lax.all_gather(y, "data", axis=1, tiled=True) * 2.0

    @jax.jit
    def step(x):
        return jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"),
                             out_specs=P("data", "model"))(x)

    x = jax.device_put(np.random.default_rng(1).standard_normal((1024, 2048)).astype(np.float32),
                       NamedSharding(mesh, P("data", "model")))
    opt = _decompose_on_two_hosts(step)
    assert_tree_bitwise(opt(x), step(x))
    _replicated_record(opt, "all-gather")
    _, emitted = opt.hlo_texts()
    assert "transpose(" in emitted


def test_cross_replica_collectives_with_one_replica_reduce_alone():
    """Without a channel id an all-reduce is cross-replica: with one replica each device
    reduces alone, so its result is only as uniform as its operand."""
    text = _MODULE.replace(
        "ROOT t = (f32[4], f32[4], f32[4], f32[4], f32[4], f32[4]) tuple(local, tp_sum, dp_sum, dp_local, looped, looped_pid)",
        "alone = f32[4] all-reduce(local), replica_groups={}, to_apply=add\n"
        "  ROOT t = (f32[4], f32[4]) tuple(local, alone)")
    module = hlo_passes.parse_module(text)
    over_tp = Uniformity(module, labels_of_groups(TP, 8))
    assert not over_tp.uniform(module.entry.instruction("alone"))


def test_replicated_reductions_off_leaves_the_collectives_whole():
    """``DecomposeOptions(replicated_reductions=False)``: the same step runs end to end, bitwise,
    with nothing sliced."""
    step, state, batches = _step()
    opt = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("decompose",), target="h100_sxm_2x4", fallback=False,
        decompose=DecomposeOptions(region_degree=None, replicated_reductions=False)))
    ids, y = batches[0]
    assert_tree_bitwise(opt(state, ids, y), step(state, ids, y))
    rec = {p.name: p for p in opt.report().passes}["decompose"]
    assert "replicated" not in rec.stats
