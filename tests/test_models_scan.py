"""models/: scanned-layer and remat variants (nn.scan over stacked params, jax.checkpoint).

The scanned GPT is the same model as the unrolled one (same loss and update when fed the
unrolled params stacked along the layers axis); stacked params keep their logical axis
names behind a leading, unsharded "layers" axis; the per-device module after SPMD
partitioning carries the layers' collectives inside a while loop.
"""

from __future__ import annotations

import glob
import re
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import models
from models.layers import LAYERS_AXIS

FAST = {"xla_backend_optimization_level": 0}
SCAN_MODELS = ("gpt", "vit", "evoformer")
COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute)\(")


def _post_spmd(case: models.Case) -> str:
    with tempfile.TemporaryDirectory() as d:
        case.lower().compile(
            compiler_options={**FAST, "xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        )
        (path,) = sorted(glob.glob(f"{d}/*train_step*after_spmd-partitioning*.txt"))[-1:]
        return open(path).read()


def _computations(text: str) -> dict[str, str]:
    """Computation name -> its body text (one HLO module, naive split on blank lines)."""
    out = {}
    for chunk in text.split("\n\n"):
        m = re.search(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", chunk, re.M)
        if m:
            out[m.group(1)] = chunk
    return out


def test_variants_are_off_by_default_and_named():
    for name in SCAN_MODELS:
        cfg = models.MODELS[name].presets["tiny"]
        assert cfg.scan_layers is False and cfg.remat is False
    case = models.make_case("gpt", "tp", scan_layers=True, remat=True, materialize=False)
    assert case.name == "gpt/tp/tiny+scan+remat"
    assert case.config.scan_layers and case.config.remat
    assert "block_0" in models.make_case("gpt", "tp", materialize=False).abstract_state.params
    with pytest.raises(ValueError, match="no scan_layers variant"):
        models.make_case("wideresnet", "dp", scan_layers=True)


@pytest.mark.parametrize("layout", ["tp", "zero3", "dp_tp"])
def test_stacked_params_keep_logical_names_and_sharding(layout):
    unrolled = models.make_case("gpt", layout, materialize=False)
    scanned = models.make_case("gpt", layout, scan_layers=True, materialize=False)
    n = scanned.config.num_layers
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    flat_u = dict(
        (jax.tree_util.keystr(k), v)
        for k, v in jax.tree_util.tree_leaves_with_path(
            unrolled.train_step.logical_state.params["block_0"], is_leaf=is_p
        )
    )
    flat_s = dict(
        (jax.tree_util.keystr(k), v)
        for k, v in jax.tree_util.tree_leaves_with_path(
            scanned.train_step.logical_state.params["block"]["block"], is_leaf=is_p
        )
    )
    assert flat_u.keys() == flat_s.keys() and len(flat_u) >= 10
    for key, names in flat_s.items():
        assert tuple(names) == (LAYERS_AXIS, *flat_u[key]), key
    abs_u = unrolled.abstract_state.params["block_0"]
    abs_s = scanned.abstract_state.params["block"]["block"]
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(abs_s), jax.tree.leaves(abs_u), strict=True
    ):
        assert a.shape == (n, *b.shape), jax.tree_util.keystr(path)
        assert tuple(a.sharding.spec) == (None, *b.sharding.spec), jax.tree_util.keystr(path)
    sharded = [a for a in jax.tree.leaves(abs_s) if any(s for s in a.sharding.spec)]
    assert len(sharded) >= 4, f"{layout}: stacked params should stay sharded"


def _stack_unrolled(unrolled_params, num_layers):
    params = {k: v for k, v in unrolled_params.items() if not k.startswith("block_")}
    blocks = [unrolled_params[f"block_{i}"] for i in range(num_layers)]
    params["block"] = {"block": jax.tree.map(lambda *xs: np.stack(xs), *blocks)}
    return params


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_remat"])
def test_scanned_gpt_is_the_unrolled_model(remat):
    """Fed the unrolled params stacked, the scanned step gives the same loss and params."""
    unrolled = models.make_case("gpt", "tp")
    scanned = models.make_case("gpt", "tp", scan_layers=True, remat=remat)
    u_state = unrolled.init_state(0)
    host_params = jax.tree.map(np.asarray, u_state.params)
    s_state = scanned.init_state(0)  # fresh Adam state: zeros, same structure
    s_state = s_state.replace(params=_stack_unrolled(host_params, scanned.config.num_layers))
    s_state = jax.device_put(s_state, scanned.train_step.state_shardings)
    u_step = unrolled.step.lower(u_state, unrolled.batch).compile(compiler_options=FAST)
    s_step = scanned.step.lower(s_state, scanned.batch).compile(compiler_options=FAST)
    for _ in range(2):
        u_state, u_m = u_step(u_state, unrolled.batch)
        s_state, s_m = s_step(s_state, scanned.batch)
        np.testing.assert_allclose(float(s_m["loss"]), float(u_m["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(s_m["grad_norm"]), float(u_m["grad_norm"]), rtol=1e-4)
    want = _stack_unrolled(jax.tree.map(np.asarray, u_state.params), scanned.config.num_layers)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(s_state.params), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize(
    ("model", "layout", "kinds"),
    [("gpt", "tp", {"all-reduce"}), ("gpt", "zero3", {"all-gather", "all-reduce"})],
)
def test_collectives_live_in_the_loop_body(model, layout, kinds):
    case = models.make_case(model, layout, scan_layers=True, remat=True, materialize=False)
    text = _post_spmd(case)
    comps = _computations(text)
    whiles = re.findall(r"while\(.*?body=%?([\w.\-]+)", text)
    assert len(whiles) >= 2, "forward and backward layer loops expected"
    in_bodies = set()
    for body in whiles:
        in_bodies |= set(COLLECTIVE.findall(comps[body]))
    assert kinds <= in_bodies, f"collectives in loop bodies: {in_bodies}"
