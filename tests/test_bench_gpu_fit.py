"""The GPU results' tools: ``python -m bench.gpu.fit_calibration`` (the per-class fit recovers
known rates; matrix work groups first) and ``python -m bench.gpu.trace`` (the measured profiles
as one Perfetto trace)."""

import pytest

from bench.gpu import fit_calibration as fit


def _row(group, mm, mem, measured, case="a"):
    return {"case": case, "group": group, "mm_peak_us": mm, "vector_us": 0.0, "mem_peak_us": mem,
            "measured_us": measured, "launches": 1, "predicted_us": measured}


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
    assert fit.kernel_group({"mm_peak_us": "0.6", "class": "custom_fusion"}) == "matmul"
    assert fit.kernel_group({"mm_peak_us": "0", "class": "reduction_fusion"}) == "reduction_fusion"
    assert fit.kernel_group({"mm_peak_us": "", "class": "copy"}) == "other"


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
