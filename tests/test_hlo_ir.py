"""IR accessors, mutation helpers, replica groups, shapes and the verifier."""

from __future__ import annotations

import pathlib

import pytest

import hlo_passes as h
from hlo_passes.ir.shapes import Shape

DATA = pathlib.Path(__file__).parent / "data" / "hlo"

TWO_ALL_REDUCES = """HloModule two, num_partitions=8

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4], b: f32[2,3]) -> (f32[4], f32[2,3]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[2,3]{1,0} parameter(1)
  %pid = u32[] partition-id()
  %ar0 = f32[4]{0} all-reduce(%a), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%sum
  %ar1 = f32[2,3]{1,0} all-reduce(%b), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%sum
  ROOT %t = (f32[4]{0}, f32[2,3]{1,0}) tuple(%ar0, %ar1)
}
"""


def _module(text=TWO_ALL_REDUCES):
    return h.verify(h.parse_module(text))


def test_typed_accessors():
    m = _module()
    ar0 = m.entry.instruction("ar0")
    assert ar0.is_collective and ar0.collective_kind == "all-reduce"
    assert ar0.channel_id == 1 and ar0.use_global_device_ids
    assert ar0.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ar0.to_apply is m.computation("sum") and ar0.called_computations == [ar0.to_apply]
    assert ar0.users == [m.entry.root] and ar0.operands == [m.entry.instruction("a")]
    assert m.num_partitions == 8 and m.replica_count == 1 and not m.is_scheduled
    assert [p.name for p in m.entry.parameters] == ["a", "b"]
    assert repr(ar0).startswith("%ar0 = f32[4]{0} all-reduce(%a), channel_id=1")
    ar0.replica_groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    ar0.channel_id = 7
    assert "channel_id=7, replica_groups={{0,4},{1,5},{2,6},{3,7}}," in repr(ar0)
    h.verify(m)
    h.xla_parse(str(m))


def test_combine_all_reduces_into_a_tuple_all_reduce():
    """What the fusion pass does: one tuple all-reduce, get-tuple-elements, old ones removed."""
    m = _module()
    comp = m.entry
    ar0, ar1 = comp.instruction("ar0"), comp.instruction("ar1")
    shape = Shape.tuple_of([ar0.shape, ar1.shape])
    fused = h.Instruction("ar0", "all-reduce", shape, [ar0.operands[0], ar1.operands[0]],
                          dict(ar0.attrs))
    comp.add_instruction(fused, after=ar1)
    assert fused.name == "ar0.1"  # unique name
    for i, old in enumerate((ar0, ar1)):
        gte = h.Instruction("gte", "get-tuple-element", old.shape, [fused], {"index": str(i)})
        comp.add_instruction(gte, after=fused)
        comp.replace_all_uses(old, gte)
        comp.remove_instruction(old)
    comp.set_order(comp.post_order())
    h.verify(m)
    assert [i.opcode for i in comp.instructions].count("all-reduce") == 1
    assert fused.users and all(u.opcode == "get-tuple-element" for u in fused.users)
    h.xla_canonical(str(m))  # XLA accepts the rewritten module


def test_insert_start_done_pair_and_replace_partition_id():
    m = _module()
    comp = m.entry
    ar = comp.instruction("ar0")
    start = h.Instruction("ar0-start", "all-reduce-start", ar.shape, ar.operands, dict(ar.attrs))
    done = h.Instruction("ar0-done", "all-reduce-done", ar.shape, [start])
    comp.add_instruction(start, before=ar)
    comp.add_instruction(done, after=start)
    comp.replace_instruction(ar, done)
    assert done.async_start() is start and done.collective_kind == "all-reduce"
    assert start.async_role == "start" and done.async_role == "done"
    assert h.partition_id_to_replica_id(m) == 1
    h.verify(m)
    text = str(m)
    assert "partition-id" not in text and "replica-id()" in text
    h.xla_parse(text)


def test_mutation_guards_and_rename():
    m = _module()
    comp = m.entry
    a = comp.instruction("a")
    with pytest.raises(ValueError, match="still used by"):
        comp.remove_instruction(a)
    with pytest.raises(ValueError, match="ROOT"):
        comp.remove_instruction(comp.root)
    assert comp.rename(a, "b") == "b.1" and comp.instruction("b.1") is a
    assert m.unique_name("ar0") == "ar0.1" and m.unique_name("fresh") == "fresh"
    with pytest.raises(ValueError, match="permutation"):
        comp.set_order(comp.instructions[:-1])
    h.verify(m)


def test_control_predecessors_round_trip_and_order():
    m = _module()
    comp = m.entry
    ar0, ar1 = comp.instruction("ar0"), comp.instruction("ar1")
    ar0.add_control_predecessor(ar1)  # ar1 must run first now
    with pytest.raises(h.HloVerifyError, match="control predecessor"):
        h.verify(m)
    comp.set_order(comp.post_order())
    h.verify(m)
    again = h.parse_module(str(m))
    assert [p.name for p in again.entry.instruction("ar0").control_predecessors] == ["ar1"]
    assert h.xla_canonical(str(again)) == h.xla_canonical(str(m))


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.instruction("t").users.append(c.instruction("a")), "does not use it"),
    (lambda c: c.instruction("a").users.clear(), "missing from its users"),
    (lambda c: setattr(c.instruction("t"), "opcode", "get-tuple-element"), "get-tuple-element"),
    (lambda c: c.set_order(c.instructions[::-1]), "not defined before its use"),
    (lambda c: setattr(c.instruction("ar0"), "replica_groups", [[0, 1], [1, 2]]),
     "do not partition"),
    (lambda c: c.instruction("ar1").attrs.__setitem__("to_apply", h.Computation("ghost")),
     "not in the module"),
    (lambda c: setattr(c.instruction("b"), "parameter_number", 3), "parameter numbers"),
    (lambda c: setattr(c.instruction("ar1"), "name", "ar0"), "not unique"),
])
def test_verifier_rejects_broken_invariants(mutate, message):
    m = _module()
    mutate(m.entry)
    with pytest.raises(h.HloVerifyError, match=message) as info:
        h.verify(m)
    if info.value.instruction is not None:
        assert ">> " in str(info.value)  # shows the offender among its neighbours


def test_verifier_checks_async_pairing():
    m = _module()
    comp = m.entry
    ar = comp.instruction("ar0")
    start = h.Instruction("s", "all-reduce-start", ar.shape, ar.operands, dict(ar.attrs))
    comp.add_instruction(start, before=ar)
    with pytest.raises(h.HloVerifyError, match="exactly one all-reduce-done"):
        h.verify(m)


def test_generic_and_sugared_async_collectives_from_xla():
    kinds = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
    generic = h.parse_module((DATA / "gpu_shard_map_collectives.before_lhs.hlo").read_text())
    sugared = h.parse_module((DATA / "gpu_shard_map_collectives.final.hlo").read_text())
    for module in (generic, sugared):
        starts = [i for i in module.entry.instructions if i.async_role == "start"]
        assert {i.collective_kind for i in starts} == kinds
        for start in starts:
            (done,) = [u for u in start.users if u.async_role == "done"]
            assert done.async_start() is start and done.collective_kind == start.collective_kind
    wrapped = [i for i in generic.entry.instructions if i.opcode == "async-start"]
    assert {w.async_wrapped.opcode for w in wrapped} == {"reduce-scatter", "all-to-all"}


@pytest.mark.parametrize("text, groups", [
    ("{}", []),
    ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", [list(range(8))]),
    ("mesh['a'=2,'b'=4] {'a','b'}", [list(range(8))]),
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=8] {'a':(4)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}", [[0, 2], [1, 3]]),
    ("mesh['axis_0'=8,'axis_1'=1,'axis_2'=2], device_ids=([2,8]T(1,0)) {'axis_2'}",
     [[i, i + 8] for i in range(8)]),
])
def test_replica_group_forms_expand(text, groups):
    assert h.parse_replica_groups(text) == groups
    assert h.parse_replica_groups(h.format_replica_groups(groups)) == groups


def test_mesh_groups_with_device_ids_parse_inside_an_instruction():
    text = TWO_ALL_REDUCES.replace(
        "replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%sum\n  %ar1",
        "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}, "
        "use_global_device_ids=true, to_apply=%sum\n  %ar1")
    ar0 = h.parse_module(text).entry.instruction("ar0")
    assert ar0.replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ar0.use_global_device_ids and ar0.to_apply.name == "sum"


def test_shapes():
    s = h.parse_shape("(f32[4,8]{1,0}, (s32[], pred[2]{0}), bf16[<=3,5]{1,0:T(8,128)S(1)})")
    assert s.is_tuple and len(s.leaves()) == 4 and s.elements[1].elements[1].dtype == "pred"
    assert s.elements[0].byte_size == 128 and s.elements[2].dynamic == (True, False)
    assert str(s.elements[2]) == "bf16[<=3,5]{1,0:T(8,128)S(1)}"
    assert str(s.without_layout()) == "(f32[4,8], (s32[], pred[2]), bf16[<=3,5])"
    assert s.elements[0].minor_to_major == (1, 0) and h.parse_shape("token[]").is_token
    six = h.parse_shape("(" + ", ".join(["f32[]"] * 6) + ")")
    assert str(six) == "(f32[], f32[], f32[], f32[], f32[], /*index=5*/f32[])"
    with pytest.raises(ValueError):
        h.parse_shape("f32[4")


def test_large_constant_literal_round_trips():
    values = ", ".join(f"{i * 0.5}" for i in range(3000))
    text = TWO_ALL_REDUCES.replace(
        "  %pid = u32[] partition-id()\n",
        f"  %pid = u32[] partition-id()\n  %k = f32[3000]{{0}} constant({{{values}}})\n"
        "  %k2 = f32[2,2]{1,0} constant({ { 1, -inf }, { nan, 3e-05 } })\n")
    m = h.parse_module(text)
    assert m.entry.instruction("k").literal == "{" + values + "}"
    assert h.xla_canonical(str(m)) == h.xla_canonical(text)
