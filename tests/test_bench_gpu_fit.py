"""The GPU results' tools: ``python -m bench.gpu.fit_calibration`` (the per-class fit recovers
known rates; matrix work groups first; the classes in tests/test_calibration.py) and
``python -m bench.gpu.trace`` (the measured profiles as one Perfetto trace)."""

import pytest

from bench.gpu import fit_calibration as fit


def _row(group, mm, mem, measured, case="a"):
    return {"case": case, "group": group, "mm_peak_us": mm, "vector_us": 0.0, "mem_peak_us": mem,
            "measured_us": measured, "launches": 1, "executions": 1, "model_kernels": 1, "predicted_us": measured}


@pytest.mark.parametrize("group, eff, fixed", [("loop_fusion", 0.6, 1.5), ("matmul", 0.8, 0.5)])
def test_fit_recovers_the_rates_that_made_the_times(group, eff, fixed):
    rows = []
    for k in range(1, 25):
        r = _row(group, 10.0 * k if group == "matmul" else 0.0, 3.0 * k, 0.0)
        r["measured_us"] = fit.model_us(r, eff, fixed)
        rows.append(r)
    got_eff, got_fixed = fit.fit_group(rows)
    assert got_eff == pytest.approx(eff, abs=0.011) and got_fixed == pytest.approx(fixed, abs=0.11)
    total, median = fit.errors(rows, lambda r: fit.model_us(r, got_eff, got_fixed))
    assert abs(total) < 0.02 and median < 0.02


def test_kernels_with_matrix_work_are_matmuls_whatever_their_class():
    assert fit.kernel_group({"mm_peak_us": "0.6", "class": "custom_fusion", "instruction": "f"}) == "matmul"
    assert fit.kernel_group({"mm_peak_us": "", "class": "copy", "instruction": "copy.1"}) == "other"


def test_measured_profiles_become_one_perfetto_trace(tmp_path):
    import json
    import os

    from bench.gpu import trace

    archive = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "gpu",
                           "h200-2026-11-27-run2", "profile.tar.gz")
    out = tmp_path / "t.json"
    assert trace.convert(archive, str(out)) > 1000
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"gpt_dp2_tp8_2hosts.stock", "gpt_dp2_tp8_2hosts.ours"} <= names
    kernels = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in kernels) == 0 and all(e["dur"] >= 0 for e in kernels)


def test_nccl_probe_tables_are_what_the_plugin_accepts_and_rejects(tmp_path):
    """The probe's two tables through the real plugin (the dlopen harness): the valid one
    answers, the one changed after its checksum is refused and NCCL's defaults stay."""
    import os
    import subprocess

    from bench.gpu import nccl_tuner_probe as probe
    from concerto_jax.autoccl import plugin

    lib, harness = plugin.build(tmp_path), plugin.build_harness(tmp_path)
    for corrupt, want in ((False, "algo=ring proto=simple channels=3"),
                          (True, "algo=default proto=default channels=-1")):
        table = tmp_path / f"t{int(corrupt)}.txt"
        probe.write(str(table), probe.table_text(3, corrupt=corrupt))
        env = dict(os.environ, **{plugin.TABLE_ENV: str(table)})
        proc = subprocess.run([harness, lib, "v4", "1", "allreduce", "4096"], capture_output=True,
                              text=True, timeout=30, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1].endswith(want), proc.stdout
        assert ("checksum mismatch" in proc.stderr) == corrupt


def test_nccl_probe_summary_of_the_h200_run():
    """The summary of the NCCL log the H200 run brought back (bench/results/gpu/h200-2026-11-28)."""
    import json
    import os

    from bench.gpu import nccl_tuner_probe as probe

    run = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "gpu", "h200-2026-11-28", "nccl")
    with open(os.path.join(run, "nccl.log")) as f:
        log = f.read()
    with open(os.path.join(run, "summary.json")) as f:
        saved = json.load(f)
    s = probe.summarize("", [{"event": "start", "nccl_version": 22809, "devices": 1}], log)
    assert s["init_calls"] == saved["init_calls"] == 4
    assert s["get_coll_info_calls"] == saved["get_coll_info_calls"] == 0
    assert any("Using concerto_jax (v4)" in ln for ln in s["plugin_lines"])
    assert len(s["warnings"]) == 2 and "checksum mismatch" in s["warnings"][0]
    s["child_rc"], s["collectives_run"] = 0, 36
    assert "one-rank path" in probe.markdown(s)


def test_kernel_times_count_an_instructions_executions_apart_from_its_kernels(tmp_path):
    """On a profile an H200 measured (committed): cuBLAS GEMMs launch a memset beside the GEMM,
    two kernels for one execution; no instruction of these loop-free modules runs twice."""
    import glob
    import os
    import tarfile

    from concerto_jax.gpu_check import check

    archive = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "gpu",
                           "h200-2026-11-27-run2", "profile.tar.gz")
    with tarfile.open(archive) as t:
        t.extractall(tmp_path, filter="data")
    pb = sorted(glob.glob(str(tmp_path / "**" / "evoformer_dap8.stock" / "**" / "*.xplane.pb"), recursive=True))[0]
    times = check.kernel_times(os.path.dirname(pb), runs=3)
    assert len(times) > 100 and {executions for _, _, executions in times.values()} == {1}
    two = [name for name, (_, launches, _) in times.items() if launches == 2]
    assert two and all(name.startswith("custom-call") for name in two)
