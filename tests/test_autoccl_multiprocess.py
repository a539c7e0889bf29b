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
    # the descent ran over the grid and what it chose is what ran: the start's 16 all-reduces
    # at bucket 0, fewer at a larger bucket. Whether merging pays is a timing outcome (99 -> 7
    # ms alone on one machine; 62.9 ms vs 59.5 ms and bucket 0 kept on another, unloaded, in
    # an earlier measurement), so it is measured in the bench (`python -m bench.autoccl_bench --suite cpu`), not
    # asserted here; the descent's choices on seeded noisy surfaces are in test_autoccl.py.
    assert 1 <= tun["evaluations"] <= tun["grid_size"]
    if tun["chosen_bucket_bytes"] == 0:
        assert tun["all_reduces"] == r["untuned"]["all_reduces"]
    else:
        assert tun["all_reduces"] < r["untuned"]["all_reduces"]
    # every process ran the leader's decision
    assert all(p["tuned_config"] == r["tuned_config"] for p in r["per_process"])
    assert r["max_abs_diff"] <= 1e-6
