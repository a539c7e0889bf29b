"""The "fuse_collectives" pass and the pass registry: every name Options accepts runs end to end.

* the HLO rewrite (``hlo_passes.fuse_collectives.rewrite``): compatible collectives become one
  variadic collective, XLA's parser accepts the module, incompatible or dependent
  members are refused;
* through ``optimize`` with ``fallback=False``: results bitwise equal to the original
  step, with XLA:CPU's own all-reduce combiner on and off, on model x layout cases;
* every name ``Options`` accepts is a registered pass and runs (derived from the table).
"""

import pytest

import concerto_jax
import hlo_passes
import models
from concerto_jax.capture import capture
from hlo_passes.fuse_collectives import fuse_group, fusion_key
from hlo_passes.registry import PASS_TABLE, PASSES, pass_names
from tests._helpers import (
    FAST,
    FULL_SWEEP,
    NO_COMBINER,
    assert_tree_bitwise,
    dp_mlp_step,
    run_bitwise_steps,
)


def _all_reduces(module):
    return [i for i in module.entry.instructions if i.opcode == "all-reduce"]


def test_rewrite_makes_one_variadic_all_reduce():
    step, ws, x = dp_mlp_step(batch=2048)
    module = hlo_passes.parse_module(capture(step, (ws, x), {}).hlo_text)
    ars = _all_reduces(module)
    assert len(ars) >= 4, "one gradient all-reduce per layer expected"
    keyed = [a for a in ars if fusion_key(a) is not None]
    same = [a for a in keyed if fusion_key(a) == fusion_key(keyed[0])]
    assert len(same) >= 2
    # Independent ones only (gradients of different layers are independent of each other's all-reduce).
    fused = fuse_group(module.entry, same[:2])
    hlo_passes.verify(module)
    assert fused.shape.is_tuple and len(fused.operands) == 2
    assert len(_all_reduces(module)) == len(ars) - 1
    hlo_passes.xla_parse(hlo_passes.module_to_text(module))  # XLA's parser accepts it


def test_rewrite_refuses_incompatible_or_dependent_members():
    text = """HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%mul (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] multiply(%a, %b)
}

ENTRY %main (p: f32[4]) -> (f32[4], f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %r1 = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %r2 = f32[4]{0} all-reduce(%r1), channel_id=2, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %r3 = f32[4]{0} all-reduce(%p), channel_id=3, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%mul
  ROOT %t = (f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%r1, %r2, %r3)
}
"""
    module = hlo_passes.parse_module(text)
    entry = module.entry
    r1, r2, r3 = (entry.instruction(n) for n in ("r1", "r2", "r3"))
    assert fusion_key(r1) == fusion_key(r2) != fusion_key(r3)
    with pytest.raises(ValueError, match="not compatible"):
        fuse_group(entry, [r1, r3])
    with pytest.raises(ValueError, match="cycle"):
        fuse_group(entry, [r1, r2])


@pytest.mark.parametrize("compiler_options", [{}, NO_COMBINER], ids=["xla-combiner", "no-combiner"])
def test_fuse_pass_through_optimize_is_bitwise_equal(compiler_options):
    step, ws, x = dp_mlp_step(batch=2048)
    opt = concerto_jax.optimize(step, concerto_jax.Options(
        passes=("fuse_collectives",), compiler_options=compiler_options, fallback=False))
    assert_tree_bitwise(opt(ws, x), step(ws, x))
    (record,) = opt.report().passes
    s = record.stats
    assert record.name == "fuse_collectives" and record.changed, s
    assert s["fused_groups"] >= 1 and s["collectives_after"] < s["collectives"]
    assert s["peak_bytes"] <= s["memory_limit_bytes"] == s["input_peak_bytes"]
    _, emitted = opt.hlo_texts()
    module = hlo_passes.parse_module(emitted)
    assert any(i.shape.is_tuple for i in _all_reduces(module)), "no variadic all-reduce emitted"
    assert len(_all_reduces(module)) == s["collectives_after"] - sum(
        i.opcode == "all-gather" for i in module.entry.instructions)


def test_options_accept_exactly_the_registered_passes():
    assert set(pass_names()) == set(PASS_TABLE)
    for name in pass_names():
        concerto_jax.Options(passes=(name,))
        assert callable(PASSES[name]), name
    with pytest.raises(ValueError, match="unknown pass"):
        concerto_jax.Options(passes=("no_such_pass",))
    with pytest.raises(TypeError, match="tuple of pass names"):
        concerto_jax.Options(passes="schedule")


# ViT x DP and Evoformer x DAP (all-to-alls; ~25-40 s on 2 cores) with CONCERTO_FULL_SWEEP=1; the DAP
# all-to-alls go through the recompile by default in tests/test_optimize_models.py (evoformer-dp_dap).
CASES = [("gpt", "dp_tp")] + ([("vit", "dp"), ("evoformer", "dap")] if FULL_SWEEP else [])


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_every_accepted_pass_runs_on_models(model, layout):
    """All accepted names in one pipeline, no fallback, over two steps: bitwise, or within the
    tolerance the passes declare (decompose's region split sums weight gradients per chunk:
    1e-3), checked against the bitwise run of every other pass too."""
    if (model, layout) not in models.list_cases():
        pytest.skip(f"{model}/{layout} is not a registered case")
    case = models.make_case(model, layout, "tiny")
    reference = case.step.lower(case.state, case.batch).compile(
        compiler_options={**FAST, **NO_COMBINER})
    names = pass_names()
    step = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=names, compiler_options={**FAST, **NO_COMBINER}, fallback=False))
    step(case.init_state(0), case.batch)  # first call: the pipeline runs, the report exists
    declared = max(p.tolerance for p in step.report().passes)
    run_bitwise_steps(reference, step, case, 2, tolerance=declared)
    report = step.report()
    assert report.optimized, report.fallback_reason
    assert [p.name for p in report.passes] == list(names)
    assert all(p.tolerance == 0 for p in report.passes if p.name != "decompose"), report.passes
    without = concerto_jax.optimize(case.step, concerto_jax.Options(
        passes=tuple(n for n in names if n != "decompose"), compiler_options={**FAST, **NO_COMBINER},
        fallback=False))
    run_bitwise_steps(reference, without, case, 2)
    for p in report.passes:  # passes that reorder or regroup report their peak and limit
        if p.name in ("schedule", "fuse_collectives"):
            assert p.stats["peak_bytes"] <= p.stats["memory_limit_bytes"], (p.name, p.stats)
