"""Property test: random small modules round-trip through our parser/printer as XLA sees them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import hlo_passes as h

DTYPES = ["f32", "bf16", "s32", "f16"]
UNARY = ["negate", "abs", "copy"]
BINARY = ["add", "multiply", "subtract", "maximum"]
OP_NAMES = st.text(alphabet=st.sampled_from('abc/()_"\\ '), min_size=0, max_size=12)


@st.composite
def modules(draw):
    dtype = draw(st.sampled_from(DTYPES))
    dims = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    layout = ",".join(str(i) for i in reversed(range(len(dims))))
    shape = f"{dtype}[{','.join(map(str, dims))}]" + ("{" + layout + "}" if dims else "")
    nparams = draw(st.integers(1, 3))
    lines = [f"  %p{i} = {shape} parameter({i})" for i in range(nparams)]
    names = [f"p{i}" for i in range(nparams)]
    for k in range(draw(st.integers(1, 8))):
        attrs = ""
        if draw(st.booleans()):
            op_name = draw(OP_NAMES).replace("\\", "\\\\").replace('"', '\\"')
            attrs += f', metadata={{op_name="{op_name}"}}'
        if draw(st.booleans()):
            attrs += f', frontend_attributes={{_scheduling_group_id="{k}"}}'
        if draw(st.booleans()):
            op = draw(st.sampled_from(UNARY))
            args = f"%{draw(st.sampled_from(names))}"
        else:
            op = draw(st.sampled_from(BINARY))
            args = f"%{draw(st.sampled_from(names))}, %{draw(st.sampled_from(names))}"
        lines.append(f"  %v{k} = {shape} {op}({args}){attrs}")
        names.append(f"v{k}")
    outs = draw(st.lists(st.sampled_from(names), min_size=1, max_size=6))
    tuple_shape = "(" + ", ".join([shape] * len(outs)) + ")"
    lines.append(f"  ROOT %out = {tuple_shape} tuple({', '.join('%' + o for o in outs)})")
    params = ", ".join(f"p{i}: {shape.split('{')[0]}" for i in range(nparams))
    result = "(" + ", ".join([shape.split("{")[0]] * len(outs)) + ")"
    return ("HloModule prop\n\nENTRY %main (" + params + ") -> " + result + " {\n"
            + "\n".join(lines) + "\n}\n")


@settings(max_examples=40, deadline=None)
@given(modules())
def test_random_module_round_trips(text):
    module = h.verify(h.parse_module(text))
    printed = h.module_to_text(module)
    assert h.module_to_text(h.parse_module(printed)) == printed  # printing is a fixed point
    assert h.xla_canonical(printed) == h.xla_canonical(text)
