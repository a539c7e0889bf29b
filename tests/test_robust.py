"""Decisions judged over the plausible cost models (``costmodel.envelope``): the set itself, the
judge under each model on a real XLA final module, and compile_for_target's guards deciding by
the worst case (real XLA compiles of a tensor-parallel MLP for 8 H100s, needs the CUDA plugin)."""

import dataclasses
import math
import os

import pytest

import concerto_jax
from concerto_jax.costmodel import CostOptions, get_cluster
from concerto_jax.costmodel.envelope import (
    ADVERSE,
    ENVELOPE,
    NOMINAL,
    GemmByShape,
    RobustVerdict,
    Variant,
)
from concerto_jax.deviceless import gpu_plugin_available
from concerto_jax.judge import Envelope

needs_plugin = pytest.mark.skipif(not gpu_plugin_available(), reason="CUDA PJRT plugin missing: pip install -e .[gpu]")

_FINAL = os.path.join(os.path.dirname(__file__), "data", "hlo", "gpu_transformer_block.final.hlo")

# variant -> (figure, value); the figure is a path into CostOptions
_STATED = {
    "launch_4us": ("compute.launch_overhead_us", 4.0),
    "command_buffer": ("compute.launch_overhead_us", 1.5),
    "gemm_0.6": ("compute.matmul_efficiency", 0.6),
    "gemm_0.9": ("compute.matmul_efficiency", 0.9),
    "hbm_0.7": ("compute.memory_efficiency", 0.7),
    "hbm_0.9": ("compute.memory_efficiency", 0.9),
    "slowdown_1.0": ("overlap_slowdown", 1.0),
    "slowdown_1.3": ("overlap_slowdown", 1.3),
    "link_0.6": ("collectives.link_efficiency", 0.6),
    "link_1.0": ("collectives.link_efficiency", 1.0),
    "nvls_off": ("collectives.nvls", False),
}


def _flat(options: CostOptions) -> dict:
    out = {}
    for part in ("compute", "collectives"):
        for k, v in dataclasses.asdict(getattr(options, part)).items():
            out[f"{part}.{k}"] = v
    out["overlap_slowdown"] = options.overlap_slowdown
    return out


def test_envelope_is_the_nominal_model_and_one_figure_at_a_time():
    names = [v.name for v in ENVELOPE]
    assert names[0] == NOMINAL and len(set(names)) == len(names) == 13
    assert set(names) == {NOMINAL, "gemm_by_shape", *_STATED}
    assert ENVELOPE[0].options == CostOptions() and ENVELOPE[0].gemm_by_shape is None
    nominal = _flat(CostOptions())
    for v in ENVELOPE[1:]:
        moved = {k: x for k, x in _flat(v.options).items() if x != nominal[k]}
        if v.name == "gemm_by_shape":  # only the GEMM efficiency, by size
            assert moved == {} and v.gemm_by_shape == GemmByShape()
            continue
        figure, value = _STATED[v.name]
        assert moved == {figure: value}, (v.name, moved)
        assert v.gemm_by_shape is None
    # both ends of each range, on either side of the nominal figure
    for lo, hi in (("command_buffer", "launch_4us"), ("gemm_0.6", "gemm_0.9"), ("hbm_0.7", "hbm_0.9"),
                   ("slowdown_1.0", "slowdown_1.3"), ("link_0.6", "link_1.0")):
        figure = _STATED[lo][0]
        assert _STATED[lo][1] < nominal[figure] < _STATED[hi][1]
    # the stress corner is not a member; each of its figures at the end hostile to added kernels
    assert ADVERSE.name not in names
    adverse = _flat(ADVERSE.options)
    assert adverse["compute.launch_overhead_us"] == 4.0 and adverse["compute.memory_efficiency"] == 0.7
    assert adverse["overlap_slowdown"] == 1.3 and adverse["collectives.link_efficiency"] == 1.0
    assert ADVERSE.gemm_by_shape == GemmByShape()


def test_gemm_efficiency_by_shape_rises_with_size_within_the_range():
    curve = GemmByShape()
    sizes = [2.0 ** k for k in range(20, 46)]
    effs = [curve.efficiency(f) for f in sizes]
    assert effs == sorted(effs) and effs[0] == 0.2 and effs[-1] == 0.83
    assert curve.efficiency(2.0 ** 29) == 0.2 and curve.efficiency(2.0 ** 34) == 0.83
    # halving a mid-size GEMM costs it the same efficiency wherever it is on the ramp
    assert curve.efficiency(2.0 ** 32) - curve.efficiency(2.0 ** 31) == pytest.approx(0.63 / 5)


def test_each_variant_moves_a_real_final_module_the_stated_way():
    from concerto_jax.judge import judge_module, judge_parsed
    from hlo_passes.ir.parser import parse_module

    text = open(_FINAL).read()
    cluster = get_cluster("h100_sxm_8")
    judged = {v.name: judge_module(text, v.cost_model(cluster)) for v in ENVELOPE}
    nom = judged[NOMINAL]
    assert nom.compute_us > 0 and nom.comm_us > 0
    assert judged["launch_4us"].compute_us > nom.compute_us > judged["command_buffer"].compute_us
    assert judged["gemm_0.6"].compute_us >= nom.compute_us >= judged["gemm_0.9"].compute_us
    assert judged["hbm_0.7"].compute_us > nom.compute_us > judged["hbm_0.9"].compute_us
    assert judged["link_0.6"].comm_us > nom.comm_us > judged["link_1.0"].comm_us
    assert judged["slowdown_1.0"].us <= nom.us <= judged["slowdown_1.3"].us
    for name in ("launch_4us", "command_buffer", "gemm_0.6", "gemm_0.9", "hbm_0.7", "hbm_0.9", "gemm_by_shape"):
        assert judged[name].comm_us == nom.comm_us, name  # compute figures leave collectives alone
    for name in ("link_0.6", "link_1.0", "slowdown_1.0", "slowdown_1.3"):
        assert judged[name].compute_us == nom.compute_us, name
    # this block's GEMMs are tiny (at most 2 MFLOP): memory-bound at the curve's low end (0.2) as
    # at 0.6, the same time as under gemm_0.6
    assert judged["gemm_by_shape"].compute_us == pytest.approx(judged["gemm_0.6"].compute_us)
    # one parse serves every model: judging a parsed module leaves it as it was
    module = parse_module(text)
    for v in ENVELOPE[:3]:
        assert judge_parsed(module, v.cost_model(cluster)).us == judged[v.name].us


def _scanned_module_text() -> str:
    """XLA:CPU's final module of a 3-layer scan with an all-reduce in its body (8 devices)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices()[:8], ("x",))

    def body(h, w):
        return jax.lax.psum(jnp.tanh(h @ w), "x"), None

    @jax.jit
    def step(h, ws):
        f = jax.shard_map(lambda h, ws: jax.lax.scan(body, h, ws)[0], mesh=mesh,
                          in_specs=(P(), P()), out_specs=P(), check_vma=False)
        return f(h, ws)

    return step.lower(jnp.ones((64, 128)), jnp.ones((3, 128, 128))).compile().as_text()


def test_step_us_parsed_is_judge_parsed_us_under_every_model_loops_included():
    """The envelope's lean path (one OpInfo per instruction for all models, no bounds, graphs
    checked once) gives exactly ``judge_parsed(...).us``: on a final module and a scanned one."""
    from concerto_jax.costmodel.hlo_ops import OpInfoCache
    from concerto_jax.judge import judge_parsed
    from concerto_jax.judge.module import step_us_parsed
    from hlo_passes.ir.parser import parse_module

    cluster = get_cluster("h100_sxm_8")
    scanned = _scanned_module_text()
    for text in (open(_FINAL).read(), scanned):
        module, infos = parse_module(text), OpInfoCache()
        for i, v in enumerate(ENVELOPE):
            model = v.cost_model(cluster)
            assert step_us_parsed(module, model, infos, check=i == 0) == judge_parsed(parse_module(text), model).us, v.name
    assert "while(" in scanned


def test_compare_decides_by_the_worst_case_and_reports_every_model():
    text = open(_FINAL).read()
    env = Envelope(get_cluster("h100_sxm_8"))
    same = env.compare("self", text, text, ties_keep=True)
    assert [f.variant for f in same.figures] == [v.name for v in ENVELOPE]
    assert {f.gain for f in same.figures} == {1.0} and same.keep and same.nominal_keep
    sims = env.simulations
    assert sims == len(ENVELOPE)  # one text: judged once per model
    strict = env.compare("self", text, text)  # a tie does not keep a candidate that must win
    assert not strict.keep and env.simulations == sims  # cached
    # The caller's nominal figures: a nominal win that every other model sees as a tie
    verdict = env.compare("win", text, text, nominal_us=(90.0, 100.0))
    assert verdict.nominal_keep and not verdict.keep and verdict.changed_decision
    assert verdict.nominal_gain == pytest.approx(100 / 90, abs=1e-4) and verdict.worst_gain == 1.0
    assert verdict.worst_variant != NOMINAL
    reported = env.compare("win", text, text, nominal_us=(90.0, 100.0), robust=False)
    assert reported.keep and reported.rule == "nominal"
    assert RobustVerdict.from_dict(verdict.as_dict()) == verdict
    assert env.verdicts[-2:] == [verdict, reported]


def test_options_robust_is_validated():
    assert concerto_jax.Options().deviceless.robust == ENVELOPE
    assert concerto_jax.Options(deviceless=concerto_jax.DevicelessOptions(robust=())).deviceless.robust == ()
    with pytest.raises(TypeError, match="robust"):
        concerto_jax.Options(deviceless=concerto_jax.DevicelessOptions(robust=[ENVELOPE[0]]))
    with pytest.raises(ValueError, match="unique"):
        concerto_jax.Options(deviceless=concerto_jax.DevicelessOptions(robust=(ENVELOPE[0], ENVELOPE[0])))


def _tp_mlp(tokens=8192, d=2048, f=8192, layers=2):
    """Megatron MLP blocks (column- then row-parallel GEMM, all-reduce of the activations) over 8
    target devices: the gradient step. Splitting the row-parallel GEMMs around their all-reduces
    is worth about 1.26x to our nominal model."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("tp",))

    def loss(ws, x):
        for w1, w2 in ws:
            x = x + jnp.tanh(x @ w1) @ w2
        return jnp.mean(x.astype(jnp.float32) ** 2)

    ws = [(jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp"))),
           jax.ShapeDtypeStruct((f, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", None))))
          for _ in range(layers)]
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return jax.jit(jax.grad(loss)), (ws, x)


LAUNCH_50US = Variant("launch_50us", CostOptions(compute=dataclasses.replace(
    CostOptions().compute, launch_overhead_us=50.0)))
"""Far outside the plausible range: a model under which the split's extra kernels cost more than
the communication it hides."""


def _opts(**deviceless):
    return concerto_jax.Options(passes=("decompose", "schedule"), fallback=False, cache_dir=None,
                                deviceless=concerto_jax.DevicelessOptions(combine_thresholds=(), **deviceless))


def _guard(res):
    dec = next(p for p in res.passes if p.name == "decompose")
    return dec, dec.stats["final_module_guard"]


@needs_plugin
def test_rewrite_guard_keeps_a_rewrite_only_where_every_model_agrees():
    step, args = _tp_mlp()
    # robust judgement off: today's rule (the nominal model alone) keeps the split
    off = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=_opts(robust=()))
    dec, guard = _guard(off)
    assert guard["kept"] and dec.changed and "robust" not in guard and off.robust == ()
    assert guard["rewritten_planned_us"] < guard["without_rewrite_planned_us"]
    assert "replica_count=8" in off.emitted_text.split("\n", 1)[0]  # the split program
    assert "robust" not in off.seconds

    # the plausible set (default): the split wins under every model, kept with the same plan
    on = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=_opts())
    dec, guard = _guard(on)
    verdict = RobustVerdict.from_dict(guard["robust"])
    assert guard["kept"] and dec.changed and verdict.keep and verdict.nominal_keep
    assert verdict.rule == "maximin" and verdict.reference == "stock"
    assert verdict.candidate_worst > verdict.baseline_worst
    for worst, us in ((verdict.candidate_worst, "candidate_us"), (verdict.baseline_worst, "baseline_us")):
        assert worst == pytest.approx(min(f.reference_us / getattr(f, us) for f in verdict.figures), abs=2e-3)
    assert [f.variant for f in verdict.figures] == [v.name for v in ENVELOPE]
    assert all(f.gain > 1.0 for f in verdict.figures), verdict
    assert verdict.worst_gain == min(f.gain for f in verdict.figures) < verdict.nominal_gain
    nominal = verdict.figures[0]
    assert (nominal.candidate_us, nominal.baseline_us) == (guard["rewritten_planned_us"],
                                                           guard["without_rewrite_planned_us"])
    for f in verdict.figures:
        assert f.gain == pytest.approx(f.baseline_us / f.candidate_us, abs=2e-4)
    assert on.planned_step_us == off.planned_step_us and on.final_step_us == off.final_step_us
    assert [v.decision for v in on.robust] == ["rewrite_guard", "final_module_guard"]
    final = on.robust[-1]
    assert (final.candidate, final.baseline) == ("ours", "stock") and final.keep
    assert final.figures[0].candidate_us == on.final_step_us and final.figures[0].baseline_us == on.stock_step_us
    assert 0 < on.seconds["robust"] < sum(v for k, v in on.seconds.items() if k != "robust")

    # a model under which the split loses: the nominal model keeps it, the worst case drops it
    extreme = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8",
                                              options=_opts(robust=(*ENVELOPE, LAUNCH_50US)))
    dec, guard = _guard(extreme)
    verdict = RobustVerdict.from_dict(guard["robust"])
    assert verdict.nominal_keep and not verdict.keep and not guard["kept"] and not dec.changed
    assert verdict.worst_variant == "launch_50us" and verdict.worst_gain < 1.0
    assert verdict.candidate_worst < verdict.baseline_worst
    assert verdict.gain(NOMINAL) == pytest.approx(guard["without_rewrite_planned_us"]
                                                  / guard["rewritten_planned_us"], abs=2e-4)
    # same nominal figures as without the extreme model; the original's plan is handed
    assert guard["rewritten_planned_us"] == _guard(on)[1]["rewritten_planned_us"]
    assert "replica_count=8" not in extreme.emitted_text.split("\n", 1)[0]
    assert extreme.planned_step_us == pytest.approx(guard["without_rewrite_planned_us"], abs=0.11)
    assert extreme.planned_step_us > on.planned_step_us
    assert extreme.robust[0] == verdict


@needs_plugin
def test_a_rewrite_the_worst_case_drops_gets_no_threshold_search_of_its_own():
    """D49: the nominal model keeps the split by more than the retune margin, a model of the set
    drops it: the original's threshold search runs, the rewrite's does not, and the rewrite stays
    dropped."""
    from concerto_jax.deviceless.rewrite_guard import GUARD_RETUNE_MARGIN

    step, args = _tp_mlp()
    res = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=concerto_jax.Options(
        passes=("decompose", "schedule"), fallback=False, cache_dir=None,
        deviceless=concerto_jax.DevicelessOptions(robust=(*ENVELOPE, LAUNCH_50US),
                                                  combine_thresholds=(1 << 20,), time_budget_s=None)))
    dec, guard = _guard(res)
    assert guard["rewritten_planned_us"] < guard["without_rewrite_planned_us"] * (1 - GUARD_RETUNE_MARGIN)
    assert not guard["kept"] and not dec.changed and guard["rewrite_search"].startswith("not run")
    assert "after_combine_thresholds" not in guard and "robust_after_combine_thresholds" not in guard
    search = next(p for p in res.passes if p.name == "combine_thresholds")  # the original's
    assert search.stats["candidates"] and search.stats["current_planned_us"] == pytest.approx(
        guard["without_rewrite_planned_us"], abs=0.11)
    assert "rewrite_guard_after_combine_thresholds" not in [v.decision for v in res.robust]
    assert "replica_count=8" not in res.emitted_text.split("\n", 1)[0]


@needs_plugin
def test_final_module_guard_reports_stock_where_a_model_makes_ours_slower():
    """The pin path has no rewrite guard: the final-module guard alone judges XLA's final module
    of our split program against stock's. Under the extreme model it loses and the stock
    program is reported, with the model named."""
    step, args = _tp_mlp()
    res = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", via="pin",
                                          options=_opts(robust=(*ENVELOPE, LAUNCH_50US)))
    (verdict,) = res.robust
    assert verdict.decision == "final_module_guard" and verdict.ties_keep
    assert verdict.nominal_keep and verdict.nominal_gain > 1.0, verdict
    assert not verdict.keep and verdict.worst_variant == "launch_50us"
    assert res.via == "stock" and res.final_text == res.stock_final_text
    assert "under the launch_50us cost model" in res.fallback_reason
    off = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", via="pin",
                                          options=_opts(robust=()))
    assert off.via == "pin" and off.robust == () and off.fallback_reason is None
    assert math.isclose(off.stock_step_us / off.final_step_us, verdict.nominal_gain, abs_tol=2e-4)
    # the benches' "decisions" column: every judged decision with its worst case and the model
    from bench.robust_columns import decisions
    assert decisions(res) == (f"final_module_guard: dropped (nominal {verdict.nominal_gain}, "
                              f"worst {verdict.worst_gain} at launch_50us)")
    assert decisions(off) == "off"


def test_bench_columns_count_kernels_and_bytes_per_step_by_trips():
    from bench.robust_columns import columns, kernels_and_bytes
    from tests.test_bench_scanned import _TEXT

    # the loop body launches 2 kernels (the counter's add, the multiply; the all-reduce is a
    # collective) 5 times, the condition its compare 6 times; the entry launches none
    kernels, nbytes = kernels_and_bytes(_TEXT)
    assert kernels == 5 * 2 + 6 * 1
    assert nbytes == 5 * (3 * 4 + 3 * 32) + 6 * (4 + 4 + 1)
    # a module against itself: every model's gain is 1, nothing added
    text = open(_FINAL).read()
    row = columns(text, text, "h100_sxm_8")
    assert row["nominal_gain"] == row["worst_gain"] == row["adverse_gain"] == row["calibrated_gain"] == 1.0
    assert row["added_kernels"] == 0 and row["added_mb"] == 0.0
    assert row["stock_kernels"] == row["ours_kernels"] == kernels_and_bytes(text)[0] > 0


def test_rejudge_judges_saved_pairs_under_every_model(tmp_path):
    """``python -m bench.rejudge``: a saved pair (stock, ours) judged again, the columns of the
    compile_for_target benches; the calibrated one is the H200 rates' judge of the two programs."""
    import csv
    import gzip
    import json

    from bench import rejudge
    from concerto_jax.costmodel.envelope import CALIBRATED_H200
    from concerto_jax.judge import judge_module

    text = open(_FINAL).read()
    other = open(_FINAL.replace(".final.hlo", ".after_lhs.hlo")).read()  # another program of the step
    for name, (stock, ours) in {"same": (text, text), "other": (text, other)}.items():
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump({"cluster": "h100_sxm_8", "jax": "test"}, f)
        for program, t in (("stock", stock), ("ours", ours)):
            with gzip.open(tmp_path / f"{name}.{program}.hlo.gz", "wt") as f:
                f.write(t)
    out = tmp_path / "out"
    assert rejudge.main([str(tmp_path), "--out", str(out)]) == 0
    with open(out / "rejudge.csv") as f:
        rows = {r["case"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"same", "other"}
    assert float(rows["same"]["calibrated_gain"]) == float(rows["same"]["nominal_gain"]) == 1.0
    other_row = rows["other"]
    assert float(other_row["worst_gain"]) <= float(other_row["nominal_gain"])
    h200 = CALIBRATED_H200.cost_model(get_cluster("h100_sxm_8"))
    want = judge_module(text, h200).us / judge_module(other, h200).us
    assert float(other_row["calibrated_gain"]) == pytest.approx(want, abs=1e-4)
    assert "calibrated_gain" in (out / "rejudge.md").read_text()
    assert rejudge.main([str(tmp_path / "out"), "--out", str(tmp_path / "none")]) == 1  # no pair there


@needs_plugin
def test_bench_rewrite_column_is_decompose_alone_through_xla_scheduler():
    """``bench.rewrite_column``: the split program through XLA's own pipeline (no pin, no order of
    ours), reported as XLA made it; its gain is against the stock figure the row gives."""
    from bench.rewrite_column import COLUMNS, columns

    step, args = _tp_mlp(layers=1)
    row = columns(step, args, "h100_sxm_8", 1000.0,
                  concerto_jax.Options(fallback=False, cache_dir=None,
                                       deviceless=concerto_jax.DevicelessOptions(combine_thresholds=())))
    assert set(row) == set(COLUMNS)
    assert row["rewrite_xla_split"].startswith("main") and "N=" in row["rewrite_xla_split"], row
    assert row["rewrite_xla_us"] > 0
    assert row["rewrite_xla_gain"] == pytest.approx(1000.0 / row["rewrite_xla_us"], abs=2e-4)
