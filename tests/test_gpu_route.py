"""The GPU route of ``optimize`` (``concerto_jax.gpu_route``), its CPU half on CPU.

The JAX side of the load (header splice, options override, swap, donation, host callbacks,
layout check) runs with CPU executables on the 8-device CPU mesh through ``CpuRehearsal``; the
deviceless compile and ``PJRT_Executable_Serialize`` run through the CUDA plugin; the negative
cases (no header, another device count, another compute capability) give a clear error and a
fallback, never a crash. What needs a GPU is ``python -m concerto_jax.gpu_check``'s.
"""

import dataclasses
import shutil
import types
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import concerto_jax
from concerto_jax import jax_compat
from concerto_jax.deviceless import gpu_plugin_available
from concerto_jax.gpu_route import CpuRehearsal, GpuRouteError, LoadRefused, Payload, route
from tests._helpers import assert_tree_bitwise
from tests.test_optimize import _mesh, _mlp_step

needs_plugin = pytest.mark.skipif(not gpu_plugin_available(),
                                  reason="CUDA PJRT plugin missing: pip install -e .[gpu]")
SCHEDULE = concerto_jax.Options(passes=("schedule",))
SCHEDULE_NO_CACHE = concerto_jax.Options(passes=("schedule",), cache_dir=None)


def _fallbacks(caught):
    return [w for w in caught if issubclass(w.category, concerto_jax.ConcertoFallbackWarning)]


def _rehearsed_first_call(step, options, make_args, seed):
    """``optimize(step, options)``'s first call on ``make_args(seed)`` on the rehearsed route: its
    outputs must be the original's bitwise (ours or, after a fallback, the original's; fresh
    arguments each, the step donates). Returns the OptimizedStep and the fallback warnings'
    messages."""
    with route.rehearse():
        opt = concerto_jax.optimize(step, options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = opt(*make_args(seed))
    assert_tree_bitwise(got, step(*make_args(seed)))
    return opt, [str(w.message) for w in _fallbacks(caught)]


def test_rehearsal_runs_ours_for_three_steps_bitwise_with_donation():
    step, make_args = _mlp_step(_mesh())
    with route.rehearse():
        opt = concerto_jax.optimize(step, SCHEDULE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p_ref, x = make_args(0)
            p_opt, _ = make_args(0)
            for i in range(3):
                donated_ref, donated = p_ref, p_opt
                p_ref, v_ref = step(p_ref, x)
                p_opt, v_opt = opt(p_opt, x)
                assert_tree_bitwise((p_opt, v_opt), (p_ref, v_ref))
                assert donated["w1"].is_deleted() == donated_ref["w1"].is_deleted()
                assert i > 0 or donated["w1"].is_deleted(), "a fresh donated argument must be consumed"
    assert not _fallbacks(caught), [str(w.message) for w in caught]
    rep = opt.report()
    assert rep.optimized and rep.executable.startswith("backend-only (cpu-rehearsal")
    assert rep.first_step_check.startswith("ran: outputs equal the original's (bitwise)")
    assert [p.name for p in rep.passes] == ["schedule"] and rep.passes[0].changed
    assert set(rep.stage_seconds) == set(route.STAGES)


def test_outside_rehearsal_a_cpu_step_takes_the_cpu_path():
    assert route.backend_for("cpu") is None
    assert isinstance(route.backend_for("gpu"), route.GpuBackend)
    with route.rehearse():
        assert isinstance(route.backend_for("cpu"), CpuRehearsal)
    step, make_args = _mlp_step(_mesh())
    opt = concerto_jax.optimize(step, SCHEDULE)
    opt(*make_args(0))
    assert opt.report().executable == "recompiled"


def _reversed_mesh():
    return Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("dp", "tp"),
                axis_types=(AxisType.Auto,) * 2)


def test_load_options_put_the_steps_device_assignment_back():
    # The payload is compiled for devices 0..7 (as a deviceless compile is); the step runs on
    # them in reverse order: only the load's options make the replicas run where the data is.
    step, make_args = _mlp_step(_reversed_mesh())
    built = route.build(step, make_args(0), {}, SCHEDULE, CpuRehearsal())
    assert_tree_bitwise(built.compiled(*make_args(1)), step(*make_args(1)))
    wrong = route.build(step, make_args(0), {}, SCHEDULE, CpuRehearsal(), override_options=False)
    with pytest.raises(Exception, match="is on device cpu:7, but replica is assigned to device cpu:0"):
        jax.block_until_ready(wrong.compiled(*make_args(1)))


@pytest.mark.parametrize("kind", ["debug_callback", "io_callback_ordered", "pure_callback"])
def test_host_callbacks_are_handed_to_the_load(kind):
    from tests.test_robustness import _callback_step

    log_ref, log_opt = [], []
    ref_step, make_args = _callback_step(_mesh(), kind, log_ref)
    src, _ = _callback_step(_mesh(), kind, log_opt)
    with route.rehearse():
        opt = concerto_jax.optimize(src, SCHEDULE)
        w_ref, x = make_args(0)
        w_opt, _ = make_args(0)
        for _ in range(3):
            w_ref, v_ref = ref_step(w_ref, x)
            w_opt, v_opt = opt(w_opt, x)
            jax.effects_barrier()
            assert_tree_bitwise((w_opt, v_opt), (w_ref, v_ref))
    rep = opt.report()
    assert rep.optimized and rep.executable.startswith("backend-only"), rep.fallback_reason
    assert sorted(log_opt) == sorted(log_ref) and len(log_opt) == len(log_ref)
    if kind != "pure_callback":
        assert log_opt, "the callbacks must have fired"


def _break(monkeypatch, stage):
    boom = RuntimeError(f"synthetic failure at {stage}")

    def raiser(*a, **k):
        raise boom

    if stage == "stock_compile":
        monkeypatch.setattr(CpuRehearsal, "stock_compile", raiser)
    elif stage == "plan":
        monkeypatch.setattr(CpuRehearsal, "plan", raiser)
    elif stage == "target_config":
        monkeypatch.setattr(CpuRehearsal, "target", raiser)
    elif stage == "backend_compile":
        monkeypatch.setattr(CpuRehearsal, "compile", raiser)
    elif stage == "checksum":
        monkeypatch.setattr(route, "_same_everywhere", lambda digest: False)
    elif stage == "load":
        monkeypatch.setattr(jax_compat, "deserialize", raiser)
    elif stage == "layout_check":
        real = jax_compat.entry_layout
        calls = []

        def differs(exe):  # the step's layout, then a different one for ours
            calls.append(exe)
            return real(exe) + ("" if len(calls) % 2 else "{0,1}")
        monkeypatch.setattr(jax_compat, "entry_layout", differs)
    elif stage == "swap":
        monkeypatch.setattr(jax_compat, "swapped_step", raiser)


@pytest.mark.parametrize("stage", route.STAGES)
def test_a_failed_stage_falls_back_with_one_warning_naming_it(monkeypatch, stage):
    step, make_args = _mlp_step(_mesh())
    _break(monkeypatch, stage)
    with route.rehearse():
        opt = concerto_jax.optimize(step, SCHEDULE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [opt(*make_args(i)) for i in range(2)]
    assert_tree_bitwise(got, [step(*make_args(i)) for i in range(2)])
    fb = _fallbacks(caught)
    assert len(fb) == 1, [str(w.message) for w in caught]
    assert f"the GPU route failed at stage {stage!r}" in str(fb[0].message)
    rep = opt.report()
    assert not rep.optimized and rep.executable == "original" and stage in rep.fallback_reason
    strict = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), fallback=False))
    with route.rehearse(), pytest.raises(GpuRouteError) as err:
        strict(*make_args(0))
    assert err.value.stage == stage


def test_a_restarted_job_reuses_the_plan_and_our_executable(tmp_path):
    """The plan cache's route entry: a second ``optimize`` of the same step (what a restarted job
    builds) skips the plan and the backend compile, loads the stored executable behind its own
    stock compile's header, and runs bitwise, its first step checked as on a miss (against that
    stock compile: the original is compiled once per build)."""
    step, make_args = _mlp_step(_mesh())
    opts = concerto_jax.Options(passes=("schedule",), cache_dir=str(tmp_path))
    ref = step(*make_args(0))
    jitted = step._cache_size()
    reports = []
    with route.rehearse():
        for _ in range(2):
            opt = concerto_jax.optimize(step, opts)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert_tree_bitwise(opt(*make_args(0)), ref)
            assert not _fallbacks(caught), [str(w.message) for w in caught]
            reports.append(opt.report())
    first, second = reports
    assert {"plan", "backend_compile"} <= set(first.stage_seconds) and "plan_cache" not in first.stage_seconds
    assert "plan_cache" in second.stage_seconds
    assert not {"plan", "target_config", "backend_compile"} & set(second.stage_seconds)
    assert second.optimized and second.first_step_check.startswith("ran: outputs equal the original's (bitwise)")
    assert [(p.name, p.changed) for p in second.passes] == [(p.name, p.changed) for p in first.passes]
    assert len(list(tmp_path.glob("entries/route/*/*/manifest.json"))) == 1
    # the first-step checks ran the route's own stock compile of the step: jit compiled nothing
    assert step._cache_size() == jitted


def test_the_first_step_check_compares_with_the_original_not_with_ours(monkeypatch):
    """The route's first-step check runs the route's stock compile of the step as the original:
    an executable that computes something else (our plan's learning rate changed) is caught, the
    call returns the original's outputs and the step falls back with one warning."""
    import re

    step, make_args = _mlp_step(_mesh())
    planned = CpuRehearsal.plan

    def other_rate(self, stock, options):
        plan = planned(self, stock, options)
        text = re.sub(r"constant\(0\.1\)", "constant(0.2)", plan.handed, count=1)
        assert text != plan.handed
        return dataclasses.replace(plan, handed=text, sha256=route._sha(text))

    monkeypatch.setattr(CpuRehearsal, "plan", other_rate)
    opt, fb = _rehearsed_first_call(step, SCHEDULE_NO_CACHE, make_args, 0)
    assert len(fb) == 1 and "differs from the original" in fb[0], fb
    assert not opt.report().optimized


def test_a_cached_executable_the_load_refuses_is_rejected_and_the_step_built_again(tmp_path):
    """A route entry whose executable the load's checks refuse (here: compiled for 4 devices, the
    step has 8) is dropped with one PlanCacheWarning and the step is built as without a cache; the
    build stores a good entry, which the next build reads."""
    from concerto_jax import plan_cache
    from concerto_jax.plan_store import PlanCacheWarning

    step, make_args = _mlp_step(_mesh())
    opts = concerto_jax.Options(passes=("schedule",), cache_dir=str(tmp_path))
    built = route.build(step, make_args(0), {}, opts, CpuRehearsal())
    again = route.build(step, make_args(0), {}, opts, CpuRehearsal())
    assert "plan_cache" in again.seconds and "backend_compile" not in again.seconds
    assert again.plan.handed == built.plan.handed and again.payload.data == built.payload.data
    step4, make4 = _mlp_step(_mesh((1, 4)))
    small = route.build(step4, make4(0), {}, SCHEDULE_NO_CACHE, CpuRehearsal())
    cache = plan_cache.open_route(step.lower(*make_args(0)), opts, CpuRehearsal.name)
    cache.store.remove("route", cache.key)
    cache.save(built.stock.post_spmd, built.plan.to_json(), small.payload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rebuilt = route.build(step, make_args(0), {}, opts, CpuRehearsal())
    refused = [w for w in caught if issubclass(w.category, PlanCacheWarning)]
    assert len(refused) == 1 and "its executable was refused" in str(refused[0].message)
    assert "backend_compile" in rebuilt.seconds and rebuilt.payload.num_devices == 8
    assert_tree_bitwise(rebuilt.compiled(*make_args(1)), step(*make_args(1)))
    last = route.build(step, make_args(0), {}, opts, CpuRehearsal())
    assert "plan_cache" in last.seconds and last.payload.num_devices == 8


# -- negative cases: a clear error before the runtime sees the bytes, and a fallback ------------

@pytest.fixture(scope="module")
def eight_and_four():
    """The mlp step on 8 devices (stock compile) and payloads of it for 8 and for 4 devices."""
    step, make_args = _mlp_step(_mesh())
    built = route.build(step, make_args(0), {}, SCHEDULE, CpuRehearsal())
    step4, make4 = _mlp_step(_mesh((1, 4)))
    small = route.build(step4, make4(0), {}, SCHEDULE, CpuRehearsal())
    return built, small, step, make_args


def test_raw_bytes_without_a_header_are_refused_clearly(eight_and_four):
    built, _, _, _ = eight_and_four
    devices = built.stock.device_list
    raw = built.payload.data
    with pytest.raises(ValueError, match="not a serialized executable"):
        jax_compat.deserialize(raw, devices)
    whole = jax_compat.step_header(jax_compat.xla_executable(built.stock.compiled)) + raw
    jax_compat.split_ifrt_blob(whole)  # the real thing passes
    with pytest.raises(LoadRefused, match="already starts with an IFRT header"):
        route.check_payload(Payload(whole, 8, True, None, ""), devices, 8)


def test_another_device_count_is_refused_before_the_runtime(eight_and_four):
    # The runtime aborts the process (a CHECK) on this; it must never see it.
    built, small, _, _ = eight_and_four
    devices = built.stock.device_list
    assert route.payload_device_count(small.payload.data) == 4
    with pytest.raises(LoadRefused, match="device counts differ .*payload 4, devices 8, step 8"):
        route.load_payload(built.stock.compiled, small.payload)
    lying = Payload(small.payload.data, 8, True, None, "")
    with pytest.raises(LoadRefused, match="stored in the payload 4"):
        route.check_payload(lying, devices, 8)


def test_another_compute_capability_is_refused(eight_and_four):
    from concerto_jax.deviceless.pjrt_c import RIEGELI_SIGNATURE

    built, _, _, _ = eight_and_four
    gpus = [types.SimpleNamespace(id=i, device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                                  core_count=132, process_index=0) for i in range(8)]
    p = Payload(RIEGELI_SIGNATURE + b"\0" * 64, 8, False, "8.0", "")
    with pytest.raises(LoadRefused, match="compute capability 8.0, the devices have \\['9.0'\\]"):
        route.check_payload(p, gpus, 8)
    with pytest.raises(LoadRefused, match="Riegeli signature"):
        route.check_payload(Payload(b"\x0a\x01x", 8, False, "9.0", ""), gpus, 8)
    route.check_payload(dataclass_replace(p, compute_capability="9.0"), gpus, 8)
    with pytest.raises(LoadRefused, match="compute capability 9.0, the devices have \\[''\\]"):
        route.check_payload(dataclass_replace(p, compute_capability="9.0"),
                                   built.stock.device_list, 8)


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


@pytest.mark.parametrize("bad", ["no_header", "four_devices", "compute_capability"])
def test_bad_payloads_fall_back_with_a_warning_naming_the_load(monkeypatch, eight_and_four, bad):
    from concerto_jax.deviceless.pjrt_c import RIEGELI_SIGNATURE

    built, small, step, make_args = eight_and_four
    real_compile = CpuRehearsal.compile

    def compile_bad(self, plan, devices, target, env, callbacks):
        good = real_compile(self, plan, devices, target, env, callbacks)
        if bad == "no_header":  # a whole blob where PJRT bytes belong
            header = jax_compat.step_header(jax_compat.xla_executable(built.stock.compiled))
            return dataclass_replace(good, data=header + good.data)
        if bad == "four_devices":
            return small.payload
        return dataclass_replace(good, data=RIEGELI_SIGNATURE + good.data, compute_capability="8.0")

    monkeypatch.setattr(CpuRehearsal, "compile", compile_bad)
    opt, fb = _rehearsed_first_call(step, SCHEDULE, make_args, 3)
    assert len(fb) == 1 and "stage 'load'" in fb[0] and "LoadRefused" in fb[0]


# -- the real devices' target config ------------------------------------------------------------

def _gpu(kind, cc, cores=None, process=0, i=0):
    return types.SimpleNamespace(id=i, device_kind=kind, compute_capability=cc, core_count=cores,
                                 process_index=process)


@pytest.mark.parametrize(("kind", "cc", "config"), [
    ("NVIDIA H100 80GB HBM3", "9.0", "h100_sxm.txtpb"), ("NVIDIA H100 PCIe", "9.0", "h100_pcie.txtpb"),
    ("NVIDIA H200", "9.0", "h200.txtpb"), ("NVIDIA A100-SXM4-40GB", "8.0", "a100_sxm_80.txtpb"),
    ("NVIDIA B200", "10.0", "b200.txtpb")])
def test_device_target_is_the_shipped_config_of_the_device_kind(kind, cc, config):
    t = route.device_target([_gpu(kind, cc, i=i) for i in range(2)])
    assert t.config_file == config and t.compute_capability == cc and t.topology == "1x1x2"
    assert route.config_compute_capability(t.target_config_text()) == cc


def test_device_target_sets_the_sm_count_and_hosts():
    t = route.device_target([_gpu("NVIDIA H100 NVL", "9.0", cores=130, process=p, i=2 * p + k)
                                    for p in range(2) for k in range(2)])
    assert t.topology == "1x2x2" and t.core_count == 130 and "core_count: 130" in t.config_text


@pytest.mark.parametrize(("devices", "match"), [
    ([_gpu("NVIDIA H100 80GB HBM3", "8.0")], "reports compute capability 8.0, the shipped config h100_sxm.txtpb is for 9.0"),
    ([_gpu("NVIDIA L4", "8.9")], "no target config for device kind 'NVIDIA L4'"),
    ([_gpu("NVIDIA H100 80GB HBM3", "9.0"), _gpu("NVIDIA A100-SXM4-80GB", "8.0", i=1)], "the step's devices differ"),
])
def test_device_target_refuses_what_it_cannot_build_for(devices, match):
    with pytest.raises(GpuRouteError, match=match) as err:
        route.device_target(devices)
    assert err.value.stage == "target_config"


@pytest.mark.parametrize(("devices", "target", "want"), [
    ([_gpu("NVIDIA H200", "9.0", i=i) for i in range(8)], "h100_sxm_8", "h200_sxm_8"),  # measured rates
    ([_gpu("NVIDIA H100 80GB HBM3", "9.0", i=i) for i in range(8)], "h100_sxm_8", "h100_sxm_8"),
    ([_gpu("NVIDIA H100 80GB HBM3", "9.0", i=i) for i in range(8)], "h100_sxm_2x4", "h100_sxm_2x4"),  # its GPU
    ([_gpu("NVIDIA H100 PCIe", "9.0")], "h100_sxm_8", "h100_pcie_8"),
    ([_gpu("NVIDIA H200", "9.0", process=p, i=p) for p in range(2)], "h100_sxm_8", "h100_sxm_8"),  # 2 hosts
    ([_gpu("NVIDIA B200", "10.0")], "h100_sxm_8", "h100_sxm_8"),  # no cluster of its own
])
def test_the_route_plans_with_the_cost_model_of_the_devices_gpu(devices, target, want):
    assert route.cost_target_for(devices, target) == want


def test_an_h200_step_is_planned_with_the_h200s_measured_rates():
    import concerto_jax
    from concerto_jax.costmodel import CostModel, calibration, get_cluster

    options = concerto_jax.Options(passes=("schedule",))
    target = route.cost_target_for([_gpu("NVIDIA H200", "9.0")], options.target)
    planned = dataclasses.replace(options, target=target)
    assert CostModel(get_cluster(planned.target)).options.compute == calibration.H200.compute
    assert planned.passes == options.passes


# -- pieces -------------------------------------------------------------------------------------

def test_split_ifrt_blob_checks_the_runtime_name():
    header = bytes([0x08, 0x03, 0x12, 9]) + b"pjrt_ifrt"
    blob = bytes([len(header)]) + header + b"PAYLOAD"
    assert jax_compat.split_ifrt_blob(blob) == (blob[:1 + len(header)], b"PAYLOAD")
    other = bytes([0x08, 0x03, 0x12, 3]) + b"abc"
    with pytest.raises(ValueError, match="names runtime \\[b'abc'\\], expected b'pjrt_ifrt'"):
        jax_compat.split_ifrt_blob(bytes([len(other)]) + other + b"x")
    with pytest.raises(ValueError, match="not a serialized executable"):
        jax_compat.split_ifrt_blob(bytes([3, 0x07, 0xFF, 0xFF]))


def test_order_kept_counts_instructions_left_in_our_order():
    def module(names):
        body = "\n".join(f"  %{n} = f32[] add(%p, %p)" for n in names)
        return f"HloModule m, is_scheduled=true\n\nENTRY %main {{\n{body}\n}}\n"

    assert route.order_kept(module("abcd"), module("abcd"))["kept"]
    moved = route.order_kept(module("abcd"), module("acbd"))
    assert not moved["kept"] and moved["in_our_order"] == 3 and moved["common"] == 4
    assert route.order_kept(module("abcd"), module("axbcd"))["kept"]  # XLA added x


def test_the_gpu_default_is_identity_until_gpu_check_passed():
    from concerto_jax import options

    assert options.defaults_for_platform("cpu").passes == ()
    assert options.defaults_for_platform("gpu").passes == options.GPU_DEFAULT_PASSES
    assert options.GPU_ROUTE_PASSES == ("decompose", "schedule")


# -- the deviceless half: backend-only compile + PJRT_Executable_Serialize -----------------------

@needs_plugin
def test_deviceless_compile_serializes_our_order():
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless.pjrt_c import RIEGELI_SIGNATURE

    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("x",))
    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731

    def step(a, w, b, v):
        return (a @ w) * 2.0, jnp.tanh(b @ v) @ v.T

    args = (jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=sh(P(None, "x"))),
            jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=sh(P("x", None))),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=sh(P())),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=sh(P())))
    d = route.compile_deviceless(jax.jit(step, out_shardings=(sh(P()), sh(P()))), args,
                                        get_cluster("h100_sxm_8"), SCHEDULE)
    sched = d.plan.passes[-1]
    assert sched.name == "schedule" and sched.changed, "the plan must differ from XLA's order"
    assert d.plan.handed != (d.stock.scheduled_text or d.stock.after_lhs_text)
    data = d.payload.data
    assert data.startswith(RIEGELI_SIGNATURE) and b"PjRtStreamExecutorClient" in data
    assert d.payload.compute_capability == "9.0" and d.payload.num_devices == 8
    assert not d.payload.replicated
    assert route.order_kept(d.plan.handed, d.payload.final_text)["kept"]
    # the payload passes the load's checks for 8 devices of that compute capability only
    gpus = [_gpu("NVIDIA H100 80GB HBM3", "9.0", i=i) for i in range(8)]
    route.check_payload(d.payload, gpus, 8)
    with pytest.raises(LoadRefused):
        route.check_payload(d.payload, gpus[:4], 4)


# -- multi-process: process 0 plans, every process loads the same module, all fall back together --

def _mp_reports(*args):
    import json

    from concerto_jax.launch import run_local

    results = run_local("tests.workers.mp_gpu_route", args, num_processes=2, timeout_s=300)
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


@pytest.mark.multiprocess
def test_every_process_runs_the_leaders_module():
    reps = _mp_reports()
    for r in reps:
        assert r["optimized"] and r["executable"].startswith("backend-only"), r["fallback_reason"]
        assert r["equal"]
    assert reps[0]["handed_digest"] == reps[1]["handed_digest"]


@pytest.mark.multiprocess
def test_a_restarted_multi_process_job_reads_every_process_s_entry(tmp_path):
    """Under jax.distributed each process stores its own route entry (its executable); a
    restarted job (the same workers again) reads them in every process, skips the plan and the
    backend compile, and runs the same module everywhere, bitwise."""
    first = _mp_reports("--cache-dir", str(tmp_path))
    again = _mp_reports("--cache-dir", str(tmp_path))
    for r in first:
        assert r["optimized"] and r["equal"] and "plan" in r["stages"] and "plan_cache" not in r["stages"], r
    for r in again:
        assert r["optimized"] and r["equal"], r["fallback_reason"]
        assert "plan_cache" in r["stages"] and not {"plan", "backend_compile"} & set(r["stages"]), r["stages"]
    assert len({r["handed_digest"] for r in first + again}) == 1
    manifests = list(tmp_path.glob("entries/route/*/*/manifest.json"))
    assert len(manifests) == 2  # one per process
    # one process's entry gone: no process uses its own, all build again together
    shutil.rmtree(manifests[0].parent)
    third = _mp_reports("--cache-dir", str(tmp_path))
    for r in third:
        assert r["optimized"] and r["equal"] and "plan" in r["stages"] and "plan_cache" not in r["stages"], r
    assert len(list(tmp_path.glob("entries/route/*/*/manifest.json"))) == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "process"), [("plan", 0), ("backend_compile", 1)])
def test_a_stage_failing_in_one_process_makes_all_fall_back(stage, process):
    reps = _mp_reports("--break-stage", stage, "--break-on", str(process))
    for r in reps:
        assert not r["optimized"] and r["equal"]
        assert f"stage {stage!r}" in r["fallback_reason"]
        assert sum("running the original step" in w for w in r["warnings"]) == 1


def test_a_rewrite_xla_cannot_schedule_is_dropped_and_the_order_still_planned():
    from concerto_jax.report import PassRecord

    text = "HloModule m, is_scheduled=true\n\nENTRY %main {\n  ROOT %p = f32[] parameter(0)\n}\n"

    class Rewrote:
        text = "HloModule m\n\nENTRY %main {\n  ROOT %p = f32[] parameter(0)\n}\n"
        passes = (PassRecord("fuse_collectives", True, 0.0, {}),)

    import concerto_jax.pipeline as pipeline

    def run(post, options, inputs):
        return Rewrote()

    def xla_fails(t):
        raise RuntimeError("XLA refused it")

    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "run", run)
    mp.setattr("concerto_jax.executor.check_signature", lambda a, b: None)
    try:
        plan = route.plan_on_scheduled(text, text, concerto_jax.Options(passes=("fuse_collectives",)),
                                              xla_fails)
    finally:
        mp.undo()
    assert plan.handed == text and not plan.replicated
    assert not plan.passes[0].changed and "XLA refused it" in plan.passes[0].stats["dropped"]
