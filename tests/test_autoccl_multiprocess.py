"""AutoCCL on a real 2-process x 4-device CPU data-parallel step (gloo): bucket size tuned online."""

import pytest

from concerto_jax.autoccl.dp_job import launch

pytestmark = pytest.mark.multiprocess


def test_online_bucket_tuning_two_processes(tmp_path):
    r = launch(
        str(tmp_path / "report.json"),
        num_processes=2,
        devices_per_process=4,
        num_grads=16,  # 16 all-reduces untuned; half the compile and step time of 32 (61 s vs 125 s, loaded)
        timeout_s=240,
        extra_args=("--repeats", "2", "--sweep-repeats", "2"),
    )
    tun = r["tuning"]
    print(
        f"untuned {r['untuned']['median_s'] * 1e3:.1f} ms ({r['untuned']['all_reduces']} all-reduces); "
        f"tuned bucket {tun['chosen_bucket_bytes']} B -> {tun['chosen_time_s'] * 1e3:.1f} ms "
        f"({tun['all_reduces']} all-reduces) vs start {tun['start_time_s'] * 1e3:.1f} ms; "
        f"{tun['evaluations']} evaluations of {tun['grid_size']}, {tun['steps']} steps"
    )
    assert r["untuned"]["all_reduces"] == 16  # one per gradient, combiner disabled
    assert tun["start_bucket_bytes"] == 0
    # the tuner never ends slower than its start (its own measurements, small noise margin)
    assert tun["chosen_time_s"] <= tun["start_time_s"] * 1.05
    # what the tuning is for: merged all-reduces and a clearly faster step (measured 99 -> 7 ms
    # alone on the machine; 72.9 -> 53.9 ms, a ratio of 0.74, while other pytest processes
    # shared its 2 cores, so the bound is 0.8, not 0.5: gloo's per-all-reduce cost shrinks
    # next to the scheduling noise of a loaded machine).
    # How few configs the descent needs is asserted on seeded noisy surfaces in test_autoccl.py;
    # here, on a loaded CI machine, the plateau of large buckets (all one all-reduce) is flat
    # within the noise and the descent may visit all 14 grid points (seen once: 14 of 14).
    assert tun["all_reduces"] < r["untuned"]["all_reduces"]
    assert tun["chosen_time_s"] <= 0.8 * tun["start_time_s"]
    # every process ran the leader's decision
    assert all(p["tuned_config"] == r["tuned_config"] for p in r["per_process"])
    assert r["max_abs_diff"] <= 1e-6
