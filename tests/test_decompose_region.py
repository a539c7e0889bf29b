"""The region strategy of the decompose pass: whole-step micro-batches with summed weight gradients.

Hand-written per-device modules (run as 8 replicas on the CPU, the all-reduce
really communicates) pin what a region is: where it starts (sources), which
members are partial (a dot contracting the split axis, a sum over it from 0)
and what stays outside (a sum from a non-zero init). The rewrite isolates the
chunks (each reads its outside operands through its own opt-barriers) and the
results equal the original within the reassociation of the partial sums.
Then the held-out Transformer step (``test_decompose_heldout``) runs 3 AdamW
steps with ``DecomposeOptions(region_degree=2)`` next to plain jit.
"""

import dataclasses

import numpy as np
import pytest

import concerto_jax
import concerto_jax.scheduler
import hlo_passes
from concerto_jax.deviceless import gpu_plugin_available
from concerto_jax.deviceless.compile import compile_replicated_for_target
from hlo_passes.decompose import DecomposeOptions
from hlo_passes.decompose.region import build_region
from hlo_passes.decompose.rewrite import split_instructions
from hlo_passes.ir import max_channel_id
from tests.test_decompose_heldout import optimised_three_steps
from tests.test_decompose_rules import N_DEV, _inputs, _module, _run

_TEXT = """HloModule m, replica_count=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,16], w: f32[16,4]) -> (f32[16,4], f32[], f32[8,4]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %h = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,4]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %y = f32[8,4]{1,0} tanh(%ar)
  %gw = f32[16,4]{1,0} dot(%x, %y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %zero = f32[] constant(0)
  %loss = f32[] reduce(%y, %zero), dimensions={0,1}, to_apply=%sum
  %rev = f32[8,4]{1,0} reverse(%y), dimensions={0}
  ROOT %out = (f32[16,4]{1,0}, f32[], f32[8,4]{1,0}) tuple(%gw, %loss, %rev)
}
"""


def _split_region(text: str, isolate: bool = True):
    """``text`` parsed, the region of its ``%ar`` along axis 0 split in 2 and verified:
    ``(module, region, SplitResult)``."""
    module = hlo_passes.parse_module(text)
    region = build_region(module.entry.instruction("ar"), 0)
    ids = iter(range(max_channel_id(module) + 1, 100))
    res = split_instructions(module.entry, region.plans, 2, lambda: next(ids), isolate=isolate)
    hlo_passes.verify(module)
    return module, region, res


def test_region_members_sources_and_partials():
    module = hlo_passes.parse_module(_TEXT)
    ar = module.entry.instruction("ar")
    region = build_region(ar, 0)
    names = {i.name: p for i, p in region.plans.items()}
    assert [(s.name, d) for s, d in region.sources] == [("x", 0)]
    # the weight gradient and the loss contract / reduce the split axis: summed chunks
    assert sorted(region.partial) == ["gw", "loss"]
    assert names["gw"].partial == "add" and names["gw"].operand_dims == (0, 0)
    assert names["loss"].partial == "add"
    # an op without a rule (reverse) stays outside and reads a concatenation
    assert "rev" not in names
    assert {"h", "ar", "y"} <= set(names) and names["h"].partial is None
    assert region.collectives() == 1 and region.divisible_by(2) and not region.divisible_by(16)


def test_region_rewrite_isolated_chunks_run_equal():
    inputs = _inputs(hlo_passes.parse_module(_TEXT))
    want = _run(_TEXT, inputs)
    module, _, res = _split_region(_TEXT)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    assert res.sums and res.barriers and len(res.concats) == 1  # rev reads a concatenation
    # chunk 1 reads the weight through its own barrier: no operand shared by both chunks
    c0, c1 = (module.entry.instruction(n) for n in res.chunks["h"])
    assert c0.operands[1].name == "w" and c1.operands[1].opcode == "opt-barrier"
    assert not set(map(id, c0.operands)) & set(map(id, c1.operands))
    assert module.entry.instruction(res.chunks["gw"][0]).shape.dims == (16, 4)  # whole output
    got = _run(text, inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_isolation_clones_cheap_producers():
    """A broadcast feeding the chunks is made again for chunk 1, at the chunk's shape, over
    chunk 1's barrier of its operand (the reduce); not barriered itself (a barrier would
    make XLA materialise the broadcast) nor sliced."""
    text = _TEXT.replace(
        "  %y = f32[8,4]{1,0} tanh(%ar)",
        "  %bw = f32[4]{0} reduce(%w, %zero), dimensions={0}, to_apply=%sum\n"
        "  %bb = f32[8,4]{1,0} broadcast(%bw), dimensions={1}\n"
        "  %arb = f32[8,4]{1,0} add(%ar, %bb)\n"
        "  %y = f32[8,4]{1,0} tanh(%arb)").replace(
        "  %zero = f32[] constant(0)\n  %loss", "  %loss").replace(
        "  %h = f32", "  %zero = f32[] constant(0)\n  %h = f32")
    module, _, res = _split_region(text)
    add1 = module.entry.instruction(res.chunks["arb"][1])
    chunk = add1.operands[1]  # chunk 1's rows: a broadcast of its own copy of the reduce
    assert chunk.opcode == "broadcast" and chunk.shape.dims == (4, 4)
    assert chunk.operands[0].opcode == "opt-barrier" and chunk.operands[0].operands[0].name == "bw"
    inputs = _inputs(hlo_passes.parse_module(text))
    got = _run(hlo_passes.module_to_text(module), inputs)
    want = _run(text, inputs)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


_STATS = """HloModule m, replica_count=8

%mx (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] maximum(%a, %b)
}

%sum (c: f32[], d: f32[]) -> f32[] {
  %c = f32[] parameter(0)
  %d = f32[] parameter(1)
  ROOT %e = f32[] add(%c, %d)
}

ENTRY %main (x: f32[8,16], w: f32[16,4], v: f32[16,4]) -> (f32[8,4], f32[8,4]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %v = f32[16,4]{1,0} parameter(2)
  %h = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ninf = f32[] constant(-inf)
  %m = f32[8]{0} reduce(%h, %ninf), dimensions={1}, to_apply=%mx
  %ar = f32[8]{0} all-reduce(%m), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%mx
  %b = f32[8,4]{1,0} broadcast(%ar), dimensions={0}
  %y = f32[8,4]{1,0} subtract(%h, %b)
  %g = f32[8,4]{1,0} dot(%x, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %arh = f32[8,4]{1,0} all-reduce(%h), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %arg = f32[8,4]{1,0} all-reduce(%g), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %z = f32[8,4]{1,0} add(%arh, %arg)
  ROOT %out = (f32[8,4]{1,0}, f32[8,4]{1,0}) tuple(%y, %z)
}
"""


ROW_STABLE_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_multi_thread_eigen": False}
"""XLA:CPU options under which a small dot computes each output row the same way whatever the
number of rows: no YNNPACK fusion, single-threaded Eigen. By default XLA:CPU runs dots as
YNNPACK fusions, whose kernel for f32[8,16] x f32[16,4] rounds rows differently from the
kernel for f32[4,16] x f32[16,4] on some CPUs (this AVX2 machine: 17 of 32 elements, with
jaxlib 0.10.2, 0.11.2 and 0.12.0.1 alike): a row-split dot is then not bitwise, and the pass
declares ``DecomposeOptions.split_tolerance`` for it. Multi-threaded Eigen also splits by shape."""


def _assert_dot_rows_stable(rows: int, k: int, cols: int):
    """The premise of a bitwise check of a row-split dot: under ``ROW_STABLE_DOTS`` the rows
    of ``f32[rows,k] x f32[k,cols]`` equal those of its two halves' dots, bit for bit."""
    half = rows // 2
    text = f"""HloModule rows, replica_count={N_DEV}

ENTRY %main (x: f32[{rows},{k}], w: f32[{k},{cols}]) -> (f32[{rows},{cols}], f32[{half},{cols}], f32[{half},{cols}]) {{
  %x = f32[{rows},{k}]{{1,0}} parameter(0)
  %w = f32[{k},{cols}]{{1,0}} parameter(1)
  %d = f32[{rows},{cols}]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %x0 = f32[{half},{k}]{{1,0}} slice(%x), slice={{[0:{half}], [0:{k}]}}
  %x1 = f32[{half},{k}]{{1,0}} slice(%x), slice={{[{half}:{rows}], [0:{k}]}}
  %d0 = f32[{half},{cols}]{{1,0}} dot(%x0, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %d1 = f32[{half},{cols}]{{1,0}} dot(%x1, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (f32[{rows},{cols}]{{1,0}}, f32[{half},{cols}]{{1,0}}, f32[{half},{cols}]{{1,0}}) tuple(%d, %d0, %d1)
}}
"""
    out = _run(text, _inputs(hlo_passes.parse_module(text)), ROW_STABLE_DOTS)
    n = N_DEV  # _run lists each output's shards, device by device
    for whole, top, bottom in zip(out[:n], out[n:2 * n], out[2 * n:], strict=True):
        np.testing.assert_array_equal(whole, np.concatenate([top, bottom]),
                                      err_msg="the premise of the bitwise check does not hold")


def _split_stats(isolate: bool):
    module, region, res = _split_region(_STATS, isolate)
    assert {"ar", "arh", "arg"} <= {i.name for i in region.plans}
    return module, res


def test_chunk_collectives_follow_each_other_through_a_barrier():
    """Chunk 1's all-reduce reads its operand through an opt-barrier with chunk 0's
    all-reduce (so XLA's combiners cannot merge the chunks back: the next test), except
    where the collective is summed with another one (``add(all-reduce, all-reduce)``,
    which XLA reassociates into one all-reduce only while each has that one user)."""
    module, res = _split_stats(isolate=True)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    entry = module.entry
    ar0, ar1 = (entry.instruction(n) for n in res.chunks["ar"])
    gte = ar1.operands[0]
    assert gte.opcode == "get-tuple-element" and gte.attr("index") == "1"
    barrier = gte.operands[0]
    assert barrier.opcode == "opt-barrier" and barrier.operands[0].opcode == "tuple"
    assert barrier.operands[0].operands[0] is ar0
    assert [u.opcode for u in ar0.users].count("tuple") == 1
    for name in ("arh", "arg"):  # reassociable: each chunk keeps its one user, the add
        c0, c1 = (entry.instruction(n) for n in res.chunks[name])
        assert c1.operands[0].opcode != "get-tuple-element"
        assert [u.opcode for u in c0.users] == ["add"]
    inputs = _inputs(hlo_passes.parse_module(_STATS))
    # no sum reassociated: bitwise where the dot kernel computes a row alike at 8 and 4 rows
    _assert_dot_rows_stable(8, 16, 4)
    for a, b in zip(_run(text, inputs, ROW_STABLE_DOTS), _run(_STATS, inputs, ROW_STABLE_DOTS), strict=True):
        np.testing.assert_array_equal(a, b)
    # XLA's own kernels: within the tolerance the pass declares for a split dot
    for a, b in zip(_run(text, inputs), _run(_STATS, inputs), strict=True):
        np.testing.assert_allclose(a, b, rtol=DecomposeOptions().split_tolerance, atol=1e-5)


@pytest.mark.skipif(not gpu_plugin_available(), reason="CUDA PJRT plugin missing: pip install -e .[gpu]")
def test_xla_gpu_keeps_ordered_chunk_collectives_apart():
    """XLA's GPU pipeline merges the two chunks of the unordered all-reduce back into one
    (its combiner joins independent all-reduces of one kind); ordered, they stay two.

    The async all-reduces of XLA's scheduled module are read through the IR: jaxlib 0.10.2
    wrote ``all-reduce-start(...)``; later ones write ``async-start(...)`` wrapping the
    all-reduce, or, for small ones, a ``fusion-start`` of a collective kernel fusion (the
    ordered f32[4] chunks under jaxlib 0.12)."""
    devices = list(concerto_jax.target_mesh("h100_sxm_8", (8,), ("d",)).devices.flat)
    shapes = {}
    for isolate in (False, True):
        module, _ = _split_stats(isolate)
        _, _, _, scheduled = compile_replicated_for_target(hlo_passes.module_to_text(module),
                                                           devices, after_lhs=True)
        starts = [i.collective_op for i in hlo_passes.parse_module(scheduled).instructions()
                  if i.async_role == "start" and i.collective_kind == "all-reduce"]
        shapes[isolate] = sorted(f"{op.shape.dtype}[{','.join(map(str, op.shape.dims))}]"
                                 for op in starts)
    assert shapes[False].count("f32[8]") == 1 and "f32[4]" not in shapes[False], shapes
    assert shapes[True].count("f32[4]") == 2 and "f32[8]" not in shapes[True], shapes


_GENERATED = """HloModule m, replica_count=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,16], w: f32[16,4], t: f32[8,4]) -> (f32[8,4], f32[8,4]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %t = f32[8,4]{1,0} parameter(2)
  %h = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,4]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %io = s32[8,4]{1,0} iota(), iota_dimension=1
  %two = s32[] constant(2)
  %offb = s32[8,4]{1,0} broadcast(%two), dimensions={}
  %idx = s32[8,4]{1,0} add(%io, %offb)
  %idxf = f32[8,4]{1,0} convert(%idx)
  %y = f32[8,4]{1,0} add(%ar, %idxf)
  %tt = f32[8,4]{1,0} tanh(%t)
  %zero = f32[] constant(0)
  %zb = f32[8,4]{1,0} broadcast(%zero), dimensions={}
  %gt = pred[8,4]{1,0} compare(%tt, %zb), direction=GT
  %sel = f32[8,4]{1,0} select(%gt, %y, %zb)
  ROOT %out = (f32[8,4]{1,0}, f32[8,4]{1,0}) tuple(%sel, %y)
}
"""


def test_generated_operands_are_shared_and_broadcasts_chunked():
    """An outside operand computed from iotas, constants and scalars only (a vocabulary
    index ``iota + offset``) is shared by the chunks like a constant: a barrier would make
    XLA materialise it. A chunk of a broadcast is a broadcast of the chunk's shape (not a
    slice of the whole). Operands read from memory (``tanh(t)``) keep their barrier."""
    module, region, res = _split_region(_GENERATED)
    members = {i.name for i in region.plans}
    assert {"ar", "y", "sel"} <= members and "idxf" not in members and "tt" not in members
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    entry = module.entry
    y0, y1 = (entry.instruction(n) for n in res.chunks["y"])
    assert y1.operands[1].opcode == "slice" and y1.operands[1].operands[0].name == "idxf"
    sel1 = entry.instruction(res.chunks["sel"][1])
    gt_slice, _, zb1 = sel1.operands
    assert zb1.opcode == "broadcast" and zb1.shape.dims == (4, 4) and zb1.operands[0].name == "zero"
    assert gt_slice.operands[0].opcode == "opt-barrier"  # compare(tanh(t), 0) reads memory
    inputs = _inputs(hlo_passes.parse_module(_GENERATED))
    _assert_dot_rows_stable(8, 16, 4)  # bitwise where the dot kernel splits by rows alike
    for a, b in zip(_run(text, inputs, ROW_STABLE_DOTS), _run(_GENERATED, inputs, ROW_STABLE_DOTS),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_run(text, inputs), _run(_GENERATED, inputs), strict=True):  # XLA's kernels
        np.testing.assert_allclose(a, b, rtol=DecomposeOptions().split_tolerance, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp", "dp_tp", "fsdp", "tp_scanned"])
def test_region_heldout_three_steps(layout):
    opt, report, rec = optimised_three_steps(layout, DecomposeOptions(region_degree=2))
    assert rec.changed, rec.stats
    for d in rec.stats["decomposed"]:
        assert d["sides"] == "region" and d["n"] == 2 and d["collectives"] >= 1
    partial = any(d["partial"] >= 1 for d in rec.stats["decomposed"])
    if layout != "fsdp":  # a batch region: micro-batches with summed weight gradients
        assert partial, rec.stats["decomposed"]
    # (fsdp: the region of a weight all-gather along its columns scores best since only the
    # communication a GEMM waits for counts: no partial member)
    if layout == "tp_scanned":  # the layers' collectives are in while bodies: split there,
        entry = hlo_passes.parse_module(opt.hlo_texts()[0]).entry.name  # activations in chunks
        body = [d for d in rec.stats["decomposed"] if d["computation"] != entry]
        assert body and all(d["carried_in_chunks"] for d in body), rec.stats["decomposed"]
    want = 1e-3 if partial else 1e-4
    assert rec.tolerance == rec.stats["tolerance"] == want
    assert report.first_step_check == \
        f"ran: outputs equal the original's (within relative tolerance {want:g})"


def test_half_precision_partials_accumulate_in_f32():
    """bf16 partial members: the weight-gradient dot's chunks output f32; with
    ``wide_partials`` the sum's chunks also reduce in f32 (a new scalar f32 add computation);
    one convert back to bf16 each (docs/DECISIONS.md D24)."""
    text = (_TEXT.replace("f32[8,16]", "bf16[8,16]").replace("f32[16,4]", "bf16[16,4]")
            .replace("f32[8,4]", "bf16[8,4]").replace("%loss = f32[]", "%loss = bf16[]")
            .replace("%zero = f32[]", "%zero = bf16[]").replace("-> (bf16[16,4], f32[],", "-> (bf16[16,4], bf16[],")
            .replace("(bf16[16,4]{1,0}, f32[], bf16[8,4]{1,0}) tuple", "(bf16[16,4]{1,0}, bf16[], bf16[8,4]{1,0}) tuple"))
    text = text.replace("ENTRY %main", """%sumh (c: bf16[], d: bf16[]) -> bf16[] {
  %c = bf16[] parameter(0)
  %d = bf16[] parameter(1)
  ROOT %e = bf16[] add(%c, %d)
}

ENTRY %main""").replace("%loss = bf16[] reduce(%y, %zero), dimensions={0,1}, to_apply=%sum",
                         "%loss = bf16[] reduce(%y, %zero), dimensions={0,1}, to_apply=%sumh")
    module = hlo_passes.parse_module(text)
    region = build_region(module.entry.instruction("ar"), 0)
    assert sorted(region.partial) == ["gw", "loss"]
    ids = iter(range(max_channel_id(module) + 1, 100))
    plain = hlo_passes.parse_module(text)
    plain_region = build_region(plain.entry.instruction("ar"), 0)
    split_instructions(plain.entry, plain_region.plans, 2, lambda: next(ids), isolate=True)
    assert not any(c.name.startswith("concerto_add") for c in plain.computations)  # default: bf16
    res = split_instructions(module.entry, region.plans, 2, lambda: next(ids), isolate=True,
                             wide_partials=True)
    hlo_passes.verify(module)
    hlo_passes.xla_parse(hlo_passes.module_to_text(module))
    entry = module.entry
    for name in ("gw", "loss"):
        chunks = [entry.instruction(c) for c in res.chunks[name]]
        assert all(c.shape.dtype == "f32" for c in chunks), [str(c.shape) for c in chunks]
    loss0 = entry.instruction(res.chunks["loss"][0])
    assert loss0.to_apply.name == "concerto_add_f32" and loss0.operands[0].opcode == "convert"
    root = entry.root
    assert root.operands[0].shape.dtype == "bf16" and root.operands[0].opcode == "convert"
    assert root.operands[1].shape.dtype == "bf16" and root.operands[1].opcode == "convert"


def test_bf16_real_step_checked_then_rebuilt_without_decompose_with_one_warning():
    """A bf16 GPT step with dropout keys (models.variants), default Options but the passes: the
    region split rounds the bias gradients differently from stock (stock sums them in bf16;
    Adam turns near-zero gradients into +-lr updates), so the first-step check finds
    differences beyond the declared 1e-3: that call returns the original's results, the next
    one rebuilds the step without the reassociating pass (the schedule stays) and checks it
    bitwise. One warning; every call bitwise equal to the original's."""
    import warnings

    from models import variants
    from tests._helpers import assert_tree_bitwise

    v = variants.make_variant("gpt", "dp_tp", ("bf16", "dropout"))
    want = v.step(*v.make_args(0))
    opt = concerto_jax.optimize(v.step, concerto_jax.Options(passes=("decompose", "schedule")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(*v.make_args(0))
        first = opt.report()
        got2 = opt(*v.make_args(0))
        got3 = opt(*v.make_args(0))
    for g in (got, got2, got3):
        assert_tree_bitwise(g, want)
    ours = [w for w in caught if "concerto_jax" in str(w.message)]
    assert len(ours) == 1 and "differs from the original" in str(ours[0].message), \
        [str(w.message)[:200] for w in caught]
    assert "['decompose'] that reassociate sums are left out" in str(ours[0].message)
    assert not first.optimized and first.first_step_check.startswith("ran: DIFFERED")
    rec = {p.name: p for p in first.passes}["decompose"]
    assert rec.stats["strategy"] == "region" and rec.tolerance == 1e-3
    report = opt.report()
    assert report.optimized and report.executable == "recompiled", report
    assert report.first_step_check.startswith("ran: outputs equal the original's (bitwise); "
                                              "['decompose'] left out"), report.first_step_check
    assert [p.name for p in report.passes] == ["schedule"] and report.passes[0].changed


_ONE_HOT = """HloModule m, replica_count=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8,16], w: f32[16,4], t: s32[8]) -> (f32[16,4], f32[]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %t = s32[8]{0} parameter(2)
  %h = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,4]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %y = f32[8,4]{1,0} tanh(%ar)
  %io = s32[8,4]{1,0} iota(), iota_dimension=1
  %tb = s32[8,4]{1,0} broadcast(%t), dimensions={0}
  %eq = pred[8,4]{1,0} compare(%io, %tb), direction=EQ
  %one = f32[] constant(1)
  %zero = f32[] constant(0)
  %ob = f32[8,4]{1,0} broadcast(%one), dimensions={}
  %zb = f32[8,4]{1,0} broadcast(%zero), dimensions={}
  %oh = f32[8,4]{1,0} select(%eq, %ob, %zb)
  %p = f32[8,4]{1,0} multiply(%y, %oh)
  %gw = f32[16,4]{1,0} dot(%x, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %loss = f32[] reduce(%p, %zero), dimensions={0,1}, to_apply=%sum
  ROOT %out = (f32[16,4]{1,0}, f32[]) tuple(%gw, %loss)
}
"""


def test_region_pulls_in_a_late_batch_input():
    """A second batch input that meets the region late (a loss's targets through a one-hot)
    is split at its source (s32[8]) instead of the one-hot (f32[8,4]) being computed whole and
    sliced; the chunks still compute the same loss and weight gradient."""
    import jax

    from hlo_passes.decompose.region import pull_in_inputs

    module = hlo_passes.parse_module(_ONE_HOT)
    region = build_region(module.entry.instruction("ar"), 0)
    names = {i.name for i in region.plans}
    assert [(s.name, d) for s, d in region.sources] == [("x", 0)]
    assert "oh" not in names and region.plans[module.entry.instruction("p")].operand_dims == (0, 0)
    pulled = pull_in_inputs(region, module.entry)
    assert sorted((s.name, d) for s, d in pulled.sources) == [("t", 0), ("x", 0)]
    assert {"tb", "eq", "oh", "p", "gw", "loss"} <= {i.name for i in pulled.plans}
    assert sorted(pulled.partial) == ["gw", "loss"]
    # an operand some non-member also reads is not pulled in (it would be computed twice)
    shared = hlo_passes.parse_module(_ONE_HOT.replace(
        "ROOT %out = (f32[16,4]{1,0}, f32[]) tuple(%gw, %loss)",
        "%r = f32[8,4]{1,0} reverse(%oh), dimensions={0}\n"
        "  ROOT %out = (f32[16,4]{1,0}, f32[], f32[8,4]{1,0}) tuple(%gw, %loss, %r)").replace(
        "-> (f32[16,4], f32[])", "-> (f32[16,4], f32[], f32[8,4])"))
    kept = pull_in_inputs(build_region(shared.entry.instruction("ar"), 0), shared.entry)
    assert [(s.name, d) for s, d in kept.sources] == [("x", 0)]

    inputs = _inputs(hlo_passes.parse_module(_ONE_HOT))
    devices = [a.device for a in inputs[0].addressable_shards]
    rep = inputs[0].sharding
    tgt = np.array([0, 3, 1, 2, 2, 0, 3, 1], np.int32)
    inputs[2] = jax.make_array_from_single_device_arrays(
        (8,), rep, [jax.device_put(tgt, d) for d in devices])
    want = _run(_ONE_HOT, inputs)
    ids = iter(range(max_channel_id(module) + 1, 100))
    split_instructions(module.entry, pulled.plans, 2, lambda: next(ids), isolate=True)
    hlo_passes.verify(module)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    assert "f32[4,4]{1,0} select(" in text  # the one-hot is built per chunk
    got = _run(text, inputs)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_unverifiable_reassociation_is_left_out_with_one_warning():
    """A region split reassociates sums (declared tolerance 1e-3; bf16 steps can exceed it), which
    only the first-step check verifies. A step with a host callback cannot run twice, so the
    check cannot run: optimize leaves the reassociating pass out (one warning) and the step is
    bitwise. Under "auto" with compiler_options the check now runs, against the original compiled
    with the same options, instead of being skipped."""
    import warnings

    import jax

    from concerto_jax.api import ConcertoFallbackWarning
    from tests._helpers import FAST
    from tests.test_decompose_heldout import _setup

    step, state, batches = _setup("dp_tp")

    @jax.jit
    def loud(state, batch):
        new, loss = step(state, batch)
        jax.debug.print("loss {}", loss)
        return new, loss

    fast = concerto_jax.scheduler.ScheduleOptions(full_model_max_tasks=0, odd_even=None)
    opts = concerto_jax.Options(passes=("decompose", "schedule"), scheduler=fast,
                                decompose=DecomposeOptions(region_degree=2))
    opt = concerto_jax.optimize(loud, opts)
    ref, got = state, jax.tree.map(np.copy, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches[:2]:
            ref, ref_loss = loud(ref, batch)
            got, loss = opt(got, batch)
            jax.effects_barrier()
            assert np.asarray(loss).tobytes() == np.asarray(ref_loss).tobytes()
    left_out = [w for w in caught if issubclass(w.category, ConcertoFallbackWarning)
                and "reassociate sums" in str(w.message)]
    assert len(left_out) == 1, [str(w.message) for w in caught]
    assert "['decompose']" in str(left_out[0].message) and "side effects" in str(left_out[0].message)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    report = opt.report()
    assert report.optimized and [p.name for p in report.passes] == ["schedule"], report.passes
    assert report.first_step_check.endswith("['decompose'] left out: they need the check")

    checked = concerto_jax.optimize(step, dataclasses.replace(opts, compiler_options=FAST))
    checked(jax.tree.map(np.copy, state), batches[0])
    report = checked.report()
    rec = {p.name: p for p in report.passes}["decompose"]
    assert rec.changed and rec.tolerance == 1e-3
    assert report.first_step_check == "ran: outputs equal the original's (within relative tolerance 0.001)", \
        report.first_step_check


def test_region_pull_in_off_and_on_end_to_end():
    """DecomposeOptions.region_pull_in both ways through optimize (fallback=False, 3 steps close
    to plain jit): with it, the held-out step's second batch input (the targets ``y``) is split
    at its sources, so the region has more sources and slices fewer outside operands."""
    seen = {}
    for pull in (False, True):
        _, report, rec = optimised_three_steps("dp_tp", DecomposeOptions(region_degree=2, region_pull_in=pull))
        (d,) = rec.stats["decomposed"]
        seen[pull] = d
        assert report.first_step_check.startswith("ran: outputs equal"), report.first_step_check
    assert seen[True]["sources"] > seen[False]["sources"]
    assert seen[True]["slices"] < seen[False]["slices"]


_SCATTERED = """HloModule m, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[64,256], w: f32[256,512], v: f32[512,512]) -> f32[8,512] {
  %x = f32[64,256]{1,0} parameter(0)
  %w = f32[256,512]{1,0} parameter(1)
  %v = f32[512,512]{1,0} parameter(2)
  %h = f32[64,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[64,512]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%sum
  %pid = u32[] partition-id()
  %eight = u32[] constant(8)
  %offset = u32[] multiply(%pid, %eight)
  %zero = u32[] constant(0)
  %ds = f32[8,512]{1,0} dynamic-slice(%ar, %offset, %zero), dynamic_slice_sizes={8,512}
  ROOT %y = f32[8,512]{1,0} dot(%ds, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_region_score_counts_an_all_reduce_xla_makes_a_reduce_scatter_as_one():
    """The partitioner's all-reduce + per-rank dynamic-slice runs as a reduce-scatter in
    XLA's final module: the region's communication is the reduce-scatter's, and a split
    along the sliced dimension (the chunks' all-reduces stay all-reduces: the slice reads
    their concatenation) pays the difference; along the other dimension the slice joins
    the region and each chunk is a reduce-scatter again."""
    from concerto_jax.costmodel import CostModel, get_cluster
    from hlo_passes.decompose.region import reduce_scatter_slice, score_region

    module = hlo_passes.parse_module(_SCATTERED)
    ar = module.entry.instruction("ar")
    groups = [list(range(8))]
    assert reduce_scatter_slice(ar, groups) is module.entry.instruction("ds")
    cm = CostModel(get_cluster("h100_sxm_8"))
    nbytes = 64 * 512 * 4
    t_ar = cm.collective("all-reduce", nbytes, groups).time_us
    t_rs = cm.collective("reduce-scatter", nbytes, groups).time_us
    assert t_rs < t_ar
    along_slice = build_region(ar, 0)
    assert "ds" not in {i.name for i in along_slice.plans}
    s0 = score_region(along_slice, 2, cm, 8)
    across = build_region(ar, 1)
    assert "ds" in {i.name for i in across.plans}
    s1 = score_region(across, 2, cm, 8)
    assert s0.comm_us == pytest.approx(t_rs) and s1.comm_us == pytest.approx(t_rs)
    # the same module with a constant offset (no reduce-scatter): the all-reduce's own
    # time, and no lost time in the overhead
    const = hlo_passes.parse_module(_SCATTERED.replace("dynamic-slice(%ar, %offset, %zero)",
                                                       "dynamic-slice(%ar, %zero, %zero)"))
    const_ar = const.entry.instruction("ar")
    assert reduce_scatter_slice(const_ar, groups) is None
    unscattered = score_region(build_region(const_ar, 0), 2, cm, 8)
    assert unscattered.comm_us == pytest.approx(t_ar)
    assert s0.overhead_us - unscattered.overhead_us == pytest.approx(t_ar - t_rs)
    assert s1.overhead_us < s0.overhead_us
    # a group of one is no reduce-scatter
    assert reduce_scatter_slice(ar, [[0]]) is None


_NORM_TEXT = _module("x: f32[8,1024,16], w: f32[16,16]", """  %x = f32[8,1024,16]{2,1,0} parameter(0)
  %w = f32[16,16]{1,0} parameter(1)
  %h = f32[8,1024,16]{2,1,0} dot(%x, %w), lhs_contracting_dims={2}, rhs_contracting_dims={0}
  %ar = f32[8,1024,16]{2,1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %y = f32[8,1024,16]{2,1,0} tanh(%ar)
  %p = f32[8,1024,16]{2,1,0} multiply(%y, %x)
  %zero = f32[] constant(0)
  %gn = f32[16]{0} reduce(%p, %zero), dimensions={0,1}, to_apply=%sum
  %gw = f32[16,16]{1,0} dot(%x, %y), lhs_contracting_dims={0,1}, rhs_contracting_dims={0,1}
  %ninf = f32[] constant(-inf)
  %gm = f32[16]{0} reduce(%y, %ninf), dimensions={0,1}, to_apply=%max
  %mx = f32[] reduce(%y, %ninf), dimensions={0,1,2}, to_apply=%max
  ROOT %out = (f32[16]{0}, f32[16,16]{1,0}, f32[16]{0}, f32[]) tuple(%gn, %gw, %gm, %mx)""",
                     "(f32[16], f32[16,16], f32[16], f32[])")


@pytest.mark.parametrize("keep_axis", [False, True])
def test_partial_reduces_keep_the_split_axis_per_chunk(keep_axis):
    """A partial column reduce over the split axis and others (a norm's weight gradient over
    batch and sequence: 8,192 rows, 4,096 per chunk, under XLA's tree-reduction bound): with
    ``keep_axis`` each chunk reduces over the other axes only (its output keeps the split axis
    at chunk size) and the chunks' sum is reduced over it once; a max the same way (exact).
    The weight-gradient dot and the full (row) reduction keep the whole-output form. Results
    equal the original's within the reassociation."""
    inputs = _inputs(hlo_passes.parse_module(_NORM_TEXT))
    want = _run(_NORM_TEXT, inputs)
    module = hlo_passes.parse_module(_NORM_TEXT)
    region = build_region(module.entry.instruction("ar"), 0)
    assert {"gn", "gw", "gm", "mx"} <= set(region.partial)
    ids = iter(range(max_channel_id(module) + 1, 100))
    res = split_instructions(module.entry, region.plans, 2, lambda: next(ids), isolate=True,
                             keep_axis=keep_axis)
    hlo_passes.verify(module)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    entry = module.entry
    gn0, gm0, mx0, gw0 = (entry.instruction(res.chunks[k][0]) for k in ("gn", "gm", "mx", "gw"))
    assert gw0.shape.dims == (16, 16) and mx0.shape.dims == ()
    if keep_axis:
        assert gn0.shape.dims == (4, 16) and gn0.attrs["dimensions"] == "{1}"
        assert gm0.shape.dims == (4, 16) and gm0.attrs["dimensions"] == "{1}"
        for final, combine in ((entry.root.operands[0], "add"), (entry.root.operands[2], "maximum")):
            assert final.opcode == "reduce" and final.attrs["dimensions"] == "{0}"
            assert final.operands[0].opcode == combine and final.shape.dims == (16,)
    else:
        assert gn0.shape.dims == (16,) and gm0.shape.dims == (16,)
    got = _run(text, inputs)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_kept_axis_rule_only_where_a_chunk_falls_under_xlas_tree_bound():
    from hlo_passes.decompose.rewrite import XLA_COLUMN_TREE_BOUND, SplitPlan, _kept_axis

    text = """HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sumh (c: bf16[], d: bf16[]) -> bf16[] {
  %c = bf16[] parameter(0)
  %d = bf16[] parameter(1)
  ROOT %e = bf16[] add(%c, %d)
}

ENTRY %main (x: f32[8,1024,64], y: bf16[8,1024,64], z: f32[16,1024,64], u: f32[8,4,2048]) -> (f32[64], bf16[64], f32[64], f32[2048], f32[1024]) {
  %x = f32[8,1024,64]{2,1,0} parameter(0)
  %y = bf16[8,1024,64]{2,1,0} parameter(1)
  %z = f32[16,1024,64]{2,1,0} parameter(2)
  %u = f32[8,4,2048]{2,1,0} parameter(3)
  %c = f32[] constant(0)
  %ch = bf16[] constant(0)
  %norm = f32[64]{0} reduce(%x, %c), dimensions={0,1}, to_apply=%sum
  %half = bf16[64]{0} reduce(%y, %ch), dimensions={0,1}, to_apply=%sumh
  %big = f32[64]{0} reduce(%z, %c), dimensions={0,1}, to_apply=%sum
  %few = f32[2048]{0} reduce(%u, %c), dimensions={0,1}, to_apply=%sum
  %row = f32[1024]{0} reduce(%x, %c), dimensions={0,2}, to_apply=%sum
  ROOT %t = (f32[64]{0}, bf16[64]{0}, f32[64]{0}, f32[2048]{0}, f32[1024]{0}) tuple(%norm, %half, %big, %few, %row)
}
"""
    entry = hlo_passes.parse_module(text).entry
    plan = SplitPlan(out_dim=0, operand_dims=(0, None), partial="add")
    assert XLA_COLUMN_TREE_BOUND == 4096
    # 8,192 rows, 4,096 per chunk: kept, as [4, 64] per chunk
    assert _kept_axis(entry.instruction("norm"), plan, 2, False) == ([1], [4, 64], 0)
    # the same in bf16: only where the chunks sum in f32
    assert _kept_axis(entry.instruction("half"), plan, 2, False) is None
    assert _kept_axis(entry.instruction("half"), plan, 2, True) == ([1], [4, 64], 0)
    # 16,384 rows, 8,192 per chunk: XLA tree-rewrites the chunks too; plain form
    assert _kept_axis(entry.instruction("big"), plan, 2, False) is None
    # 32 rows: under the bound before the split already
    assert _kept_axis(entry.instruction("few"), plan, 2, False) is None
    # a row reduction (its operand's minor dimension reduced)
    assert _kept_axis(entry.instruction("row"), plan, 2, False) is None
    # split along the reduced axis 1 instead: chunks [8,512,64] reduce axis 0, keep [512, 64]
    assert _kept_axis(entry.instruction("norm"), SplitPlan(0, (1, None), partial="add"), 2, False) \
        == ([0], [512, 64], 0)


def test_half_precision_kept_axis_sums_in_f32_and_rounds_once():
    """A bf16 norm-gradient reduce with ``wide_partials`` and ``keep_axis``: f32 chunks
    ([4,16], the split axis kept), an f32 reduce over it, one convert to bf16; the result is
    within one bf16 rounding of the same sum taken in f32 (XLA:CPU's own bf16 reduce is not:
    it accumulates in bf16)."""
    bf16 = (_NORM_TEXT
            .replace("%p = f32[8,1024,16]{2,1,0} multiply(%y, %x)",
                     "%pf = f32[8,1024,16]{2,1,0} multiply(%y, %x)\n  %p = bf16[8,1024,16]{2,1,0} convert(%pf)")
            .replace("%gn = f32[16]{0} reduce(%p, %zero), dimensions={0,1}, to_apply=%sum",
                     "%zh = bf16[] constant(0)\n  %gn = bf16[16]{0} reduce(%p, %zh), dimensions={0,1}, to_apply=%sumh")
            .replace("ENTRY %main", "%sumh (c2: bf16[], d2: bf16[]) -> bf16[] {\n  %c2 = bf16[] parameter(0)\n"
                     "  %d2 = bf16[] parameter(1)\n  ROOT %e2 = bf16[] add(%c2, %d2)\n}\n\nENTRY %main")
            .replace("-> (f32[16], f32[16,16]", "-> (bf16[16], f32[16,16]")
            .replace("ROOT %out = (f32[16]{0}, f32[16,16]", "ROOT %out = (bf16[16]{0}, f32[16,16]"))
    # the reference: the bf16 product summed in f32, rounded to bf16 once
    f32_sum = bf16.replace(
        "%zh = bf16[] constant(0)\n  %gn = bf16[16]{0} reduce(%p, %zh), dimensions={0,1}, to_apply=%sumh",
        "%p32 = f32[8,1024,16]{2,1,0} convert(%p)\n  %gn32 = f32[16]{0} reduce(%p32, %zero), dimensions={0,1}, "
        "to_apply=%sum\n  %gn = bf16[16]{0} convert(%gn32)")
    module = hlo_passes.parse_module(bf16)
    region = build_region(module.entry.instruction("ar"), 0)
    ids = iter(range(max_channel_id(module) + 1, 100))
    res = split_instructions(module.entry, region.plans, 2, lambda: next(ids), isolate=True,
                             wide_partials=True, keep_axis=True)
    hlo_passes.verify(module)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    gn0 = module.entry.instruction(res.chunks["gn"][0])
    assert str(gn0.shape) == "f32[4,16]{1,0}" and gn0.to_apply.name == "concerto_add_f32"
    out = module.entry.root.operands[0]
    assert out.opcode == "convert" and out.operands[0].opcode == "reduce" and out.shape.dtype == "bf16"
    inputs = _inputs(hlo_passes.parse_module(bf16))
    got, ref = _run(text, inputs), _run(f32_sum, inputs)
    for g, r in zip(got[:8], ref[:8], strict=True):  # output 0 (gn) on each device
        g, r = g.astype(np.float64), r.astype(np.float64)
        ulp = np.float64(2.0) ** (np.floor(np.log2(np.abs(r) + 1e-30)) - 7)
        assert np.all(np.abs(g - r) <= ulp), (g, r)
