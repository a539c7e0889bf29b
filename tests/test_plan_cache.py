"""The persistent plan cache (``concerto_jax.plan_cache``, ``plan_keys``, ``plan_store``): a hit
skips the capture, the passes and our compile and still gives bitwise the original's results;
the key follows each of its parts; every damaged or stale entry is ignored with one warning and
the step compiles as without a cache; concurrent writers in several processes never leave a torn
entry; under jax.distributed process 0's plan is reused by every process."""

import dataclasses
import glob
import json
import os
import subprocess
import sys
import warnings

import jax
import pytest

import concerto_jax
from concerto_jax import capture as capture_lib
from concerto_jax import executor, jax_compat, pipeline, plan_cache, plan_keys
from concerto_jax.plan_store import (
    FORMAT_VERSION,
    MANIFEST,
    PlanCacheWarning,
    PlanStore,
    default_dir,
    key_of,
    resolve_dir,
)
from hlo_passes.registry import PASSES
from tests._helpers import assert_tree_bitwise
from tests.workers.plan_cache_step import make_step

NO_THRESHOLD_SEARCH = concerto_jax.DevicelessOptions(combine_thresholds=())
"""compile_for_target without its search over XLA's combine thresholds (one XLA compile each)."""

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULE = concerto_jax.Options(passes=("schedule",))


def _entries(root, kind: str) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), "entries", kind, "*", "*")))


def _optimized(root, made=None, **options):
    """optimize the worker's step (or ``made``: a step and its operands) with the cache at
    ``root``; its first call must equal the original's bitwise. Returns the OptimizedStep."""
    step, operands = made or make_step()
    opt = concerto_jax.optimize(step, dataclasses.replace(SCHEDULE, cache_dir=str(root), **options))
    assert_tree_bitwise(opt(*operands), step(*operands))
    return opt


@pytest.fixture
def calls(monkeypatch):
    """Counts of the stages a hit skips: capture, the pipeline (passes), our compile."""
    counts = {"capture": 0, "passes": 0, "compile": 0}
    for module, name, stage in ((capture_lib, "capture", "capture"), (pipeline, "run", "passes"),
                                (executor, "compile_replicated", "compile")):
        real = getattr(module, name)

        def counted(*a, _real=real, _stage=stage, **k):
            counts[_stage] += 1
            return _real(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.fixture
def fresh_code_part():
    plan_keys.code_part.cache_clear()
    yield
    plan_keys.code_part.cache_clear()


# -- hit and miss ----------------------------------------------------------------------------------

def test_a_hit_skips_capture_passes_and_compile(tmp_path, calls):
    first = _optimized(tmp_path)
    assert calls == {"capture": 1, "passes": 1, "compile": 1}
    assert len(_entries(tmp_path, "step")) == 1 and len(_entries(tmp_path, "executable")) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanCacheWarning)
        second = _optimized(tmp_path)  # a new OptimizedStep: nothing shared but the disk
    assert calls == {"capture": 1, "passes": 1, "compile": 1}, "a hit ran a stage again"
    rep = second.report()
    assert rep.optimized and rep.executable == "recompiled"
    assert "plan_cache" in rep.stage_seconds and "passes" not in rep.stage_seconds
    assert json.dumps([dataclasses.asdict(p) for p in rep.passes]) == json.dumps(
        [dataclasses.asdict(p) for p in first.report().passes])
    assert second.hlo_texts() == first.hlo_texts()
    operands = make_step()[1]
    assert_tree_bitwise(second(*operands), first(*operands))  # later calls: JAX's fast path


def test_a_hits_first_step_check_runs_the_hits_own_compile_of_the_original(tmp_path):
    """On a hit whose first step is checked, the step is compiled as the original compiles (not
    at the capture's reduced level) and the check runs that compile: jit compiles nothing."""
    _optimized(tmp_path)
    step, operands = make_step()  # a fresh jit: nothing compiled yet
    opt = concerto_jax.optimize(step, dataclasses.replace(SCHEDULE, cache_dir=str(tmp_path)))
    got = opt(*operands)
    assert step._cache_size() == 0, "the check compiled the original again"
    rep = opt.report()
    assert "plan_cache" in rep.stage_seconds
    assert rep.first_step_check.startswith("ran: outputs equal the original's (bitwise)")
    assert_tree_bitwise(got, step(*operands))


def _worker(cache_dir) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "tests.workers.plan_cache_step", "--cache-dir",
                          str(cache_dir)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hit_in_a_fresh_process(tmp_path):
    first, second = _worker(tmp_path), _worker(tmp_path)
    for rep in (first, second):
        assert rep["optimized"] and rep["equal"], rep
        assert not [w for w in rep["warnings"] if "PlanCacheWarning" in w], rep["warnings"]
    assert "plan_cache" not in first["stage_seconds"] and "passes" in first["stage_seconds"]
    assert "plan_cache" in second["stage_seconds"] and "passes" not in second["stage_seconds"]
    assert second["plan_digest"] == first["plan_digest"]


def test_cache_off_and_the_default_directory(tmp_path, monkeypatch, calls):
    env_dir = tmp_path / "env"
    monkeypatch.setenv("CONCERTO_JAX_CACHE_DIR", str(env_dir))
    step, operands = make_step()
    for _ in range(2):
        opt = concerto_jax.optimize(step, dataclasses.replace(SCHEDULE, cache_dir=None))
        opt(*operands)
    assert calls["passes"] == 2 and not env_dir.exists(), "cache_dir=None must write nothing"
    opt = concerto_jax.optimize(step, SCHEDULE)  # "auto": $CONCERTO_JAX_CACHE_DIR
    opt(*operands)
    assert len(_entries(env_dir, "step")) == 1
    assert default_dir() == resolve_dir("auto") == str(env_dir)
    monkeypatch.delenv("CONCERTO_JAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == str(tmp_path / "xdg" / "concerto_jax" / "plans")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_dir() == str(tmp_path / "home" / ".cache" / "concerto_jax" / "plans")
    assert resolve_dir("~/plans") == str(tmp_path / "home" / "plans") and resolve_dir(None) is None
    with pytest.raises(TypeError, match="cache_dir"):
        concerto_jax.Options(cache_dir=3)


def test_the_suite_never_writes_the_users_cache():
    users = os.path.join(os.path.expanduser("~"), ".cache")
    assert not os.path.abspath(default_dir()).startswith(users), default_dir()


def test_a_pass_registered_at_run_time_turns_the_cache_off(tmp_path, monkeypatch):
    real, ran = PASSES["schedule"], []
    monkeypatch.setitem(PASSES, "schedule", lambda m, o: ran.append(1) or real(m, o))
    _optimized(tmp_path)
    _optimized(tmp_path)
    assert len(ran) == 2 and not _entries(tmp_path, "step")


# -- the key ---------------------------------------------------------------------------------------

def test_the_key_follows_each_of_its_parts(tmp_path, monkeypatch, fresh_code_part):
    from concerto_jax.scheduler import ScheduleOptions
    from hlo_passes.decompose.options import DecomposeOptions

    step, operands = make_step()

    def key(options=SCHEDULE, fn=step, args=operands):
        return plan_cache.open_step(fn, args, {}, dataclasses.replace(options, cache_dir=str(tmp_path))).key

    base = key()
    assert key() == base
    changed = {
        "passes": dataclasses.replace(SCHEDULE, passes=("decompose", "schedule")),
        "scheduler": dataclasses.replace(SCHEDULE, scheduler=ScheduleOptions(seed=1)),
        "decompose": dataclasses.replace(SCHEDULE, decompose=DecomposeOptions(region_degree=4)),
        "compiler_options": dataclasses.replace(SCHEDULE, compiler_options={"xla_cpu_enable_fast_math": True}),
        "target": dataclasses.replace(SCHEDULE, target="a100_80_8"),
        "combine_thresholds": dataclasses.replace(SCHEDULE, deviceless=NO_THRESHOLD_SEARCH),
        "memory_budget": dataclasses.replace(
            SCHEDULE, deviceless=dataclasses.replace(SCHEDULE.deviceless, memory_budget="input")),
    }
    keys = {name: key(options) for name, options in changed.items()}
    assert base not in keys.values() and len(set(keys.values())) == len(keys), keys
    neutral = {"dump_dir": str(tmp_path / "dump"), "fallback": False,
               "optimize": concerto_jax.OptimizeOptions(check_first_step=False, first_step_reference="wider",
                                                        always_recompile=True)}
    assert set(neutral) | {"cache_dir"} == plan_keys.PLAN_NEUTRAL
    for name, value in neutral.items():
        assert key(dataclasses.replace(SCHEDULE, **{name: value})) == base, name
    # the program: shapes, donation, the jit's compiler options; the devices and their order
    programs = {
        "shape": make_step(rows=24),
        "donation": make_step(donate_argnums=0),
        "jit compiler options": make_step(compiler_options={"xla_cpu_enable_fast_math": True}),
        "device order": make_step(devices=jax.devices()[::-1]),
    }
    for name, (other, args) in programs.items():
        assert key(fn=other, args=args) != base, name
    # the code and JAX: versions, XLA_FLAGS (dump flags aside), this package's source
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/elsewhere")
    plan_keys.code_part.cache_clear()
    assert key() == base
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    plan_keys.code_part.cache_clear()
    assert key() != base
    monkeypatch.delenv("XLA_FLAGS")
    real_versions = jax_compat.jax_versions
    monkeypatch.setattr(jax_compat, "jax_versions", lambda: ("0.0.0", "0.0.0"))
    plan_keys.code_part.cache_clear()
    assert key() != base
    monkeypatch.setattr(jax_compat, "jax_versions", real_versions)
    monkeypatch.setattr(plan_keys, "SOURCE_PACKAGES", ("concerto_jax",))
    plan_keys.code_part.cache_clear()
    assert key() != base


# -- damaged and stale entries -------------------------------------------------------------------

def _damage(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x55
        f.seek(0)
        f.write(data)


def _one_cache_warning(record, match: str) -> None:
    mine = [w for w in record if issubclass(w.category, PlanCacheWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert match in str(mine[0].message), str(mine[0].message)


@pytest.mark.parametrize("kind,blob", [("step", MANIFEST), ("step", "captured.hlo"),
                                       ("step", "plan.json"), ("executable", MANIFEST),
                                       ("executable", "executable.pjrt")])
def test_each_damaged_blob_warns_once_and_compiles(tmp_path, calls, kind, blob):
    _optimized(tmp_path)
    (entry,) = _entries(tmp_path, kind)
    _damage(os.path.join(entry, blob))
    with pytest.warns(PlanCacheWarning) as record:
        _optimized(tmp_path)
    _one_cache_warning(record, "" if blob == MANIFEST else "checksum")
    if kind == "step":
        assert calls["capture"] == 2 and calls["passes"] == 2
    else:  # the plan is still a hit; our module is compiled from its text
        assert calls["capture"] == 1 and calls["passes"] == 1 and calls["compile"] == 2
    before = dict(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanCacheWarning)
        rep = _optimized(tmp_path).report()  # the entry was written again, whole
    assert calls == before and "plan_cache" in rep.stage_seconds


def _rewrite(entry: str, blobs: dict | None = None, meta: dict | None = None, **manifest) -> None:
    """Replace an entry by one with valid checksums: other blobs, meta or manifest fields."""
    root = entry.split(os.sep + "entries" + os.sep)[0]
    with open(os.path.join(entry, MANIFEST)) as f:
        old = json.load(f)
    data = {name: open(os.path.join(entry, name), "rb").read() for name in old["blobs"]}
    store = PlanStore(root)
    store.remove(old["kind"], old["key"])
    store.write(old["kind"], old["parts"], {**data, **(blobs or {})}, meta or old["meta"])
    if manifest:
        with open(os.path.join(entry, MANIFEST)) as f:
            new = json.load(f)
        with open(os.path.join(entry, MANIFEST), "w") as f:
            json.dump({**new, **manifest}, f)


def _parts_with_old_jax(entry: str) -> dict:
    with open(os.path.join(entry, MANIFEST)) as f:
        parts = json.load(f)["parts"]
    return {**parts, "code": {**parts["code"], "jax": "0.0.0"}}


@pytest.mark.parametrize("stale", ["format", "parts"])
def test_a_stale_entry_is_ignored(tmp_path, calls, stale):
    _optimized(tmp_path)
    (entry,) = _entries(tmp_path, "step")
    if stale == "format":
        _rewrite(entry, format=FORMAT_VERSION - 1)
    else:
        _rewrite(entry, parts=_parts_with_old_jax(entry))
    with pytest.warns(PlanCacheWarning) as record:
        _optimized(tmp_path)
    _one_cache_warning(record, "stale")
    assert calls["passes"] == 2


def test_a_plan_that_does_not_verify_is_never_trusted(tmp_path, calls):
    """Valid checksums, but the emitted module's ROOT comes first: a use before its operands'
    definitions. The verifier refuses it; the step is planned again."""
    _optimized(tmp_path)
    (entry,) = _entries(tmp_path, "step")
    with open(os.path.join(entry, "plan.json")) as f:
        plan = json.load(f)
    lines = plan["text"].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    root = next(i for i in range(start, len(lines)) if "ROOT" in lines[i])
    plan["text"] = "\n".join(lines[:start + 1] + [lines[root]] + lines[start + 1:root] + lines[root + 1:])
    _rewrite(entry, {"plan.json": json.dumps(plan).encode()})
    with pytest.warns(PlanCacheWarning) as record:
        _optimized(tmp_path)
    _one_cache_warning(record, "does not verify")
    assert calls["passes"] == 2


def test_a_step_with_another_entry_layout_is_not_served(tmp_path, calls):
    _optimized(tmp_path)
    (entry,) = _entries(tmp_path, "step")
    _rewrite(entry, meta={"entry_layout": "(f32[1]{0})->f32[1]{0}"})
    with pytest.warns(PlanCacheWarning) as record:
        _optimized(tmp_path)
    _one_cache_warning(record, "entry layout")
    assert calls["capture"] == 2 and calls["passes"] == 2


@pytest.mark.parametrize("payload", ["garbage", "another program"])
def test_an_executable_that_does_not_load_is_compiled_from_the_plan(tmp_path, calls, payload):
    _optimized(tmp_path)
    if payload == "garbage":
        data = b"\x08\x01not an executable" * 64
    else:  # a real executable of the same devices whose entry layout is another step's
        _optimized(tmp_path / "other", make_step(rows=24))
        (exe,) = _entries(tmp_path / "other", "executable")
        data = open(os.path.join(exe, "executable.pjrt"), "rb").read()
    calls.update(capture=0, passes=0, compile=0)
    (entry,) = _entries(tmp_path, "executable")
    _rewrite(entry, {"executable.pjrt": data})
    with pytest.warns(PlanCacheWarning) as record:
        rep = _optimized(tmp_path).report()
    _one_cache_warning(record, "could not be loaded")
    assert calls == {"capture": 0, "passes": 0, "compile": 1} and rep.optimized


# -- the store -------------------------------------------------------------------------------------

def _blob_files(root) -> dict[str, str]:
    (entry,) = _entries(root, "step")
    return {name: os.path.join(entry, name) for name in os.listdir(entry)}


@pytest.mark.parametrize("damage", ["truncated blob", "missing blob", "manifest not JSON",
                                    "blob outside the entry", "empty manifest"])
def test_the_store_rejects_every_damage_once(tmp_path, damage):
    store = PlanStore(str(tmp_path))
    parts, blobs = {"program": "p"}, {"a.bin": b"x" * 100, "b.txt": b"y" * 10}
    assert store.write("step", parts, blobs, {"m": 1})
    files = _blob_files(tmp_path)
    if damage == "truncated blob":
        with open(files["a.bin"], "r+b") as f:
            f.truncate(50)
    elif damage == "missing blob":
        os.remove(files["b.txt"])
    elif damage in ("manifest not JSON", "empty manifest"):
        with open(files[MANIFEST], "w") as f:
            f.write("" if damage == "empty manifest" else "{not json")
    else:
        with open(files[MANIFEST]) as f:
            manifest = json.load(f)
        manifest["blobs"]["../../../outside"] = manifest["blobs"].pop("a.bin")
        with open(files[MANIFEST], "w") as f:
            json.dump(manifest, f)
    with pytest.warns(PlanCacheWarning) as record:
        assert store.read("step", parts) is None
    assert len(record) == 1
    assert not _entries(tmp_path, "step"), "a rejected entry is removed"
    assert store.read("step", parts) is None  # a plain miss now: no second warning
    assert store.write("step", parts, blobs, {"m": 1})
    entry = store.read("step", parts)
    assert entry.blobs == blobs and entry.meta == {"m": 1}


def test_concurrent_writers_in_several_processes(tmp_path):
    """Four processes write, read and remove one key at once, 200 rounds each: every read is a
    miss or one writer's whole entry (never a torn one, never a warning)."""
    n = 4
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.workers.plan_store_writer", "--root",
                               str(tmp_path), "--writer", str(i), "--writers", str(n)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (out, err[-2000:])
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["hits"] for r in reports) > 0 and sum(r["wins"] for r in reports) > n
    assert all(r["bad"] == 0 and not r["warnings"] for r in reports), reports
    assert os.listdir(tmp_path / "staging") == [], "a writer left its staging directory"
    entry = PlanStore(str(tmp_path)).read("step", {"program": "the same step", "n": 1})
    assert entry is not None and entry.meta["writer"] in range(n)


def test_least_recently_used_entries_are_evicted(tmp_path):
    store = PlanStore(str(tmp_path), max_bytes=10_000)
    for i in range(3):
        assert store.write("step", {"i": i}, {"blob": bytes(3000)})
        used = 1_000_000 + i * 10  # entry i last used at this time
        os.utime(os.path.join(store.path("step", key_of({"i": i})), MANIFEST), (used, used))
    store.read("step", {"i": 0})  # entry 0 is now the most recently used
    assert store.write("step", {"i": 3}, {"blob": bytes(3000)})  # 4 x ~3.3 kB > 10 kB
    kept = {i for i in range(4) if store.read("step", {"i": i}) is not None}
    assert kept == {0, 2, 3}


# -- compile_for_target ----------------------------------------------------------------------------

def _target_step():
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = concerto_jax.target_mesh("h100_sxm_8", (2, 4), ("dp", "tp"))

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    args = [jax.ShapeDtypeStruct((128, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, "tp"))),
            jax.ShapeDtypeStruct((512, 128), jnp.float32, sharding=NamedSharding(mesh, P("tp", None))),
            jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("dp", None)))]
    return jax.jit(jax.grad(loss, argnums=(0, 1))), args


def _needs_plugin():
    from concerto_jax.deviceless.compile import gpu_plugin_available

    if not gpu_plugin_available():
        pytest.skip("CUDA PJRT plugin missing: pip install -e .[gpu]")


def test_compile_for_target_hit_miss_and_damage(tmp_path, monkeypatch):
    _needs_plugin()
    from concerto_jax.deviceless import program

    step, args = _target_step()
    options = concerto_jax.Options(passes=("schedule",), deviceless=NO_THRESHOLD_SEARCH, cache_dir=str(tmp_path))
    real, compiles = program.compile_lowered, []
    monkeypatch.setattr(program, "compile_lowered",
                        lambda *a, **k: compiles.append(1) or real(*a, **k))
    first = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=options)
    assert len(compiles) == 1 and first.via == "backend_only" and len(_entries(tmp_path, "target")) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanCacheWarning)
        second = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=options)
    assert len(compiles) == 1, "a hit compiled the step"
    assert "plan_cache" in second.seconds and "stock_compile" not in second.seconds
    for field in dataclasses.fields(first):
        if field.name not in ("seconds", "passes"):
            assert getattr(second, field.name) == getattr(first, field.name), field.name
    assert json.dumps([dataclasses.asdict(p) for p in second.passes], default=str) == json.dumps(
        [dataclasses.asdict(p) for p in first.passes], default=str)
    # another path to XLA, or another rewrite guard: another key
    lowered = program.lower_for_target(step.trace(*args))
    from concerto_jax.costmodel import get_cluster

    keys = {plan_cache.open_target(lowered, get_cluster("h100_sxm_8"), options, via=via,
                                   guard_rewrites=guard).key
            for via in ("backend_only", "pin") for guard in (True, False)}
    assert len(keys) == 4
    (entry,) = _entries(tmp_path, "target")
    _damage(os.path.join(entry, "final.hlo"))
    with pytest.warns(PlanCacheWarning) as record:
        third = concerto_jax.compile_for_target(step, *args, target="h100_sxm_8", options=options)
    _one_cache_warning(record, "checksum")
    assert len(compiles) == 2 and third.final_text == first.final_text


# -- several processes -----------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_process_zeros_plan_is_reused_by_every_process(tmp_path):
    """Two processes x 4 CPU devices; each gets its own cache directory (``p<process>``), so that
    only process 0 reading and writing can be seen. First run: a miss, process 0 writes the
    plan (no executable: not cached under jax.distributed). Second run: process 0's hit reaches
    both processes. Third run, process 0's plan damaged: one warning there, planned again."""
    from concerto_jax.launch import run_local

    def run() -> list[dict]:
        results = run_local("tests.workers.plan_cache_step", ["--cache-dir", str(tmp_path)],
                            num_processes=2, timeout_s=300)
        return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]

    first = run()
    assert len(_entries(tmp_path / "p0", "step")) == 1 and not _entries(tmp_path / "p0", "executable")
    assert not (tmp_path / "p1").exists(), "only process 0 reads and writes the cache"
    second = run()
    (entry,) = _entries(tmp_path / "p0", "step")
    _damage(os.path.join(entry, "plan.json"))
    third = run()
    for reps, hit in ((first, False), (second, True), (third, False)):
        assert [r["process"] for r in reps] == [0, 1]
        assert reps[0]["plan_digest"] == reps[1]["plan_digest"], "processes ran different plans"
        for r in reps:
            assert r["optimized"] and r["equal"], r
            assert ("plan_cache" in r["stage_seconds"]) == hit, r["stage_seconds"]
    assert second[0]["plan_digest"] == first[0]["plan_digest"]
    cache_warnings = [[w for w in r["warnings"] if "PlanCacheWarning" in w] for r in third]
    assert len(cache_warnings[0]) == 1 and cache_warnings[1] == [], cache_warnings
    assert not [w for r in first + second for w in r["warnings"] if "PlanCacheWarning" in w]
    assert not (tmp_path / "p1").exists()
