"""AutoCCL tuner: search on synthetic surfaces, online tuner, store, buckets, DP step, knobs, NCCL plugin."""

import itertools
import os
import subprocess
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from concerto_jax import autoccl
from concerto_jax.autoccl import nccl_model
from concerto_jax.autoccl.coordination import broadcast_decision
from concerto_jax.autoccl.measurement import robust_time


# ----------------------------------------------------------------- search
def _exhaustive_optimum(cluster, coll, nbytes, interference):
    sp = nccl_model.NCCL_SPACE
    grids = np.meshgrid(*[np.asarray(g.values) for g in sp.resources], indexing="ij")
    best = np.inf
    for sub in sp.subspaces():
        t = nccl_model.nccl_time_grid(
            cluster,
            coll,
            nbytes,
            sub["algorithm"],
            sub["protocol"],
            sub["transport"],
            *grids,
            interference,
        )
        best = min(best, float(np.min(t)))
    return best


CASES = [
    (nccl_model.H100_NVLINK_8, "all-reduce", 1 << 20, 0.0),
    (nccl_model.H100_NVLINK_8, "all-reduce", 256 << 20, 0.5),
    (nccl_model.H100_NVLINK_8, "all-gather", 1 << 30, 0.5),
    (nccl_model.A40_PCIE_2x8, "reduce-scatter", 64 << 20, 0.2),
    (nccl_model.A40_PCIE_2x8, "all-reduce", 16 << 20, 0.0),
]


@pytest.mark.parametrize("cluster,coll,nbytes,interference", CASES)
def test_coordinate_descent_within_5pct_of_exhaustive_under_noise(
    cluster, coll, nbytes, interference
):
    rng = np.random.default_rng(nbytes % 997)
    space = nccl_model.NCCL_SPACE

    def measure(cfg):  # 3 % multiplicative noise, median of 3 as the online tuner would do
        t = nccl_model.nccl_time(cluster, coll, nbytes, cfg, interference)
        return float(np.median(t * (1 + 0.03 * rng.standard_normal(3))))

    start = nccl_model.nccl_default_config(cluster, coll, nbytes)
    res = autoccl.minimize(
        space, measure, autoccl.SearchOptions(start=start, min_rel_improvement=0.02)
    )
    true_best = nccl_model.nccl_time(cluster, coll, nbytes, res.best_config, interference)
    opt = _exhaustive_optimum(cluster, coll, nbytes, interference)
    print(
        f"{cluster.name} {coll} {nbytes}: {res.evaluations} evaluations of {space.size()}, "
        f"found/optimum = {true_best / opt:.4f}"
    )
    assert true_best <= 1.05 * opt
    assert res.evaluations <= space.size() // 500
    assert true_best <= nccl_model.nccl_time(cluster, coll, nbytes, start, interference) * 1.001


def test_search_skips_unavailable_subspaces_and_respects_budget():
    space = nccl_model.NCCL_SPACE
    calls = []

    def measure(cfg):
        calls.append(cfg)
        return nccl_model.nccl_time(nccl_model.H100_NVLINK_8, "all-gather", 1 << 24, cfg)

    res = autoccl.minimize(space, measure, autoccl.SearchOptions(max_evaluations=30))
    assert res.evaluations == len(set(calls)) <= 30
    assert max(calls.count(c) for c in calls) <= 2  # at most one refresh of an incumbent
    assert np.isfinite(res.best_time)


def test_restarts_and_topk_pruning():
    space = autoccl.SearchSpace(
        strategy=(autoccl.Choice("s", ("a", "b", "c")),),
        resources=(
            autoccl.IntGrid("x", autoccl.linear_grid(0, 99), default=10),
            autoccl.IntGrid("y", autoccl.linear_grid(0, 49), default=40),
        ),
    )
    off = {"a": 1.0, "b": 0.7, "c": 1.3}

    def f(cfg):
        return off[cfg["s"]] + ((cfg["x"] - 63) / 30) ** 2 + ((cfg["y"] - 12) / 20) ** 2 + 0.3

    res = autoccl.minimize(
        space,
        f,
        autoccl.SearchOptions(restarts=2, subspace_top_k=2, seed=3, min_rel_improvement=0.0),
    )
    assert res.best_config == autoccl.Config(s="b", x=63, y=12)
    assert res.evaluations < space.size() // 20


def test_space_encode_decode_roundtrip():
    space = nccl_model.NCCL_SPACE
    cfg = autoccl.Config(
        algorithm="Tree",
        protocol="LL128",
        transport="SHM",
        nchannels=7,
        nthreads=256,
        chunk_bytes=space.resources[2].values[5],
    )
    vec = space.encode(cfg)
    assert vec.dtype == np.int32 and space.decode(vec) == cfg
    assert broadcast_decision(space, cfg, True) == (cfg, True)  # single process: identity
    with pytest.raises(ValueError):
        space.encode(cfg.replace(protocol="XX"))


# ----------------------------------------------------------------- online
def _synthetic_1d():
    space = autoccl.SearchSpace(
        resources=(autoccl.IntGrid("b", autoccl.geometric_grid(1, 1 << 20), default=1),)
    )

    def true_time(cfg):  # unimodal: latency per bucket vs. delay of large buckets
        return 0.01 * (1 << 20) / cfg["b"] * 1e-3 + 1e-9 * cfg["b"] + 1e-3

    return space, true_time


def test_online_tuner_converges_freezes_and_ignores_warmup_and_outliers(tmp_path):
    space, true_time = _synthetic_1d()
    rng = np.random.default_rng(0)
    events = []
    store = autoccl.TuningStore(tmp_path / "autoccl.json")
    sig = autoccl.Signature("grad-buckets", 1 << 20, "1x8")
    opts = autoccl.TunerOptions(warmup_steps=1, repeats=3)
    tuner = autoccl.OnlineTuner(space, sig, opts, store=store, progress=events.append)
    last, since_change, steps = None, 0, 0
    while not tuner.frozen:
        cfg = tuner.next_config()
        since_change = since_change + 1 if cfg == last else 0
        last = cfg
        t = true_time(cfg) * (1 + 0.02 * rng.standard_normal())
        if since_change == 0:
            t += 10.0  # first step of a config: "compilation"
        elif steps % 11 == 5:
            t *= 50  # an outlier
        if tuner.frozen:
            break
        tuner.report(t)
        steps += 1
        assert steps < 500
    res = tuner.result
    grid = space.resources[0].values
    best_true = min(true_time(autoccl.Config(b=b)) for b in grid)
    assert true_time(res.config) <= 1.05 * best_true
    assert res.time <= res.start_time
    assert tuner.next_config() == res.config  # frozen: same config at no cost
    tuner.report(123.0)  # ignored once frozen
    assert events and events[-1].phase == "frozen" and events[-1].config == res.config
    assert any(e.phase == "search" for e in events)
    assert res.evaluations < len(grid)
    # the stored result is reused: frozen from the first call
    again = autoccl.OnlineTuner(space, sig, opts, store=store)
    assert again.next_config() == res.config and again.frozen and again.result.from_store


def test_online_tuner_protocol_errors():
    space, _ = _synthetic_1d()
    tuner = autoccl.OnlineTuner(space)
    with pytest.raises(RuntimeError):
        tuner.report(1.0)
    with pytest.raises(ValueError):
        autoccl.OnlineTuner(space, store=autoccl.TuningStore("/tmp/x.json"))
    a = tuner.next_config()
    assert tuner.next_config() == a  # idempotent until report()


def test_robust_time_rejects_outliers():
    s = robust_time([1.0, 1.01, 0.99, 1.02, 30.0])
    assert s.rejected == 1 and abs(s.time - 1.005) < 0.01


def test_store_ignores_other_spaces_and_corrupt_files(tmp_path):
    space, _ = _synthetic_1d()
    store = autoccl.TuningStore(tmp_path / "s.json")
    sig = autoccl.Signature("all-reduce", 1024, "dp=8")
    store.put(sig, space, autoccl.Config(b=1024), time=1e-3)
    assert store.get(sig, space)["config"] == autoccl.Config(b=1024)
    assert store.get(sig, nccl_model.NCCL_SPACE) is None
    (tmp_path / "s.json").write_text("{not json")
    assert store.get(sig, space) is None


# ----------------------------------------------------------------- buckets
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(-1, 12000))
def test_plan_buckets_properties(sizes, cap):
    buckets = autoccl.plan_buckets(sizes, cap)
    flat = [i for b in buckets for i in b.indices]
    assert flat == list(range(len(sizes)))
    for b in buckets:
        assert b.nbytes == sum(sizes[i] for i in b.indices)
        if cap <= 0:
            assert len(b.indices) == 1
        elif len(b.indices) > 1:
            assert b.nbytes <= cap
    for b1, b2 in itertools.pairwise(buckets):  # greedy: the next gradient did not fit
        if cap > 0:
            assert b1.nbytes + sizes[b2.indices[0]] > cap


def test_dp_step_bucket_count_in_hlo_and_equal_results():
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal(int(s)), jnp.float32) for s in rng.integers(16, 200, 12)
    ]
    batch = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)

    def loss(ps, b):
        v = jnp.concatenate(ps)
        return jnp.mean(jnp.tanh(b[:, :1] * v[None, :]) ** 2)

    outs = []
    for cap in (0, 1024, 1 << 30):
        step, buckets = autoccl.make_dp_step(loss, mesh, "dp", cap, params)
        exe = autoccl.compile_dp_step(step, params, batch)
        assert autoccl.count_all_reduces(exe.as_text()) == len(buckets)
        outs.append(exe(params, batch)[0])
    assert len(autoccl.plan_buckets([p.nbytes for p in params], 1024)) not in (1, len(params))
    for other in outs[1:]:
        for x, y in zip(outs[0], other, strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    # with XLA:CPU's combiner on, everything collapses into one all-reduce
    step, _ = autoccl.make_dp_step(loss, mesh, "dp", 0, params)
    assert (
        autoccl.count_all_reduces(autoccl.compile_dp_step(step, params, batch, False).as_text())
        == 1
    )


# ----------------------------------------------------------------- knobs
def test_knobs():
    cfg = autoccl.Config(
        algorithm="Tree",
        protocol="LL128",
        transport="P2P",
        nchannels=8,
        nthreads=256,
        chunk_bytes=131072,
    )
    env = autoccl.nccl_env(cfg)
    assert env == {
        "NCCL_ALGO": "Tree",
        "NCCL_PROTO": "LL128",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_MIN_CTAS": "8",
        "NCCL_MAX_CTAS": "8",
        "NCCL_NTHREADS": "256",
        "NCCL_BUFFSIZE": str(8 * 131072),
    }
    opts = autoccl.gpu_combine_threshold_options({"all-reduce": 1 << 25, "all-gather": 1 << 20})
    assert opts == {
        "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 25,
        "xla_gpu_all_gather_combine_threshold_bytes": 1 << 20,
    }
    assert (
        autoccl.xla_flags(autoccl.cpu_compiler_options())
        == "--xla_disable_hlo_passes=cpu-all-reduce-combiner"
    )
    with pytest.raises(ValueError):
        autoccl.gpu_combine_threshold_options({"all-to-all": 1})


# ----------------------------------------------------------------- plugin
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    return autoccl.plugin.build(d), autoccl.plugin.build_harness(d), d


def _query(built, table, *queries, trace=False):
    lib, harness, _ = built
    env = {k: v for k, v in os.environ.items()
           if k not in (autoccl.plugin.TABLE_ENV, autoccl.plugin.TRACE_ENV)}
    if table is not None:
        env[autoccl.plugin.TABLE_ENV] = str(table)
    if trace:
        env[autoccl.plugin.TRACE_ENV] = "1"
    proc = subprocess.run(
        [harness, lib, "v3", "8", *queries], capture_output=True, text=True, timeout=30, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[1:], proc.stderr


def test_plugin_answers_per_table(built):
    tuned = {
        ("all-reduce", 1 << 20): autoccl.Config(algorithm="Tree", protocol="LL128", nchannels=4),
        ("all-reduce", 1 << 30): autoccl.Config(algorithm="Ring", protocol="Simple", nchannels=32),
        ("all-gather", 1 << 24): autoccl.Config(algorithm="Ring", protocol="LL", nchannels=0),
    }
    table = autoccl.plugin.write_table(autoccl.plugin.rows_from_configs(tuned), built[2] / "t.txt")
    out, err = _query(
        built,
        table,
        "allreduce",
        "1000",
        "allreduce",
        str(1 << 30),
        "allgather",
        "5",
        "reducescatter",
        "5",
    )
    assert out[0].endswith("algo=tree proto=ll128 channels=4")
    assert out[1].endswith("algo=ring proto=simple channels=32")
    assert out[2].endswith("algo=ring proto=ll channels=-1")
    assert out[3].endswith("algo=default proto=default channels=-1")
    assert "3 rule(s) loaded" in err
    assert "getCollInfo" not in err  # the trace is off by default


def test_plugin_trace_logs_what_nccl_asked_and_what_the_table_answered(built):
    rows = [autoccl.plugin.TableRow("all-reduce", 0, 1 << 20, "Ring", "Simple", channels=3)]
    table = autoccl.plugin.write_table(rows, built[2] / "trace.txt")
    out, err = _query(built, table, "allreduce", "4096", "allgather", "4096", trace=True)
    calls = [ln for ln in err.splitlines() if "getCollInfo" in ln]
    assert len(calls) == 2, err
    assert "getCollInfo allreduce nBytes=4096" in calls[0] and "rule 0, rule applied, nChannels=3" in calls[0]
    assert "getCollInfo allgather nBytes=4096" in calls[1] and "rule -1, no rule matched" in calls[1]
    assert out[0].endswith("algo=ring proto=simple channels=3")
    assert open(table).read().splitlines()[0] == "concerto-tuner-table 3"
    assert autoccl.plugin.plugin_env("a.so", "t.txt")["NCCL_TUNER_PLUGIN"].endswith("a.so")


def _sealed(body, n_rules):
    """A version 3 table from a hand-written body: end line with the count and the checksum."""
    return body + f"end {n_rules} crc32={zlib.crc32(body.encode()):08x}\n"


@pytest.mark.parametrize(
    "content",
    [
        None,
        "missing",
        _sealed("concerto-tuner-table 3\nallreduce 0 x * * ring simple 1\n", 1),
        _sealed("concerto-tuner-table 3\nallreduce 0 2000 * * ring simple\n", 1),
        _sealed("concerto-tuner-table 3\nbogus 0 2000 * * ring simple 1\n", 1),
        _sealed("concerto-tuner-table 3\nallreduce 2000 0 * * ring simple 1\n", 1),
        _sealed("concerto-tuner-table 3\nallreduce 0 2000 * * ring * 1\n", 1),
        _sealed("concerto-tuner-table 3\nallreduce 0 2000 * 2/2 ring simple 1\n", 1),
        "concerto-tuner-table 3\nallreduce 0 2000 * * ring simple 1\n",  # no end line
        _sealed("concerto-tuner-table 3\nallreduce 0 2000 * * ring simple 1\n", 2),  # count
        _sealed("allreduce 0 2000 * * ring simple 1\n", 1),  # no header
        "concerto-tuner-table 2\nallreduce 0 2000 * * ring simple 1\nend 1\n",  # v2: no checksum
        "allreduce 0 2000 ring simple 1\n",  # the old (version 1) format
        "\x00\xff garbage",
    ],
)
def test_plugin_bad_or_missing_table_keeps_defaults(built, content):
    if content is None:
        table = None
    elif content == "missing":
        table = built[2] / "does-not-exist.txt"
    else:
        table = built[2] / "bad.txt"
        table.write_bytes(content.encode("latin-1"))
    out, err = _query(built, table, "allreduce", "1000")
    assert out == ["allreduce 1000 rc=0 algo=default proto=default channels=-1"]
    assert "[log 2]" in err  # a warning went through NCCL's logger


def test_table_row_validation():
    with pytest.raises(ValueError):
        autoccl.plugin.TableRow("all-to-all", 0, 1, "Ring", "Simple").render()
    with pytest.raises(ValueError):
        autoccl.plugin.TableRow("all-reduce", 5, 1, "Ring", "Simple").render()
