"""The combine-threshold search's pruning model: XLA's combiners emulated on a task graph."""

from __future__ import annotations

import math

from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.deviceless.thresholds import CombineProxy

MIB = 1 << 20

# Four 4 MiB gradient all-reduces in XLA's order; %ar2 reads %ar1's result (through %x), so no
# combiner may put them in one bucket.
FOUR = """HloModule four, is_scheduled=true, num_partitions=8

%sum (p: f32[], q: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %s = f32[] add(%p, %q)
}

ENTRY %main (a: f32[1048576], b: f32[1048576], c: f32[1048576], d: f32[1048576]) -> (f32[1048576], f32[1048576], f32[1048576]) {
  %a = f32[1048576]{0} parameter(0)
  %b = f32[1048576]{0} parameter(1)
  %c = f32[1048576]{0} parameter(2)
  %d = f32[1048576]{0} parameter(3)
  %ar0 = f32[1048576]{0} all-reduce(%a), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%sum
  %ar1 = f32[1048576]{0} all-reduce(%b), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%sum
  %x = f32[1048576]{0} multiply(%ar1, %c)
  %ar2 = f32[1048576]{0} all-reduce(%x), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%sum
  %ar3 = f32[1048576]{0} all-reduce(%d), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%sum
  %y = f32[1048576]{0} add(%ar0, %ar2)
  ROOT %t = (f32[1048576]{0}, f32[1048576]{0}, f32[1048576]{0}) tuple(%y, %ar3, %ar1)
}
"""


def _names(proxy, buckets):
    graph = proxy._comps[-1].hg.graph
    return [[graph.tasks[i].name for i in b] for b in buckets["main"]]


def test_buckets_follow_xlas_combiner_rules():
    proxy = CombineProxy(FOUR, CostModel(get_cluster("h100_sxm_8")))
    ar = {"all-reduce": 0}
    # below every collective's size: nothing merges
    assert _names(proxy, proxy.buckets({"all-reduce": MIB})) == []
    # 8 MiB: two per bucket, in XLA's order
    assert _names(proxy, proxy.buckets({"all-reduce": 8 * MIB})) == [["ar0", "ar1"], ["ar2", "ar3"]]
    # 64 MiB: %ar2 depends on %ar1, so it opens a bucket of its own, which %ar3 joins
    assert _names(proxy, proxy.buckets({"all-reduce": 64 * MIB})) == [["ar0", "ar1"], ["ar2", "ar3"]]
    # a kind the setting leaves out keeps the module's buckets
    assert _names(proxy, proxy.buckets({"all-gather": 64 * MIB})) == []
    assert proxy.signature({"all-reduce": MIB}) == proxy.signature(ar) != \
        proxy.signature({"all-reduce": 8 * MIB})


def test_estimate_prices_fewer_launches_and_is_finite():
    proxy = CombineProxy(FOUR, CostModel(get_cluster("h100_sxm_8")))
    alone, merged = proxy.us({"all-reduce": MIB}), proxy.us({"all-reduce": 8 * MIB})
    assert math.isfinite(alone) and math.isfinite(merged) and alone > 0 and merged > 0
    assert alone != merged  # the buckets change the estimate
    assert proxy.cycles == 0


def _module(body: str) -> str:
    return f"""HloModule m

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (a: f32[1024], b: f32[2048]) -> (f32[1024], f32[2048]) {{
  %a = f32[1024]{{0}} parameter(0)
  %b = f32[2048]{{0}} parameter(1)
{body}
}}
"""


def test_given_module_stands_for_the_smallest_size_only_where_nothing_was_combined():
    # XLA's module at the smallest threshold need not be compiled where the given one has no
    # combined collective and the given threshold is not below that size; a multi-operand
    # collective or one over a concatenated buffer (XLA's AllReduceContiguous) was combined.
    from concerto_jax.deviceless.combine_search import given_is_smallest

    separate = _module("""  %r0 = f32[1024]{0} all-reduce(%a), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %r1 = f32[2048]{0} all-reduce(%b), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (f32[1024]{0}, f32[2048]{0}) tuple(%r0, %r1)""")
    both = _module("""  %r = (f32[1024]{0}, f32[2048]{0}) all-reduce(%a, %b), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %r0 = f32[1024]{0} get-tuple-element(%r), index=0
  %r1 = f32[2048]{0} get-tuple-element(%r), index=1
  ROOT %t = (f32[1024]{0}, f32[2048]{0}) tuple(%r0, %r1)""")
    flat = _module("""  %c = f32[3072]{0} concatenate(%a, %b), dimensions={0}
  %r = f32[3072]{0} all-reduce(%c), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %r0 = f32[1024]{0} slice(%r), slice={[0:1024]}
  %r1 = f32[2048]{0} slice(%r), slice={[1024:3072]}
  ROOT %t = (f32[1024]{0}, f32[2048]{0}) tuple(%r0, %r1)""")
    kinds = ["all-reduce"]
    assert given_is_smallest(separate, {}, kinds, 512 << 10)
    assert not given_is_smallest(both, {}, kinds, 512 << 10)
    assert not given_is_smallest(flat, {}, kinds, 512 << 10)
    # a given threshold below the smallest size: the smallest size may combine what it did not
    flag = "xla_gpu_all_reduce_combine_threshold_bytes"
    assert not given_is_smallest(separate, {flag: 1024}, kinds, 512 << 10)
    assert given_is_smallest(separate, {flag: 1 << 20}, kinds, 512 << 10)
    # above XLA's default threshold the default no longer covers it
    assert not given_is_smallest(separate, {}, kinds, 64 << 20)
