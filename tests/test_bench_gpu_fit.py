"""``python -m bench.gpu.fit_calibration``: the per-class fit recovers known rates, and the
per-kernel grouping puts matrix work first."""

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
