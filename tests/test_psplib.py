"""PSPLIB sample: j30 instances at their optimum, j60 instances within the reference bounds."""

import os

import pytest

from bench.psplib_bench import psplib_root
from concerto_jax.scheduler import (
    RcpspInstance,
    SolverParams,
    check_rcpsp,
    load_optima,
    load_psplib,
    solve_rcpsp,
)

ROOT = psplib_root()  # $PSPLIB_ROOT, else ../shared/psplib next to the repository
pytestmark = pytest.mark.skipif(not os.path.isdir(ROOT), reason="PSPLIB data not available")

J30 = ["j301_1.sm", "j306_1.sm", "j3017_1.sm", "j305_3.sm", "j309_8.sm", "j3014_7.sm",
       "j3025_8.sm", "j3030_10.sm", "j3041_5.sm", "j3043_1.sm"]
J60 = ["j601_1.sm", "j602_3.sm", "j603_5.sm"]
PARAMS = SolverParams(time_limit_s=20.0, num_workers=2, seed=0)


@pytest.mark.parametrize("name", J30)
def test_j30_at_optimum(name):
    ref = load_optima(os.path.join(ROOT, "j30", "optimum", "optimum.csv"))[name]
    inst = load_psplib(os.path.join(ROOT, "j30", name))
    res = solve_rcpsp(inst, PARAMS)
    assert check_rcpsp(inst, res.starts) == res.makespan
    assert res.makespan == ref.hi
    assert res.lower_bound <= res.makespan


@pytest.mark.parametrize("name", J60)
def test_j60_within_reference(name):
    ref = load_optima(os.path.join(ROOT, "j60", "optimum", "optimum.csv"))[name]
    inst = load_psplib(os.path.join(ROOT, "j60", name))
    res = solve_rcpsp(inst, PARAMS)
    assert check_rcpsp(inst, res.starts) == res.makespan
    assert (ref.lo or 0) <= res.makespan <= ref.hi


def test_unary_and_cumulative_resources():
    # Three tasks on a capacity-2 resource (each needs 1) and a unary one used by two.
    inst = RcpspInstance(
        durations=(0, 3, 3, 3, 0),
        demands=((0, 0), (1, 1), (1, 1), (1, 0), (0, 0)),
        capacities=(2, 1),
        successors=((1, 2, 3), (4,), (4,), (4,), ()),
        name="toy",
    )
    res = solve_rcpsp(inst, SolverParams(time_limit_s=5, num_workers=1))
    assert res.status == "OPTIMAL" and res.makespan == 6
    check_rcpsp(inst, res.starts)


def test_hint_and_bad_input():
    inst = RcpspInstance((2, 2), ((1,), (1,)), (1,), ((1,), ()), "chain")
    res = solve_rcpsp(inst, SolverParams(time_limit_s=5, num_workers=1), hint=[0, 2])
    assert res.makespan == 4 and res.optimal
    with pytest.raises(ValueError, match="capacity"):
        RcpspInstance((1,), ((3,),), (2,), ((),))


def test_energy_delays_are_sound():
    from concerto_jax.scheduler.rcpsp import energy_delays

    # 0 -> {1, 2, 3} -> 4 on a unary resource: the three middle tasks (3 each) need
    # 9 time units between the end of 0 and the start of 4; the path gives only 3.
    inst = RcpspInstance((1, 3, 3, 3, 1), ((0,), (1,), (1,), (1,), (0,)), (1,),
                         ((1, 2, 3), (4,), (4,), (4,), ()), "diamond")
    assert (0, 4, 9) in energy_delays(inst)
    res = solve_rcpsp(inst, SolverParams(time_limit_s=5, num_workers=2))
    assert res.makespan == 11 and check_rcpsp(inst, res.starts) == 11
