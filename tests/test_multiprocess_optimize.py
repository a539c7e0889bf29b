"""optimize under jax.distributed (2 local processes x 4 CPU devices, gloo): one plan for all."""

import json

import pytest

from concerto_jax.launch import run_local

pytestmark = pytest.mark.multiprocess


def _reports(*args):
    results = run_local("tests.workers.mp_optimize", args, num_processes=2, timeout_s=300)
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


def test_leader_plan_reaches_every_process():
    reps = _reports()
    assert [r["process"] for r in reps] == [0, 1]
    for r in reps:
        assert r["optimized"], r["fallback_reason"]
        assert r["equal"], "optimised step must equal the original on every process"
        assert r["stats"]["tasks"] > 0
    assert reps[0]["plan_digest"] == reps[1]["plan_digest"], "processes ran different plans"


def test_failure_on_the_leader_makes_every_process_fall_back():
    reps = _reports("--break-on", "0")
    for r in reps:
        assert not r["optimized"]
        assert "synthetic failure" in r["fallback_reason"]
        assert r["equal"]
        assert any("running the original step" in w for w in r["warnings"])


def test_failure_on_a_follower_is_ignored_because_only_the_leader_plans():
    reps = _reports("--break-on", "1")
    for r in reps:
        assert r["optimized"], r["fallback_reason"]
        assert r["equal"]
