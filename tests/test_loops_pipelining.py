"""Cross-iteration rewrite of scanned-layer loops (hlo_passes.pipeline_loops, "pipeline_loops" pass):
FSDP all-gathers of iteration i+1 issued in iteration i, bitwise for trip counts 1, 2 and odd."""

import pytest

import concerto_jax
import hlo_passes
from concerto_jax.capture import capture
from concerto_jax.options import Options
from concerto_jax.scheduler import ScheduleOptions
from hlo_passes.ir.loops import analyze_while
from hlo_passes.pipeline_loops import pipeline_prefetch, prefetch_candidates
from hlo_passes.registry import PASSES, PassOutcome
from tests._helpers import assert_tree_bitwise
from tests.test_loops import _LOOP, _scan_step


def _whiles(module):
    return [i for c in module.computations for i in c.instructions if i.opcode == "while"]


def _force_pipeline(module, options):
    """Test pass: apply the rewrite to every prefetchable all-gather, whether or not it pays."""
    n = 0
    for inst in _whiles(module):
        names = [c.collective for c in prefetch_candidates(module, inst)]
        n += len(pipeline_prefetch(module, inst, names))
    return PassOutcome(changed=n > 0, stats={"prefetched": n})


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_forced_prefetch_is_bitwise(num_layers, monkeypatch):
    monkeypatch.setitem(PASSES, "force_pipeline", _force_pipeline)
    step, params, x = _scan_step(num_layers, fsdp=True)
    opt = concerto_jax.optimize(step, Options(passes=("force_pipeline", "schedule"), fallback=False))
    got, want = opt(params, x), step(params, x)
    assert_tree_bitwise(got, want)
    report = opt.report()
    assert report.optimized, report.fallback_reason
    forced, sched = report.passes
    assert forced.stats["prefetched"] >= 2, "the FSDP weights (wi, wo) should be prefetched"
    _, emitted = opt.hlo_texts()
    module = hlo_passes.parse_module(emitted)
    for inst in _whiles(module):
        info = analyze_while(inst)
        assert info.trip_count == num_layers
    # The prologue gathers sit in the entry, before the loops.
    captured = hlo_passes.parse_module(opt.hlo_texts()[0])
    count = lambda m: sum(i.opcode == "all-gather" for i in m.entry.instructions)  # noqa: E731
    assert count(module) >= count(captured) + forced.stats["prefetched"]
    assert all(loop["trips"] == num_layers for loop in sched.stats["loops"])


def test_candidates_need_counter_and_invariant_data():
    body_gather = """
  %bw = f32[4,8] get-tuple-element(%bp), index=2
  %zero.i = s32[] constant(0)
  %ds = f32[1,8] dynamic-slice(%bw, %bi, %zero.i), dynamic_slice_sizes={1,8}
  %ag = f32[8,8] all-gather(%ds), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %r = f32[8] reduce(%ag, %zero.f), dimensions={0}, to_apply=%add"""
    text = _LOOP.format(bound=3, init=0, step=1, direction="LT", lhs="%ci, %bound", config="")
    text = (text.replace("(s32[], f32[8])", "(s32[], f32[8], f32[4,8])")
            .replace("num_partitions=1", "num_partitions=8")
            .replace("%bx = f32[8] get-tuple-element(%bp), index=1",
                     "%bx = f32[8] get-tuple-element(%bp), index=1" + body_gather
                     + "\n  %zero.f = f32[] constant(0)")
            .replace("%y = f32[8] multiply(%ar, %ar)", "%y = f32[8] multiply(%ar, %r)")
            .replace("ROOT %t = (s32[], f32[8], f32[4,8]) tuple(%next, %y)",
                     "ROOT %t = (s32[], f32[8], f32[4,8]) tuple(%next, %y, %bw)")
            .replace("ENTRY %main (x: f32[8])", "ENTRY %main (x: f32[8], wp: f32[4,8])")
            .replace("%x = f32[8] parameter(0)", "%x = f32[8] parameter(0)\n  %wp = f32[4,8] parameter(1)")
            .replace("tuple(%zero, %x)", "tuple(%zero, %x, %wp)")
            .replace("ENTRY %main (x: f32[8], wp: f32[4,8]) -> (s32[], f32[8], f32[4,8])",
                     "ENTRY %main (x: f32[8], wp: f32[4,8]) -> f32[8]")
            .replace("ROOT %w = (s32[], f32[8], f32[4,8]) while",
                     "%w = (s32[], f32[8], f32[4,8]) while")
            .replace("body=%body\n}", "body=%body\n  ROOT %out = f32[8] get-tuple-element(%w), index=1\n}"))
    # %zero.f is used before it is defined in the text above: move it first.
    text = text.replace("\n  %zero.f = f32[] constant(0)", "").replace(
        "%bi = s32[] get-tuple-element(%bp), index=0",
        "%bi = s32[] get-tuple-element(%bp), index=0\n  %zero.f = f32[] constant(0)")
    module = hlo_passes.parse_module(text)
    (inst,) = _whiles(module)
    cands = prefetch_candidates(module, inst)
    assert [c.collective for c in cands] == ["ag"]  # the all-reduce of carried %bx is not
    assert cands[0].bytes == 8 * 8 * 4 and set(cands[0].chain) == {"ds", "zero.i"}
    prologue = pipeline_prefetch(module, inst, ["ag"])
    hlo_passes.verify(module)
    hlo_passes.xla_parse(hlo_passes.module_to_text(module))
    assert len(prologue) == 1 and module.entry.instruction(prologue[0]).opcode == "all-gather"
    assert len(inst.shape.elements) == 4  # counter, x, weights, prefetched gather
    info = analyze_while(inst)
    assert info.trip_count == 3 and info.carried[3].bytes == 256 and not info.carried[3].invariant
    body = module.computation("body")
    gathers = [i for i in body.instructions if i.opcode == "all-gather"]
    assert len(gathers) == 1 and gathers[0].operands[0].operands[1] is body.root.operands[0]
    with pytest.raises(ValueError, match="not prefetchable"):
        pipeline_prefetch(module, inst, ["ar"])


def _fsdp_module(num_layers):
    step, params, x = _scan_step(num_layers, fsdp=True)
    return hlo_passes.parse_module(capture(step, (params, x)).hlo_text)


def test_pass_decides_by_cost_and_memory():
    module = _fsdp_module(4)
    loose = Options(passes=("pipeline_loops",), scheduler=ScheduleOptions(memory_limit_ratio=None))
    stats = PASSES["pipeline_loops"](module, loose).stats
    assert stats["loops"] == 2
    tried = [r for r in stats["per_loop"] if r.get("candidates")]
    assert tried, "the forward loop gathers its FSDP weights from the stacked params"
    for r in tried:
        assert r["extra_bytes"] > 0
        # The rule: applied exactly when the pipelined loop is predicted faster (no limit here).
        assert r["applied"] == (r["pipelined_loop_us"] < r["loop_us"]), r
        assert r["pipelined_peak_bytes"] >= r["body_peak_bytes"] - r["extra_bytes"]
    # An absolute limit below what the prefetched buffers need refuses every rewrite.
    module = _fsdp_module(4)
    tight = Options(passes=("pipeline_loops",), scheduler=ScheduleOptions(memory_limit_bytes=1))
    stats = PASSES["pipeline_loops"](module, tight).stats
    assert stats["pipelined"] == 0
    assert all(r["why"] in ("does not pay under the cost model", "no prefetchable all-gather")
               or r["why"].startswith("over the memory") for r in stats["per_loop"]), stats["per_loop"]


def test_pass_end_to_end_bitwise():
    step, params, x = _scan_step(3, fsdp=True)
    opts = Options(passes=("pipeline_loops", "schedule"), fallback=False,
                   scheduler=ScheduleOptions(memory_limit_ratio=None))
    opt = concerto_jax.optimize(step, opts)
    got, want = opt(params, x), step(params, x)
    assert_tree_bitwise(got, want)
    assert opt.report().optimized


_GATHER_LOOP = """HloModule gather_loop, num_partitions=8

%cond (cp: (s32[], f32[64,64], f32[{n},8,64])) -> pred[] {{
  %cp = (s32[], f32[64,64], f32[{n},8,64]) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %bound = s32[] constant({n})
  ROOT %lt = pred[] compare(%ci, %bound), direction=LT
}}

%body (bp: (s32[], f32[64,64], f32[{n},8,64])) -> (s32[], f32[64,64], f32[{n},8,64]) {{
  %bp = (s32[], f32[64,64], f32[{n},8,64]) parameter(0)
  %bi = s32[] get-tuple-element(%bp), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%bi, %one)
  %h = f32[64,64] get-tuple-element(%bp), index=1
  %ws = f32[{n},8,64] get-tuple-element(%bp), index=2
  %z = s32[] constant(0)
  %ds = f32[1,8,64] dynamic-slice(%ws, %bi, %z, %z), dynamic_slice_sizes={{1,8,64}}
  %w = f32[8,64] reshape(%ds)
  %ag = f32[64,64] all-gather(%w), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true
  %d = f32[64,64] dot(%h, %ag), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
{chain}
  ROOT %t = (s32[], f32[64,64], f32[{n},8,64]) tuple(%next, %e{k}, %ws)
}}

ENTRY %main (x: f32[64,64], wp: f32[{n},8,64]) -> f32[64,64] {{
  %x = f32[64,64] parameter(0)
  %wp = f32[{n},8,64] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64], f32[{n},8,64]) tuple(%zero, %x, %wp)
  %loop = (s32[], f32[64,64], f32[{n},8,64]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64] get-tuple-element(%loop), index=1
}}
"""


def _gather_loop(trips: int, chain: int):
    """A loop whose first op needs the gathered layer weight, then ``chain`` dependent kernels."""
    lines = ["  %e0 = f32[64,64] tanh(%d)"] + [
        f"  %e{k} = f32[64,64] tanh(%e{k - 1})" for k in range(1, chain)]
    return hlo_passes.parse_module(_GATHER_LOOP.format(n=trips, chain="\n".join(lines), k=chain - 1))


def test_pass_applies_where_the_gather_is_exposed():
    """The gather heads every iteration's dependency chain: prefetching it hides it behind the
    previous iteration, and the pass applies the rewrite when memory allows."""
    module = _gather_loop(trips=5, chain=12)
    loose = Options(passes=("pipeline_loops",), scheduler=ScheduleOptions(memory_limit_ratio=None))
    stats = PASSES["pipeline_loops"](module, loose).stats
    (r,) = stats["per_loop"]
    assert r["applied"] and r["why"] == "pays and fits", r
    assert r["pipelined_loop_us"] < r["loop_us"] and r["pipelined_body_us"] < r["body_us"]
    assert r["extra_bytes"] == 64 * 64 * 4 and stats["extra_carried_bytes"] == 64 * 64 * 4
    assert r["pipelined_peak_bytes"] > r["body_peak_bytes"], "the carried prefetch costs memory"
    hlo_passes.verify(module)
    hlo_passes.xla_parse(hlo_passes.module_to_text(module))
    assert any(i.opcode == "all-gather" for i in module.entry.instructions)  # the prologue
    # The default limit (never above the input order's peak) refuses the extra buffer.
    module = _gather_loop(trips=5, chain=12)
    (r,) = PASSES["pipeline_loops"](module, Options(passes=("pipeline_loops",))).stats["per_loop"]
    assert not r["applied"] and r["why"].startswith("over the memory limit"), r
