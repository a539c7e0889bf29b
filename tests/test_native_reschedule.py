"""deviceless.reschedule: joining idle async pairs and permuting the instruction lines of XLA's text (no plugin needed)."""

import pytest

import hlo_passes
from concerto_jax.deviceless.reschedule import join_idle_pairs, permute_text

_TEXT = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[8], p1: f32[8]) -> (f32[8], f32[8]) {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %ars1 = f32[8]{0} all-reduce-start(%p0), replica_groups={{0,1}}, to_apply=%add
  %ars2 = f32[8]{0} all-reduce-start(%p1), replica_groups={{0,1}}, to_apply=%add
  %ard1 = f32[8]{0} all-reduce-done(%ars1)
  %neg = f32[8]{0} negate(%p0)
  %ard2 = f32[8]{0} all-reduce-done(%ars2)
  ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%ard1, %ard2)
}
"""


def _names(order):
    return [i.name for i in order]


def test_join_idle_pairs_moves_the_done_up_not_the_start():
    module = hlo_passes.parse_module(_TEXT)
    got = _names(join_idle_pairs(list(module.entry.instructions)))
    # ars1..ard1 holds only another start: its done joins it (issue order ars1, ars2 kept);
    # ars2..ard2 holds a kernel (negate): left alone.
    assert got == ["p0", "p1", "ars1", "ard1", "ars2", "neg", "ard2", "t"]


def test_permute_text_reorders_lines_only():
    order = ["p1", "p0", "ars1", "ars2", "neg", "ard1", "ard2", "t"]
    text = permute_text(_TEXT, {"main": order})
    module = hlo_passes.parse_module(text)
    assert _names(module.entry.instructions) == order
    assert sorted(text.splitlines()) == sorted(_TEXT.splitlines())
    with pytest.raises(ValueError, match="names 7 instructions"):
        permute_text(_TEXT, {"main": order[:-1]})
    with pytest.raises(ValueError, match="not found"):
        permute_text(_TEXT, {"nope": order})
