"""The replicated program must compile and match the jitted SPMD program bit for bit.

Two ways the HLO -> StableHLO -> HLO compile path used to break that:

* shard_map ``psum`` over a pytree: the partitioner gives all its all-reduces one
  channel id; XLA's layout assignment outside SPMD mode forces one layout per
  channel and rejects operands of different ranks
  (``hlo_passes.as_replicas.unique_all_reduce_channels``; since then the replicated
  program carries no channel ids at all, see ``spmd_to_replicated``);
* a softmax on a 2-D mesh: MLIR canonicalisation in the StableHLO -> HLO step
  folds the partitioner's reshape/broadcast chain, so XLA:CPU no longer turns
  ``e / broadcast(sum)`` into ``e * broadcast(1 / sum)`` as it does for the jitted
  program: 1-ulp differences (``hlo_passes.cpu_compensation.cpu_divide_by_broadcast``,
  applied by ``concerto_jax.executor.compensate_round_trip``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax.executor import compensate_round_trip, compile_replicated, parse_with_xla
from hlo_passes.as_replicas import unique_all_reduce_channels
from hlo_passes.cpu_compensation import cpu_divide_by_broadcast, cpu_widen_mixed_dots
from tests._helpers import ALWAYS_RECOMPILE, assert_tree_bitwise


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _optimized(step, *args):
    opt = concerto_jax.optimize(step, concerto_jax.Options(fallback=False,
                                                           optimize=ALWAYS_RECOMPILE))
    return opt, opt(*args)


def test_shard_map_psum_of_mixed_ranks_compiles_and_matches():
    mesh = _mesh((8,), ("x",))

    @jax.jit
    def step(a, b, x):
        def body(a, b, x):
            ga = jnp.einsum("bi,ijk->bjk", x, a).sum(0)
            gb = (x @ b).sum(0)
            return jax.lax.psum((ga.T, gb), "x")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("x")),
                             out_specs=(P(), P()), check_vma=False)(a, b, x)

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((16, 4, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    x = jax.device_put(jnp.asarray(rng.standard_normal((32, 16)), jnp.float32),
                       NamedSharding(mesh, P("x")))
    opt, out = _optimized(step, a, b, x)
    captured, emitted = opt.hlo_texts()
    # The premise: the partitioner shares one channel between the psum's all-reduces.
    assert captured.count("all-reduce(") >= 2 and "channel_id=1," in captured
    # No all-reduce of the replicated program keeps a channel (so none can share one).
    assert not re.findall(r"all-reduce\([^\n]*channel_id=", emitted)
    assert_tree_bitwise(out, step(a, b, x))


def test_trip_count_one_scan_with_collectives_is_inlined_as_in_the_jitted_program():
    # A one-layer scan whose body all-reduces (flattened ids). XLA inlines a trip-count-1 while
    # unless its body has a side effect, and outside SPMD mode a collective with a channel id
    # counts as one: the replicated program must carry no channel ids (spmd_to_replicated), or
    # XLA optimises it differently from the jitted program (the scanned Evoformer x DAP step
    # differed by an ulp that way).
    from concerto_jax import executor

    mesh = _mesh((8,), ("x",))

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(layer, x, ws)
        return (h * h).sum()

    step = jax.jit(jax.value_and_grad(loss))
    rng = np.random.default_rng(0)
    ws = jax.device_put(jnp.asarray(rng.standard_normal((1, 64, 64)) * 0.1, jnp.float32),
                        NamedSharding(mesh, P(None, "x")))
    x = jax.device_put(jnp.asarray(rng.standard_normal((16, 64)), jnp.float32), NamedSharding(mesh, P()))
    opt, out = _optimized(step, ws, x)
    captured, emitted = opt.hlo_texts()
    # The premise: a while loop with a flattened-id all-reduce, which the jitted program inlines.
    assert " while(" in captured and "use_global_device_ids=true" in captured
    assert " while(" not in step.lower(ws, x).compile().as_text()
    assert "channel_id=" not in emitted and "use_global_device_ids" not in emitted
    exe, _ = executor.compile_replicated(emitted, jax.devices()[:8])
    assert " while(" not in exe.hlo_modules()[0].to_string()
    assert_tree_bitwise(out, step(ws, x))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softmax_on_2d_mesh_matches_bitwise(dtype):
    """f32: XLA:CPU rewrites the softmax's divide by a broadcast on the jitted program, and so
    must our compensation. bf16 (Hugging Face's and MaxText's attention): XLA:CPU widens the
    divide to f32 before that rule, so the compensation leaves it alone; rewritten in bf16 the
    reciprocal was rounded once more and the step differed."""
    mesh = _mesh((2, 4), ("dp", "tp"))

    def loss(w, x):
        s = jnp.einsum("bqd,dhk->bhqk", x, w)
        s = jax.lax.with_sharding_constraint(s, NamedSharding(mesh, P("dp", "tp")))
        p = jax.nn.softmax(s, axis=-1).astype(jnp.float32)
        return (p * p).sum()

    step = jax.jit(jax.value_and_grad(loss))
    rng = np.random.default_rng(0)
    w = jax.device_put(jnp.asarray(rng.standard_normal((16, 8, 32)), dtype),
                       NamedSharding(mesh, P(None, "tp")))
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, 32, 16)), dtype),
                       NamedSharding(mesh, P("dp")))
    opt, out = _optimized(step, w, x)
    captured, emitted = opt.hlo_texts()
    if dtype == "float32":  # the premise: a divide the rule rewrites on the jitted program
        assert cpu_divide_by_broadcast(hlo_passes.parse_module(emitted)) >= 1
    else:  # the premise: a bf16 divide in the captured module
        assert re.search(r"= bf16\[[^\]]*\]\S* divide\(", captured)
    assert_tree_bitwise(out, step(w, x))


_DIV = """HloModule m

ENTRY %e (p: f32[4,8], s: f32[4]) -> (f32[4,8], f32[4,8], f32[4,8]) {
  %p = f32[4,8]{1,0} parameter(0)
  %s = f32[4]{0} parameter(1)
  %r = f32[4,1]{1,0} reshape(%s)
  %r2 = f32[4]{0} reshape(%r)
  %b = f32[4,8]{1,0} broadcast(%r2), dimensions={0}
  %d = f32[4,8]{1,0} divide(%p, %b)
  %b2 = f32[4,8]{1,0} broadcast(%s), dimensions={0}
  %d2 = f32[4,8]{1,0} divide(%p, %b2)
  %c = f32[4,1]{1,0} reshape(%s)
  %c2 = f32[4,1]{1,0} negate(%c)
  %b3 = f32[4,8]{1,0} broadcast(%c2), dimensions={0,1}
  %d3 = f32[4,8]{1,0} divide(%p, %b3)
  ROOT %t = (f32[4,8]{1,0}, f32[4,8]{1,0}, f32[4,8]{1,0}) tuple(%d, %d2, %d3)
}
"""


def test_cpu_divide_by_broadcast_only_single_use_divisors():
    module = hlo_passes.parse_module(_DIV)
    # %d: r2 has one use; %d2: s has several; %d3: c2 has one use, its size-1 dim is dropped.
    assert cpu_divide_by_broadcast(module) == 2
    hlo_passes.verify(module)
    entry = module.entry
    assert [o.opcode for o in entry.root.operands] == ["multiply", "divide", "multiply"]
    recip = entry.root.operands[0].operands[1].operands[0]
    assert recip.opcode == "divide" and recip.operands[1].name == "r2"
    recip3 = entry.root.operands[2].operands[1].operands[0]
    assert recip3.opcode == "divide" and recip3.shape.dims == (4,)
    assert recip3.operands[1].opcode == "reshape" and recip3.operands[1].operands[0].name == "c2"
    parse_with_xla(compensate_round_trip(_DIV, "cpu"))
    assert compensate_round_trip(_DIV, "gpu") == _DIV
    # bf16 divides: XLA:CPU widens them to f32 before its rule; left alone
    assert cpu_divide_by_broadcast(hlo_passes.parse_module(_DIV.replace("f32", "bf16"))) == 0


_MIXED_DOT = """HloModule m

ENTRY %e (a: bf16[4,2,64,16], b: bf16[4,64,2,8]) -> f32[4,2,16,8] {
  %a = bf16[4,2,64,16]{3,2,1,0} parameter(0)
  %b = bf16[4,64,2,8]{3,2,1,0} parameter(1)
  ROOT %d = f32[4,2,16,8]{3,2,1,0} dot(%a, %b), lhs_batch_dims={0,1}, lhs_contracting_dims={2}, rhs_batch_dims={0,2}, rhs_contracting_dims={1}
}
"""


def test_cpu_widen_mixed_dots_runs_decomposes_f32_partial_gemm_on_cpu():
    # decompose's partial chunk of a bf16 GEMM is an f32 dot of bf16 operands (it accumulates in
    # f32, as the GPU's GEMM does); XLA:CPU's runtime runs some but not this one (a batched dot
    # of attention whose contracting dim is not minor: "Unsupported element type for
    # DotThunk::Execute: BF16 x BF16 = F32"), so the executor widens the operands (exactly)
    module = hlo_passes.parse_module(_MIXED_DOT)
    assert cpu_widen_mixed_dots(module) == 1
    hlo_passes.verify(module)
    assert [o.opcode for o in module.entry.root.operands] == ["convert", "convert"]
    assert compensate_round_trip(_MIXED_DOT, "gpu") == _MIXED_DOT
    exe, _ = compile_replicated(_MIXED_DOT, jax.devices()[:1])
    a = (np.arange(4 * 2 * 64 * 16) % 8).astype(np.float32).reshape(4, 2, 64, 16) / 8
    b = (np.arange(4 * 64 * 2 * 8) % 4).astype(np.float32).reshape(4, 64, 2, 8) / 4
    args = [jax.device_put(jnp.asarray(x, jnp.bfloat16), jax.devices()[0]) for x in (a, b)]
    (out,) = exe.execute_sharded(args).disassemble_into_single_device_arrays()
    want = np.einsum("bhkm,bkhn->bhmn", a, b)  # a bf16 attention-style dot (Hugging Face GPT-2's)
    np.testing.assert_array_equal(np.asarray(out[0]), want)  # exact: small binary fractions


def test_unique_all_reduce_channels_renumbers_duplicates_only():
    text = """HloModule m, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %e (p: f32[4,2], q: f32[4]) -> (f32[4,2], f32[4], f32[4]) {
  %p = f32[4,2]{0,1} parameter(0)
  %q = f32[4]{0} parameter(1)
  %x = f32[4,2]{0,1} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %y = f32[4]{0} all-reduce(%q), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %z = f32[4]{0} all-reduce(%q), channel_id=3, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (f32[4,2]{0,1}, f32[4]{0}, f32[4]{0}) tuple(%x, %y, %z)
}
"""
    module = hlo_passes.parse_module(text)
    assert unique_all_reduce_channels(module) == 1
    assert [module.entry.instruction(n).channel_id for n in "xyz"] == [1, 4, 3]
