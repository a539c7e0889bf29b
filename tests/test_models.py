"""models/: model x layout cases train (tiny), match one device, shard as promised.

The default run trains every layout GPT has, and ViT, Evoformer and WideResNet on the
layouts that differ most or only they have (SP and DP x TP; DAP, DP x DAP; DP x TP on
convolutions), 12 cases; every model x layout (22 cases) runs with ``CONCERTO_FULL_SWEEP=1``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import re
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hlo_passes
import models
from models.layers import count_params
from models.registry import MODELS
from tests._helpers import FULL_SWEEP

DEFAULT_CASES = [(m, lay) for m, lay in models.list_cases()
                 if m == "gpt" or (m, lay) in {("vit", "tp_sp"), ("vit", "dp_tp"), ("evoformer", "dap"),
                                               ("evoformer", "dp_dap"), ("wideresnet", "dp_tp"),
                                               ("moe", "ep")}]
CASES = models.list_cases() if FULL_SWEEP else DEFAULT_CASES
CASE_IDS = [f"{model}-{layout}" for model, layout in CASES]
STEPS = 3
# LLVM at -O0 roughly halves XLA:CPU compile time of these tiny steps; the HLO passes
# (SPMD partitioning included) are unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)
# XLA:CPU's SPMD partitioner writes a reduce-scatter as an all-reduce whose result is
# dynamic-sliced by partition id (no reduce-scatter instruction on CPU); count that as one.
REDUCE_SCATTER_PATTERN = re.compile(r"dynamic-slice\(%all-reduce[.\d]*,")

# Collective kinds each layout must produce in the per-device module after SPMD partitioning.
EXPECTED_COLLECTIVES = {
    "dp": {"all-reduce"},
    "shard_map_dp": {"all-reduce"},
    "tp": {"all-reduce"},
    "tp_sp": {"all-gather", "reduce-scatter"},
    "dp_tp": {"all-reduce"},
    "zero2": {"reduce-scatter", "all-gather"},
    "zero3": {"reduce-scatter", "all-gather"},
    "dap": {"all-to-all", "all-gather"},
    "dp_dap": {"all-to-all", "all-gather", "all-reduce"},
    "ep": {"all-to-all", "all-reduce"},  # tokens to their experts and back; replicated params' grads
}


@dataclasses.dataclass(frozen=True)
class Run:
    """What STEPS train steps of one case produced."""

    case: models.Case
    losses: list[float]
    grad_norms: list[float]
    state: models.TrainState
    hlo: str  # per-device module after spmd-partitioning


def _collective_kinds(hlo: str) -> set[str]:
    kinds = set(COLLECTIVE.findall(hlo))
    if REDUCE_SCATTER_PATTERN.search(hlo):
        kinds.add("reduce-scatter")
    return kinds


def _train(case: models.Case, dump: bool) -> Run:
    state, batch = case.init_state(0), case.make_batch(0)
    hlo = ""
    if dump:
        with tempfile.TemporaryDirectory() as d:
            compiled = case.step.lower(state, batch).compile(
                compiler_options={
                    **FAST_COMPILE,
                    "xla_dump_to": d,
                    "xla_dump_hlo_pass_re": "spmd-partitioning",
                }
            )
            files = sorted(glob.glob(f"{d}/*train_step*after_spmd-partitioning*.txt"))
            assert files, "no post-SPMD dump written"
            hlo = open(files[-1]).read()
    else:
        compiled = case.step.lower(state, batch).compile(compiler_options=FAST_COMPILE)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return Run(case=case, losses=losses, grad_norms=grad_norms, state=state, hlo=hlo)


@functools.cache
def _run(model: str, layout: str) -> Run:
    return _train(models.make_case(model, layout, materialize=False), dump=True)


@functools.cache
def _reference(model: str) -> Run:
    """The same steps on a single device (DP layout on a 1-device mesh)."""
    return _train(models.make_case(model, "dp", mesh_shape=(1,), materialize=False), dump=False)


@pytest.mark.parametrize(("model", "layout"), CASES, ids=CASE_IDS)
def test_train_steps_match_single_device(model, layout):
    run, ref = _run(model, layout), _reference(model)
    assert all(np.isfinite(run.losses)), run.losses
    assert run.losses[-1] < run.losses[0], f"loss did not decrease: {run.losses}"
    np.testing.assert_allclose(run.losses, ref.losses, rtol=2e-5, atol=2e-5)
    # Adam is invariant to the gradient's scale: the reduced gradient norm catches a
    # missing or doubled mean over the data axis.
    np.testing.assert_allclose(run.grad_norms, ref.grad_norms, rtol=1e-4)
    assert int(run.state.step) == STEPS
    got = jax.tree_util.tree_leaves_with_path(run.state.params)
    want = jax.tree_util.tree_leaves(ref.state.params)
    init = jax.tree_util.tree_leaves(run.case.init_state(0).params)
    assert len(got) == len(want) == len(init)
    for (path, a), b, p0 in zip(got, want, init, strict=True):
        # Adam normalises each element, so a near-zero gradient with a different
        # rounding can move one element by up to ~lr; compare per tensor, relative
        # to how far the reference moved.
        a, b, p0 = np.asarray(a), np.asarray(b), np.asarray(p0)
        moved = np.linalg.norm(b - p0)
        assert moved > 0, f"{jax.tree_util.keystr(path)} did not change"
        assert np.linalg.norm(a - b) <= 1e-2 * moved, (
            f"{jax.tree_util.keystr(path)}: |a-b|={np.linalg.norm(a - b):.3g}, reference moved {moved:.3g}"
        )


@pytest.mark.parametrize(("model", "layout"), CASES, ids=CASE_IDS)
def test_post_spmd_collectives(model, layout):
    kinds = _collective_kinds(_run(model, layout).hlo)
    missing = EXPECTED_COLLECTIVES[layout] - kinds
    assert not missing, f"{model}/{layout}: expected {EXPECTED_COLLECTIVES[layout]}, found {kinds}"


@pytest.mark.parametrize(("model", "layout"), CASES, ids=CASE_IDS)
def test_post_spmd_module_round_trips(model, layout):
    """Our parse -> print of every case's post-SPMD module is the same module to XLA.

    (XLA's canonical text of our print equals XLA's canonical text of the dump; the
    module is the one ``concerto_jax.capture`` reads, dumped by the same recipe.)
    """
    captured = _run(model, layout).hlo
    printed = hlo_passes.module_to_text(hlo_passes.parse_module(captured))
    assert hlo_passes.xla_canonical(printed) == hlo_passes.xla_canonical(captured)


def _mesh_axes(spec: P) -> set[str]:
    axes = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update((entry,) if isinstance(entry, str) else entry)
    return axes


def _param_specs(run: Run) -> list[tuple[str, tuple[str | None, ...], int, set[str], set[str]]]:
    """(path, logical axes, rank, mesh axes of the param, mesh axes of its Adam mu)."""
    case = run.case
    logical = jax.tree_util.tree_leaves(
        case.train_step.logical_state.params, is_leaf=lambda x: isinstance(x, P)
    )
    params = jax.tree_util.tree_leaves_with_path(run.state.params)
    mu = jax.tree_util.tree_leaves(run.state.opt_state[0].mu)
    rows = []
    for (path, p), names, m in zip(params, logical, mu, strict=True):
        rows.append(
            (
                jax.tree_util.keystr(path),
                tuple(names),
                p.ndim,
                _mesh_axes(p.sharding.spec),
                _mesh_axes(m.sharding.spec),
            )
        )
    return rows


@pytest.mark.parametrize(("model", "layout"), CASES, ids=CASE_IDS)
def test_shardings_match_layout(model, layout):
    """The state that comes out of the step is sharded the way the layout promises."""
    run = _run(model, layout)
    rows = _param_specs(run)
    tp_names = {"heads", "mlp", "vocab", "conv_out"}
    n_sharded = 0
    for path, names, ndim, p_axes, mu_axes in rows:
        if layout in ("dp", "shard_map_dp", "dap", "dp_dap"):
            assert not p_axes and not mu_axes, (
                f"{path}: replicated expected, got {p_axes}/{mu_axes}"
            )
        elif layout in ("tp", "tp_sp", "dp_tp"):
            assert "data" not in p_axes, path
            if tp_names & set(names) and ndim >= 2:
                assert p_axes == {"model"}, (
                    f"{path} {names}: expected sharded over model, got {p_axes}"
                )
                n_sharded += 1
        elif layout == "zero2":
            assert not p_axes, f"{path}: ZeRO-2 keeps params replicated, got {p_axes}"
            if ndim >= 2:
                assert mu_axes == {"data"}, f"{path}: optimizer state should be sharded over data"
                n_sharded += 1
        elif layout == "zero3":
            if ndim >= 2:
                assert p_axes == {"data"} and mu_axes == {"data"}, (
                    f"{path}: expected sharded over data"
                )
                n_sharded += 1
        elif layout == "ep":
            if "exp" in names:
                assert p_axes == {"expert"} and mu_axes == {"expert"}, (
                    f"{path} {names}: expected sharded over expert, got {p_axes}/{mu_axes}"
                )
                n_sharded += 1
            else:
                assert not p_axes, f"{path}: replicated expected under ep, got {p_axes}"
        else:
            raise AssertionError(f"no sharding check for layout {layout}")
    if layout not in ("dp", "shard_map_dp", "dap", "dp_dap"):
        assert n_sharded >= 4, f"only {n_sharded} params sharded under {layout}"
    if layout in ("dap", "dp_dap"):
        batch = run.case.train_step.batch_shardings
        assert "dap" in _mesh_axes(batch["msa"].spec)


def test_zero2_gradients_sharded():
    case = models.make_case("gpt", "zero2", materialize=False)
    grad_axes = [
        _mesh_axes(s.spec) for s in jax.tree_util.tree_leaves(case.train_step.grad_shardings)
    ]
    param_axes = [
        _mesh_axes(s.spec)
        for s in jax.tree_util.tree_leaves(case.train_step.state_shardings.params)
    ]
    assert sum(a == {"data"} for a in grad_axes) >= len(grad_axes) // 2
    assert not any(param_axes)


def _evoformer_count(cfg) -> int:
    """Evoformer params are linear in the block count: count 1 and 2 blocks, extrapolate."""

    def count(n):
        spec = MODELS["evoformer"]
        module = spec.build(dataclasses.replace(cfg, num_blocks=n, batch_size=1))
        inputs = jax.ShapeDtypeStruct((1, 8, 16), np.int32)
        return count_params(jax.eval_shape(module.init, jax.random.key(0), inputs)["params"])

    one, two = count(1), count(2)
    return one + (cfg.num_blocks - 1) * (two - one)


@pytest.mark.parametrize(
    ("model", "preset"),
    [(m, p) for m, s in MODELS.items() for p in s.stated_params],
    ids=lambda x: str(x),
)
def test_preset_param_counts(model, preset):
    spec = MODELS[model]
    cfg = spec.presets[preset]
    if model == "evoformer":
        n = _evoformer_count(cfg)
    else:
        module = spec.build(cfg)
        inputs = {k: v for k, v in spec.batch_shapes(cfg).items() if not k.startswith("target")}
        n = count_params(jax.eval_shape(module.init, jax.random.key(0), **inputs)["params"])
    stated = spec.stated_params[preset]
    assert abs(n / stated - 1) < 0.10, f"{preset}: {n / 1e9:.3f}B params, stated {stated / 1e9}B"


def test_gpt_0_9b_tp8_lowers_without_allocating():
    before = sum(x.nbytes for x in jax.live_arrays())
    case = models.make_case("gpt", "tp", "gpt_0_9b", mesh_shape=(8,))
    assert case.state is None and case.batch is None
    lowered = case.lower()
    after = sum(x.nbytes for x in jax.live_arrays())
    assert after - before < 1 << 20, f"lowering allocated {(after - before) / 2**20:.1f} MiB"
    n = count_params(case.abstract_state.params)
    assert 0.9e9 < n < 1.0e9
    qkv = case.abstract_state.params["block_0"]["attn"]["query"]["kernel"]
    assert qkv.shape == (2048, 16, 128) and qkv.sharding.spec == P(None, "model", None)
    text = lowered.as_text()
    assert "sharding" in text and "jit_train_step" in text


def test_list_cases_covers_required_pairs():
    cases = set(models.list_cases())
    for model in MODELS:
        assert {(model, "dp"), (model, "zero2"), (model, "zero3")} <= cases
    assert {("gpt", "tp"), ("gpt", "tp_sp"), ("gpt", "dp_tp"), ("gpt", "shard_map_dp")} <= cases
    assert {("vit", "tp"), ("vit", "dp_tp"), ("evoformer", "dap"), ("wideresnet", "dp_tp")} <= cases


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown model"):
        models.make_case("bert", "dp")
    with pytest.raises(ValueError, match="unknown layout"):
        models.make_case("gpt", "pp")
    with pytest.raises(ValueError, match="does not support layout"):
        models.make_case("wideresnet", "dap")
    with pytest.raises(ValueError, match="unknown config"):
        models.make_case("gpt", "dp", "gpt_1t")
    with pytest.raises(ValueError, match="mesh axes"):
        models.make_case("gpt", "dp_tp", mesh=models.make_mesh("dp"))
    with pytest.raises(ValueError, match="one size per axis"):
        models.make_mesh("dp_tp", (8,))


def test_example_batches_are_deterministic():
    for model, spec in MODELS.items():
        cfg = spec.presets["tiny"]
        a, b, c = spec.example_batch(cfg, 0), spec.example_batch(cfg, 0), spec.example_batch(cfg, 1)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{model}:{k}")
        assert any(not np.array_equal(a[k], c[k]) for k in a), model
        shapes = spec.batch_shapes(cfg)
        assert {k: (v.shape, v.dtype) for k, v in a.items()} == {
            k: (v.shape, v.dtype) for k, v in shapes.items()
        }


def test_collective_counter_sees_reduce_scatter_pattern():
    hlo = "%dynamic-slice.9 = f32[8]{0} dynamic-slice(%all-reduce.3, %reshape.1), dynamic_slice_sizes={8}"
    assert _collective_kinds(hlo) == {"reduce-scatter"}
    assert collections.Counter(COLLECTIVE.findall("%x = f32[4] all-gather(%y)")) == {
        "all-gather": 1
    }
