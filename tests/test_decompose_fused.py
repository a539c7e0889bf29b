"""The decompose pass judges with fusion-aware costs when given XLA's scheduled module.

A hand-written post-SPMD module (an all-reduce beside an independent chain of 8 elementwise
ops, then tanh and negate of its result) and XLA's module of it (the chain fused into one
loop kernel, tanh + negate into another): costed one kernel per op the chain hides the
all-reduce; costed by XLA's kernels it does not.
"""

import dataclasses

import pytest

import concerto_jax
from concerto_jax import scheduler
from concerto_jax.costmodel import CostModel, collective_cost, get_cluster, op_info
from concerto_jax.costmodel.fused import fused_costs
from hlo_passes.decompose.cost import Calibration
from hlo_passes.decompose.options import DecomposeOptions
from hlo_passes.decompose.run import decompose_pass
from hlo_passes.decompose.search import _copy, apply, find_candidates, trial_durations
from hlo_passes.ir.parser import parse_module
from hlo_passes.registry import NO_INPUTS, PASSES, PassInputs, PassOutcome

CHAIN = ("exponential", "tanh", "negate", "exponential", "tanh", "negate", "exponential", "tanh")
LAYOUT = ("entry_computation_layout={(f32[2048,4096]{1,0}, f32[4096,4096]{1,0})->"
          "(f32[2048,4096]{1,0}, f32[4096,4096]{1,0})}, num_partitions=8")
SUM = "sum {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT s = f32[] add(a, b)\n}\n"
AR = ("  ar = f32[2048,4096]{1,0} all-reduce(x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, "
      "use_global_device_ids=true, to_apply=sum\n")
PARAMS = "  x = f32[2048,4096]{1,0} parameter(0)\n  y = f32[4096,4096]{1,0} parameter(1)\n"


def _chain(first: str, prefix: str) -> tuple[str, str]:
    lines, prev = [], first
    for k, opc in enumerate(CHAIN):
        lines.append(f'  {prefix}{k} = f32[4096,4096]{{1,0}} {opc}({prev}), metadata={{op_name="f/e{k}"}}\n')
        prev = f"{prefix}{k}"
    return "".join(lines), prev


def pre_text() -> str:
    chain, last = _chain("y", "e")
    return (f"HloModule pre, {LAYOUT}\n\n{SUM}\nENTRY main {{\n{PARAMS}{AR}{chain}"
            '  t = f32[2048,4096]{1,0} tanh(ar), metadata={op_name="g/t"}\n'
            '  t2 = f32[2048,4096]{1,0} negate(t), metadata={op_name="g/t2"}\n'
            f"  ROOT out = (f32[2048,4096]{{1,0}}, f32[4096,4096]{{1,0}}) tuple(t2, {last})\n}}\n")


def xla_text() -> str:
    chain, last = _chain("p0", "f")
    chain = chain.replace(f"  {last} =", f"  ROOT {last} =")
    return (f"HloModule xla, is_scheduled=true, {LAYOUT}\n\n{SUM}\n"
            f"chain_fusion {{\n  p0 = f32[4096,4096]{{1,0}} parameter(0)\n{chain}}}\n\n"
            "t_fusion {\n  q0 = f32[2048,4096]{1,0} parameter(0)\n"
            '  t.3 = f32[2048,4096]{1,0} tanh(q0), metadata={op_name="g/t"}\n'
            '  ROOT t.4 = f32[2048,4096]{1,0} negate(t.3), metadata={op_name="g/t2"}\n}\n\n'
            f"ENTRY main {{\n{PARAMS}{AR}"
            "  fusion.1 = f32[4096,4096]{1,0} fusion(y), kind=kLoop, calls=chain_fusion\n"
            "  fusion.2 = f32[2048,4096]{1,0} fusion(ar), kind=kLoop, calls=t_fusion\n"
            "  ROOT out = (f32[2048,4096]{1,0}, f32[4096,4096]{1,0}) tuple(fusion.2, fusion.1)\n}\n")


def _options():
    # No memory limit: the pair is about compute costs, not the memory rule.
    return concerto_jax.Options(passes=("decompose",), target="h100_sxm_8",
                                scheduler=scheduler.ScheduleOptions(memory_limit_bytes=1 << 40),
                                decompose=DecomposeOptions(region_degree=None))


def test_fused_reference_makes_the_hidden_all_reduce_critical():
    unfused = decompose_pass(parse_module(pre_text()), _options()).stats
    fused = decompose_pass(parse_module(pre_text()), _options(), PassInputs(fused_reference=xla_text())).stats
    assert unfused["costs"] == "unfused" and fused["costs"] == "fused"
    # one kernel per op: 8 x 52 us of independent chain cover the all-reduce (150.7 us, NVLS)
    assert unfused["critical"] == 0 and unfused["judged"]["main"]["exposed_comm_us"] == 0.0
    # XLA's kernels: the chain is one 52 us loop fusion, most of the all-reduce is exposed
    assert fused["critical"] == 1
    rec = fused["most_exposed"][0]
    ar_us = collective_cost("all-reduce", 2048 * 4096 * 4, range(8), get_cluster("h100_sxm_8")).time_us
    assert rec["collective"] == "ar" and rec["exposed_us"] > 0.5 * ar_us
    # the judge's compute is XLA's kernel time (every instruction mapped)
    s = fused["fused_costs"]
    assert s["coverage"] == 1.0 and s["fused_total_us"] == pytest.approx(s["kernel_us"])
    assert s["fused_total_us"] < 0.3 * s["unfused_total_us"]


def test_trial_durations_cost_chunks_by_their_original_ratio():
    cm = CostModel(get_cluster("h100_sxm_8"))
    module = parse_module(pre_text())
    fc = fused_costs(module, xla_text(), cm, unmapped="zero")
    # t and t2 share one loop kernel: each costs about half its unfused estimate
    assert 0.3 < fc.ratio("t") < 0.7 and 0.3 < fc.ratio("t2") < 0.7
    dopts = DecomposeOptions(region_degree=None)
    found = find_candidates(module, cm, Calibration(1.1, 0.0, "test"), dopts,
                            scheduler.ScheduleOptions(memory_limit_bytes=1 << 40), fused=fc)
    cand = next(c for c in found.candidates if c.n == 2 and "t" in {i.name for i in
                                                                     found.contexts[c.key].plans})
    trial = _copy(module)
    chunks_of: dict = {}
    apply(trial, [cand], found.contexts, chunks_of)
    dur = trial_durations(trial, fc, chunks_of, cm)
    t_chunks = [n for n, o in chunks_of.items() if o == "t"]
    assert len(t_chunks) == 2
    for name in t_chunks:
        inst = trial.entry.instruction(name)
        assert dur[name] == pytest.approx(fc.ratio("t") * cm.compute_us(op_info(inst)))
    # the collective's chunks are not compute; slices / concatenations keep the cost model's
    added = {i.name for i in trial.entry.instructions if i.opcode in ("slice", "concatenate")}
    assert added and not added & set(dur)
    # split_copies="zero": XLA fuses them, they cost nothing
    zero = trial_durations(trial, fc, chunks_of, cm, "zero")
    assert all(zero[n] == 0.0 for n in added)
    assert all(n not in dur for n, o in chunks_of.items() if o == "ar")


def test_compile_for_target_hands_the_stock_module_to_the_passes_that_take_it(monkeypatch):
    """XLA's module of the stock step reaches the passes that declare ``inputs`` as data of
    the run, not inside the options; the memory budget, a setting, in DecomposeOptions; a
    two-argument pass still runs."""
    from concerto_jax import pipeline
    from concerto_jax.deviceless.planning import pass_inputs, rewriting_options

    inputs = pass_inputs("HloModule x")
    assert inputs == PassInputs(fused_reference="HloModule x")
    assert pass_inputs(None) is NO_INPUTS
    with_dec = concerto_jax.Options(passes=("decompose", "schedule"))
    assert rewriting_options(with_dec, ("decompose",), 1 << 30).decompose.memory_budget_bytes == 1 << 30
    assert rewriting_options(with_dec, ("fuse_collectives",), 1 << 30).decompose == with_dec.decompose
    seen = {}

    def with_inputs(module, options, inputs):
        seen["with"] = inputs
        return PassOutcome(changed=False)

    def without(module, options):  # the two-argument form still runs
        seen["without"] = options
        return PassOutcome(changed=False)

    monkeypatch.setitem(PASSES, "with_inputs", with_inputs)
    monkeypatch.setitem(PASSES, "without", without)
    opts = concerto_jax.Options(passes=("with_inputs", "without"), validate_with_xla=False)
    pipeline.run(pre_text(), opts, inputs)
    assert seen["with"] is inputs and seen["without"] is opts
    assert "fused_reference" not in {f.name for f in dataclasses.fields(DecomposeOptions)}


def test_retries_survive_a_json_round_trip_and_apply_to_the_pass_group():
    """What a pass offers a guard (``Retry``) travels in its record through JSON (the plan cache,
    another process) and applies to that pass's own options group."""
    import json

    from concerto_jax.report import PassRecord
    from hlo_passes.registry import Retry

    rotation = Retry("leave_one_out", "body.1", (("rotate_skip", ("body.1",)),))
    fallback = Retry("fallback", "split", (("split", False),))
    rec = PassRecord("decompose", True, 0.5, {"n": 2}, 1e-3, (rotation, fallback))
    assert PassRecord.from_dict(json.loads(json.dumps(dataclasses.asdict(rec)))) == rec
    opts = concerto_jax.Options(passes=("decompose", "schedule"))
    assert rotation.applied(opts, "decompose").decompose == dataclasses.replace(
        opts.decompose, rotate_skip=("body.1",))
    assert fallback.applied(opts, "decompose").decompose.split is False
    with pytest.raises(ValueError, match="Retry.kind"):
        Retry("sometimes", "x", ())
