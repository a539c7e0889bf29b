"""``python -m concerto_jax.gpu_check``: its CPU half end to end, and the pieces of its GPU half
that run without a GPU (collective stand-ins, the perturbed order, the stand-in's header step,
the item-a checks rehearsed on CPU devices, the kernel-class table)."""

import csv
import functools
import types

import jax
import pytest

from concerto_jax.deviceless import gpu_plugin_available
from concerto_jax.gpu_check import check as gpu_check
from concerto_jax.gpu_route import route

needs_plugin = pytest.mark.skipif(not gpu_plugin_available(),
                                  reason="CUDA PJRT plugin missing: pip install -e .[gpu]")
H100 = types.SimpleNamespace(id=0, device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                             core_count=132, process_index=0)


@functools.cache
def _scheduled():
    from tests.test_pjrt_c import _after_lhs

    return _after_lhs().after_lhs_text


def _collectives(text):
    import hlo_passes

    return [i.name for c in hlo_passes.parse_module(text).computations for i in c.instructions
            if i.collective_kind is not None]


@needs_plugin
def test_standin_collectives_compiles_for_one_gpu_without_communication():
    src = _scheduled()
    assert _collectives(src), "the test module must have a collective"
    stood, counts = gpu_check.standin_collectives(src)
    assert sum(counts.values()) >= 1 and not _collectives(stood)
    assert "num_partitions" not in stood.split("\n", 1)[0]
    target = route.device_target([H100])
    for env in ({"xla_gpu_enable_command_buffer": ""}, {}):  # calibration's options, then XLA's
        p = route.compile_payload(stood, target, 1, replicated=False, env=env)
        assert not _collectives(p.final_text) and p.num_devices == 1 and p.compute_capability == "9.0"
    layout = route.jax_compat.entry_layout_of_text(p.final_text)
    params, results = gpu_check._split_layout(layout)
    assert len(params) == 4 and len(results) == 2


@needs_plugin
def test_perturbed_order_is_legal_and_kept_by_the_backend():
    from concerto_jax.costmodel import get_cluster

    src = _scheduled()
    other = gpu_check.perturbed_order(src)
    assert route.entry_order(other) != route.entry_order(src)
    assert sorted(route.entry_order(other)) == sorted(route.entry_order(src))
    p = route.compile_payload(other, get_cluster("h100_sxm_8"), 8, replicated=False)
    kept = route.order_kept(other, p.final_text)
    assert kept["common"] > 0 and kept["in_our_order"] >= kept["common"] - 2, kept  # async->sync pairs


def test_dummy_step_has_the_layout_it_stands_for():
    from concerto_jax import jax_compat

    f = jax.jit(lambda a, b, c: (a * 2, (b + 1).astype("float32").sum() + c.sum()))
    args = (jax.numpy.ones((4, 8)), jax.numpy.ones((3,), "int32"), jax.numpy.ones((2, 2), "bfloat16"))
    layout = jax_compat.entry_layout(jax_compat.xla_executable(f.lower(*args).compile()))
    dummy, make_inputs = gpu_check._dummy_step(layout, jax.devices()[0])
    assert jax_compat.entry_layout(jax_compat.xla_executable(dummy)) == layout
    assert [x.shape for x in make_inputs()] == [(4, 8), (3,), (2, 2)]


def test_class_errors_sum_per_program_and_class():
    rows = [{"program": "stock", "class": "gemm", "predicted_us": 10.0, "measured_us": 8.0, "launches": 1},
            {"program": "stock", "class": "gemm", "predicted_us": 5.0, "measured_us": 12.0, "launches": 1},
            {"program": "ours", "class": "loop_fusion", "predicted_us": 2.0, "measured_us": 2.0, "launches": 2,
             "executions": 2},
            # a GEMM and the memset cuBLAS launches beside it: one execution, priced once
            {"program": "ours", "class": "gemm", "predicted_us": 7.0, "measured_us": 6.0, "launches": 2,
             "executions": 1},
            {"program": "ours", "class": "unmapped", "predicted_us": float("nan"), "measured_us": 3.0, "launches": 1}]
    got = {(r["program"], r["class"]): r for r in gpu_check.class_errors(rows)}
    assert set(got) == {("stock", "gemm"), ("ours", "loop_fusion"), ("ours", "gemm")}
    assert got[("stock", "gemm")]["error"] == round((15 - 20) / 20, 3)
    assert got[("ours", "loop_fusion")]["predicted_us"] == 4.0
    assert got[("ours", "gemm")]["predicted_us"] == 7.0


@pytest.mark.slow
def test_item_a_rehearsed_on_cpu_devices():
    steps, seen = gpu_check.gpt_steps(jax.devices()[:8])
    with route.rehearse():
        for name in ("gpt_f32_callback", "gpt_f32_donated"):
            step, case = steps[name]
            detail = gpu_check.route_check(name, step, case, ("schedule",),
                                           seen if name.endswith("callback") else None,
                                           backend="cpu-rehearsal")
            assert detail.startswith("3 steps bitwise")


def test_cpu_half_writes_its_table_and_exits_zero(tmp_path):
    rc = gpu_check.main(["--out", str(tmp_path), "--cases", "", "--log-level", "WARNING"])
    rows = list(csv.DictReader(open(tmp_path / "checks.csv")))
    status = {r["check"]: r["status"] for r in rows}
    assert rc == 0, rows
    for name in ("rehearsal/steps", "rehearsal/callbacks", "rehearsal/device_order", "negative/cpu"):
        assert status[name] == "pass", rows
    for item in "abc":
        assert status[f"{item}/gpu"].startswith("skipped: ")
    assert "passed, 0 failed" in (tmp_path / "checks.md").read_text()


def test_a_failed_check_makes_the_exit_status_non_zero(tmp_path, monkeypatch):
    def broken(run):
        run.check("rehearsal/steps", lambda: 1 / 0)
    monkeypatch.setattr(gpu_check, "rehearsal_checks", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--cases", "", "--log-level", "ERROR"]) == 1
    assert "FAIL" in (tmp_path / "checks.md").read_text()


def test_kernels_map_to_instructions_by_hlo_op_or_kernel_name():
    names = {"loop_add_fusion.3": 1.0, "all-gather-done": 2.0}
    assert gpu_check.instruction_of("loop_add_fusion.3", names) == "loop_add_fusion.3"
    assert gpu_check.instruction_of("loop_add_fusion_3", names) == "loop_add_fusion.3"
    assert gpu_check.instruction_of("sm90_xmma_gemm_bf16", names) == "sm90_xmma_gemm_bf16"


def test_standin_header_loses_aliasing_and_partitions_only():
    header = ("HloModule m, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, "
              "may-alias) }, buffer_donor={ (2, {}) }, entry_computation_layout={(f32[4]{0})->f32[4]{0}}, "
              "num_partitions=8")
    body = ("\n\nENTRY %main (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0), sharding={devices=[8]<=[8]}\n"
            "  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add\n}\n")
    add = ("\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
           "  ROOT %s = f32[] add(%a, %b)\n}\n")
    text, counts = gpu_check.standin_collectives(header + add + body)
    first = text.split("\n", 1)[0]
    assert first == "HloModule m, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}"
    assert counts == {"all-reduce": 1} and "sharding=" not in text and "all-reduce(" not in text
    assert "ROOT %ar = f32[4]{0} copy(%p)" in text  # the operand (a parameter: copied)
    route.jax_compat.hlo_module_from_text(text)  # XLA's parser accepts it


def test_runtime_probes_report_an_abort_instead_of_ending_the_run():
    ok = gpu_check.probe_subprocess("print('RUNTIME raised for x: ValueError')", timeout_s=60)
    assert ok == "RUNTIME raised for x: ValueError"
    aborted = gpu_check.probe_subprocess("import os; print('RUNTIME about to', flush=True); os.abort()",
                                         timeout_s=60)
    assert "the runtime ended the process (exit -6" in aborted
    with pytest.raises(AssertionError, match="SETUP FAILED no GPU"):
        gpu_check.probe_subprocess("print('SETUP FAILED no GPU')", timeout_s=60)


def test_standin_of_a_long_tuple_result_with_index_marks():
    shapes = ", ".join(f"f32[{k + 1}]{{0}}" for k in range(5)) + ", /*index=5*/bf16[2,3]{1,0}"
    assert gpu_check._split_tuple(f"({shapes})")[-1] == "bf16[2,3]{1,0}"
    lines = gpu_check._standin_lines("ag", f"({shapes})", "  ", root=False)
    assert lines[-1].startswith("  %ag = (") and "tuple(%ag.e0, %ag.e1" in lines[-1]
    assert "  %ag.e5 = bf16[2,3]{1,0} broadcast(%ag.e5.zero), dimensions={}" in lines


def test_perturbed_order_keeps_producers_of_implicit_tuple_elements_first():
    # XLA's newer text names a tuple element ``%x#k`` with no line of its own: its user must still
    # come after ``%x`` (the hardware check's first run met an order XLA's parser refused)
    text = """HloModule m, entry_computation_layout={(f32[4]{0})->(f32[4]{0}, f32[4]{0}, f32[4]{0})}

%pair (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %n = f32[4]{0} negate(%p)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%p, %n)
}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %a = f32[4]{0} exponential(%x)
  %f = (f32[4]{0}, f32[4]{0}) call(%x), to_apply=%pair
  %u = f32[4]{0} sine(%f#1)
  ROOT %r = (f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%a, %u, %f#0)
}
"""
    from concerto_jax.executor import parse_with_xla
    from hlo_passes.ir import parse_module

    other = gpu_check.perturbed_order(text)
    order = [i.name for i in parse_module(other).entry.instructions]
    assert order.index("f") < order.index("u")
    parse_with_xla(other)


def test_runtime_probe_setup_names_what_it_uses():
    # the probes run in a fresh interpreter: their setup must import what it names; on a CPU the
    # route fails later, at its plan (no scheduled module), and the setup says so
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", gpu_check._PROBE_SETUP], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "NameError" not in r.stdout + r.stderr, r.stdout[-500:]
    assert "SETUP FAILED GpuRouteError" in r.stdout, r.stdout[-500:]


def test_step_time_verdict_fails_a_slow_route():
    assert "1.010x" in gpu_check.step_time_verdict({"gpt_f32": 1.01, "gpt_bf16": 0.99})
    with pytest.raises(AssertionError, match="gpt_f32 1.146x"):
        gpu_check.step_time_verdict({"gpt_f32": 1.146, "gpt_bf16": 1.0})


def test_step_with_xla_defaults_leaves_its_column_empty_when_it_cannot_run():
    assert gpu_check._step_us_with_xla_defaults("HloModule broken", H100, None, None, 3) is None
