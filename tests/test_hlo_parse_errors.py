"""Malformed HLO text raises HloParseError naming the line, the line's text and what was expected."""

from __future__ import annotations

import pytest

import hlo_passes as h

GOOD = """HloModule m, entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = f32[4]{0} add(%a, %b), metadata={op_name="c"}
  ROOT %r = f32[4]{0} all-reduce(%c), replica_groups={}, to_apply=%add
}
"""
LINE_C = 12  # the line of %c above


def _break(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


def test_good_text_parses():
    module = h.verify(h.parse_module(GOOD))
    assert h.xla_canonical(str(module)) == h.xla_canonical(GOOD)


@pytest.mark.parametrize("old, new, line, expected", [
    ("%c = f32[4]{0} add", "%c f32[4]{0} add", LINE_C, "'%name = shape opcode(operands)'"),
    ("%c = f32[4]{0} add", "%c = f32<4> add", LINE_C, "a shape"),
    ("%c = f32[4]{0} add", "%c = f32[4,x]{0} add", LINE_C, "a dimension"),
    ('metadata={op_name="c"}', 'metadata={op_name="c"', LINE_C, "'}' closing this '{'"),
    ('metadata={op_name="c"}', 'metadata={op_name="c}', LINE_C, 'a closing "'),
    ("add(%a, %b)", "add(%a, %nope)", LINE_C, "%nope is not defined"),
    ("add(%a, %b)", "add(%a, %b", LINE_C, "',' or ')' after an operand"),
    ("add(%a, %b), metadata", "add(%a, %b) metadata", LINE_C, "',' followed by an attribute"),
    ("to_apply=%add", "to_apply=%missing", LINE_C + 1, "%missing is not defined"),
    ("%b = f32[4]{0} parameter(1)", "%b = f32[4]{0} parameter(x)", LINE_C - 1,
     "a parameter number"),
    ("%c = f32[4]{0} add(%a, %b)", "%a = f32[4]{0} add(%a, %b)", LINE_C, "%a is already defined"),
    ("  %c = f32[4]{0}", "  ROOT %c = f32[4]{0}", LINE_C + 1, "one ROOT per computation"),
    ("HloModule m", "HloModul m", 1, "'HloModule <name>'"),
    ("ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {",
     "ENTRY %main (a: f32[4], b: f32[4]) f32[4] {", LINE_C - 3, "'->'"),
])
def test_malformed_text_names_line_and_expectation(old, new, line, expected):
    text = _break(old, new)
    with pytest.raises(h.HloParseError) as info:
        h.parse_module(text, "bad.hlo")
    err = info.value
    assert err.line_no == line, str(err)
    assert err.line == text.splitlines()[line - 1]
    assert expected in err.expected, str(err)
    message = str(err)
    assert message.startswith(f"bad.hlo:{line}:{err.column}: expected ")
    assert err.line in message and "^" in message


def test_unterminated_computation_reports_end_of_input():
    text = GOOD.rstrip().rstrip("}")
    with pytest.raises(h.HloParseError) as info:
        h.parse_module(text)
    assert "'}' closing computation %main" in info.value.expected
    assert info.value.found == "end of input"


def test_parse_error_is_a_value_error():
    with pytest.raises(ValueError):
        h.parse_module("not hlo")


def test_undefined_operand_points_at_its_use():
    text = _break("add(%a, %b)", "add(%a, %nope)")
    with pytest.raises(h.HloParseError) as info:
        h.parse_module(text)
    assert info.value.line[info.value.column - 1:].startswith("%nope")


def test_forward_references_inside_a_computation_are_resolved():
    # XLA's parser accepts operands defined later in the text; so do we, and the
    # verifier then reports the order.
    text = GOOD.replace("  %a = f32[4]{0} parameter(0)\n", "").replace(
        "  %c = f32[4]{0} add", "  %a = f32[4]{0} parameter(0)\n  %c = f32[4]{0} add")
    text = text.replace("  %b = f32[4]{0} parameter(1)\n  %a", "  %a").replace(
        "  %c =", "  %b = f32[4]{0} parameter(1)\n  %c =")
    module = h.parse_module(text)
    h.verify(module)
    swapped = GOOD.replace("  %c = f32[4]{0} add(%a, %b), metadata={op_name=\"c\"}\n", "")
    swapped = swapped.replace("  %a = f32[4]{0} parameter(0)\n",
                              "  %c = f32[4]{0} add(%a, %b), metadata={op_name=\"c\"}\n"
                              "  %a = f32[4]{0} parameter(0)\n")
    module = h.parse_module(swapped)
    with pytest.raises(h.HloVerifyError, match="not defined before its use"):
        h.verify(module)
