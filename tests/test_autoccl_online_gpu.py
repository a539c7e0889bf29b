"""GPU online loop without a GPU: convergence on the NCCL cost model, keys from HLO, command buffers."""

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from concerto_jax import autoccl
from concerto_jax.autoccl import plugin
from concerto_jax.autoccl.nccl_online import XLA_DEFAULT_COMBINE_THRESHOLD

MODEL_CASES = autoccl.step_model.MODEL_STEPS
MAX_STEPS = 250  # stated convergence budget (steps, warm-up and confirmation included)


def _run_loop(case, noise=0.03, seed=1):
    loop = autoccl.NcclTuningLoop(
        case.keys_for,
        autoccl.NcclLoopOptions(
            tuner=autoccl.TunerOptions(warmup_steps=1, repeats=2, coordinate=False)
        ),
    )
    rng = np.random.default_rng(seed)
    while True:
        cand = loop.next_candidate()
        if loop.frozen:
            return loop, cand
        assert cand.tuning and loop.steps < 2000
        loop.report(
            case.step_time(cand.thresholds, cand.rows) * (1 + noise * rng.standard_normal())
        )


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_online_loop_converges_within_5pct_of_exhaustive(case):
    loop, final = _run_loop(case)
    tuned = case.step_time(final.thresholds, final.rows)
    default = case.step_time({"all-reduce": XLA_DEFAULT_COMBINE_THRESHOLD})
    opt, best_th = case.exhaustive_optimum(loop.options.thresholds)
    print(
        f"{case.name}: {loop.steps} steps, default {default * 1e3:.2f} ms, tuned {tuned * 1e3:.2f} ms, "
        f"exhaustive lower bound {opt * 1e3:.2f} ms (threshold {best_th}), tuned/opt {tuned / opt:.3f}"
    )
    assert not final.tuning and loop.frozen
    assert loop.steps <= MAX_STEPS
    assert tuned <= 1.05 * opt
    assert tuned <= default * 1.005  # never ends worse than what the user had (confirmation)


def test_bucket_threshold_trades_launches_against_overlap():
    """Item 7: on the model, tiny and huge combine thresholds both lose to a middle one."""
    case = MODEL_CASES[1]
    t = {th: case.step_time({"all-reduce": th}) for th in (1 << 16, 8 << 20, 1 << 30)}
    assert t[8 << 20] < t[1 << 16] and t[8 << 20] < t[1 << 30]


def test_tuned_rows_reach_the_plugin(tmp_path):
    """The loop's final rules, written to the live table, are what the C plugin answers."""
    case = MODEL_CASES[3]
    loop, final = _run_loop(case)
    assert final.rows
    d = tmp_path / "b"
    lib, harness = plugin.build(d), plugin.build_harness(d)
    table = plugin.write_table(final.rows, tmp_path / "t.txt")
    sizes = [nb for nb, _ in case.collectives(final.thresholds["all-reduce"])]
    env = {**os.environ, plugin.TABLE_ENV: table}
    q = [a for nb in sizes for a in ("allreduce", str(nb))]
    out = subprocess.run(
        [harness, lib, "v4", str(case.cluster.n_ranks), *q],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    seen = {}
    for nb, line in zip(sizes, out.stdout.splitlines()[1:], strict=True):
        cls = plugin.size_class(nb)
        row = autoccl.step_model.match_row(
            final.rows, "all-reduce", nb, case.cluster.n_ranks, seen.get(cls, 0)
        )
        seen[cls] = seen.get(cls, 0) + 1
        algo = "default" if row is None or row.algorithm is None else row.algorithm.lower()
        ch = -1 if row is None or row.channels == 0 else row.channels
        assert line.endswith(
            f"algo={algo} proto={'default' if algo == 'default' else row.protocol.lower()} channels={ch}"
        )


def test_keys_from_compiled_hlo_with_repeated_sizes():
    """Per-collective keys: buckets of 4040, 8000, 8000, 4000 B -> two classes, two occurrences each."""
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    params = [jnp.ones((1000,), jnp.float32) for _ in range(6)] + [jnp.ones((10,), jnp.float32)]
    batch = jnp.ones((16, 4), jnp.float32)

    def loss(ps, b):
        return jnp.mean(jnp.tanh(b[:, :1] * jnp.concatenate(ps)[None, :]) ** 2)

    step, buckets = autoccl.make_dp_step(loss, mesh, "dp", 8000, params)
    text = autoccl.compile_dp_step(step, params, batch).as_text()
    sites = autoccl.collective_sites(text)
    assert len(sites) == len(buckets) == 4
    keys = autoccl.assign_keys(sites)
    assert all(s.kind == "all-reduce" and s.nranks == 8 for s in sites)
    by_class = sorted((k.size_class, k.occurrence) for k in keys)
    assert sorted(s.nbytes for s in sites) == [4000, 4040, 8000, 8000]
    assert by_class == [(11, (0, 2)), (11, (1, 2)), (12, (0, 2)), (12, (1, 2))]


def test_command_buffer_options_and_store_record(tmp_path):
    tuning = autoccl.command_buffer_options(
        {"xla_gpu_enable_command_buffer": "FUSION,COLLECTIVES", "x": 1}
    )
    assert tuning == {"xla_gpu_enable_command_buffer": "FUSION", "x": 1}
    assert "COLLECTIVES" not in autoccl.command_buffer_options()["xla_gpu_enable_command_buffer"]
    assert autoccl.command_buffer_options({"x": 1}, tuning=False) == {"x": 1}  # user's setting back
    with pytest.raises(ValueError):
        autoccl.command_buffer_options({"xla_gpu_enable_command_buffer": 3})
    store = autoccl.TuningStore(tmp_path / "s.json")
    sig = autoccl.Signature("nccl-step:abc", 1, "8 devices")
    store.put_record(sig, {"thresholds": {"all-reduce": 1}, "rows": []})
    assert store.get_record(sig) == {"thresholds": {"all-reduce": 1}, "rows": []}


def test_tuning_compiler_options_accepted_by_xla_gpu():
    """The tuning-phase options (command buffers without collectives + a threshold) are valid XLA:GPU
    options for jaxlib's compiler (deviceless compile; no GPU needed)."""
    from concerto_jax.deviceless import (
        CompileOptions,
        compile_lowered,
        gpu_plugin_available,
        target_mesh,
    )

    if not gpu_plugin_available():
        pytest.skip("CUDA plugin for deviceless compiles not installed")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from concerto_jax.costmodel import get_cluster

    cl = get_cluster("h100_sxm_8")
    mesh = target_mesh(cl, (8,), ("dp",))
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("dp")))

    def f(ws, x):
        g = jax.grad(lambda ws: jnp.mean(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2))(ws)
        return [a - 0.1 * b for a, b in zip(ws, g, strict=True)]

    texts = {}
    for th in (0, 1 << 30):
        opts = autoccl.command_buffer_options()
        opts.update(autoccl.gpu_combine_threshold_options({"all-reduce": th}))
        lowered = jax.jit(f).trace([w, w], x).lower()
        tc = compile_lowered(lowered, cl, CompileOptions(extra=tuple(opts.items()), dump_lhs=False))
        texts[th] = tc.final_text
    from tests._helpers import collective_issues

    # the threshold is what decides the bucket count (all-reduces in whatever form XLA runs
    # them: jaxlib >= 0.11 makes small ones Triton collective kernels, which bypass NCCL)
    issued = {th: collective_issues(t, "all-reduce") for th, t in texts.items()}
    assert len(issued[0]) == 2 and len(issued[1 << 30]) == 1
    # the tuner plugin sees the NCCL ones only, once each
    for th, t in texts.items():
        nccl = [i for i, _, _ in issued[th] if not i.is_collective_kernel]
        assert len(autoccl.collective_sites(t)) == len(nccl)
