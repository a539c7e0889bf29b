"""Simulator on hand-computable schedules: two computes and one all-reduce, and friends."""

import json

import pytest

from concerto_jax.simulator import (
    SimOptions,
    lower_bounds,
    simulate,
    simulate_synchronous,
    write_chrome_trace,
)
from concerto_jax.taskgraph import (
    CollectiveInfo,
    Event,
    Phase,
    Task,
    TaskGraph,
    TaskGraphError,
    TaskKind,
)

NO_SLOW = SimOptions(overlap_slowdown=1.0)


def _c(name, us, out=0):
    return Task(name, TaskKind.COMPUTE, us, out_bytes=out, opcode="fusion")


def _ar(name, us, stream=1, out=0):
    return Task(name, TaskKind.COLLECTIVE, us, stream=stream, out_bytes=out, opcode="all-reduce",
                collective=CollectiveInfo("all-reduce", 4, 8))


@pytest.fixture
def g3():
    # a(10) -> ar(30);  b(20) independent;  c(5) needs ar and b.
    return TaskGraph([_c("a", 10), _ar("ar", 30), _c("b", 20), _c("c", 5)], [[], [0], [], [1, 2]])


def ev(i, p):
    return Event(i, {"r": Phase.RUN, "s": Phase.START, "d": Phase.DONE}[p])


def test_overlapped_schedule(g3):
    events = [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")]
    r = simulate(g3, events, NO_SLOW)
    # a 0-10, ar 10-40, b 10-30, wait to 40, c 40-45.
    assert r.timing("ar").start_us == 10 and r.timing("ar").end_us == 40
    assert r.timing("c").start_us == 40
    assert r.step_time_us == pytest.approx(45)
    assert r.comm_busy_us == pytest.approx(30)
    assert r.exposed_comm_us == pytest.approx(10)
    assert r.overlap_pct == pytest.approx(100 * 20 / 30)
    assert r.stream_utilisation[0] == pytest.approx(35 / 45)
    assert r.stream_utilisation[1] == pytest.approx(30 / 45)


def test_synchronous_program_order(g3):
    r = simulate_synchronous(g3, [0, 1, 2, 3], NO_SLOW)
    assert r.step_time_us == pytest.approx(10 + 30 + 20 + 5)
    assert r.exposed_comm_us == pytest.approx(30)
    assert r.overlap_pct == pytest.approx(0)


def test_overlap_slowdown_stretches_compute(g3):
    events = [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")]
    r = simulate(g3, events, SimOptions(overlap_slowdown=1.5))
    # b runs 10..40 entirely inside ar (10..40): 20 * 1.5 = 30.
    assert r.timing("b").end_us == pytest.approx(40)
    assert r.step_time_us == pytest.approx(45)
    assert r.overlap_slowdown == 1.5


def test_partial_overlap_slowdown():
    # ar 0-10 on comm; compute x (20 units) starts at 0: 10 units of time cover 10/2 = 5 work, then 15 -> ends 25.
    g = TaskGraph([_ar("ar", 10), _c("x", 20)], [[], []])
    r = simulate(g, [ev(0, "s"), ev(1, "r"), ev(0, "d")], SimOptions(overlap_slowdown=2.0))
    assert r.timing("x").end_us == pytest.approx(25)


def test_start_waits_for_compute_stream_position():
    # START after a long compute in program order: the collective cannot launch before it.
    g = TaskGraph([_c("long", 50), _ar("ar", 10)], [[], []])
    r = simulate(g, [ev(0, "r"), ev(1, "s"), ev(1, "d")], NO_SLOW)
    assert r.timing("ar").start_us == pytest.approx(50)
    assert r.step_time_us == pytest.approx(60)


def test_one_comm_stream_is_fifo_two_streams_are_not():
    tasks = [_c("a", 1), _ar("x", 10), _ar("y", 10)]
    g1 = TaskGraph(tasks, [[], [0], [0]])
    sched = [ev(0, "r"), ev(1, "s"), ev(2, "s"), ev(1, "d"), ev(2, "d")]
    assert simulate(g1, sched, NO_SLOW).step_time_us == pytest.approx(21)
    g2 = TaskGraph([tasks[0], tasks[1], _ar("y", 10, stream=2)], [[], [0], [0]])
    assert simulate(g2, sched, NO_SLOW).step_time_us == pytest.approx(11)


def test_lower_bounds(g3):
    lb = lower_bounds(g3)
    assert lb.total_compute_us == 35 and lb.total_comm_us == 30
    assert lb.critical_path_us == pytest.approx(10 + 30 + 5)
    assert lb.bound_us == pytest.approx(45)


def test_peak_memory():
    # a(out 100) -> b(out 10) -> c ; a freed when b ends.
    g = TaskGraph([_c("a", 1, 100), _c("b", 1, 10), _c("c", 1, 1)], [[], [0], [1]])
    r = simulate_synchronous(g, None, NO_SLOW)
    assert r.peak_memory_bytes == 110


def test_invalid_schedule_raises(g3):
    with pytest.raises(TaskGraphError):
        simulate(g3, [ev(3, "r"), ev(0, "r"), ev(1, "s"), ev(1, "d"), ev(2, "r")])


def test_chrome_trace(tmp_path, g3):
    r = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")], NO_SLOW)
    path = write_chrome_trace(tmp_path / "t.json", r, g3)
    data = json.load(open(path))
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1}
    assert {e["name"] for e in slices} == {"a", "ar", "b", "c"}


def test_gantt(tmp_path, g3):
    pytest.importorskip("matplotlib")
    from concerto_jax.simulator import write_gantt

    r = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")], NO_SLOW)
    p = write_gantt(tmp_path / "g.png", r, g3, title="g3")
    assert (tmp_path / "g.png").stat().st_size > 1000 and p.endswith("g.png")


def test_exposed_intervals_and_comparison(tmp_path, g3):
    from concerto_jax.simulator import (
        chrome_trace_comparison,
        exposed_intervals,
        write_chrome_trace_comparison,
    )

    overlapped = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")], NO_SLOW)
    serial = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(1, "d"), ev(2, "r"), ev(3, "r")], NO_SLOW)
    # ar runs 10..40: b hides 10..30 of it in the first order, nothing in the second.
    assert exposed_intervals(overlapped) == [(30.0, 40.0)] and overlapped.exposed_comm_us == 10.0
    assert exposed_intervals(serial) == [(10.0, 40.0)] and serial.exposed_comm_us == 30.0
    runs = [("serial", serial, g3), ("overlapped", overlapped, g3)]
    trace = chrome_trace_comparison(runs, metadata={"case": "g3"})
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in slices} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert trace["otherData"]["case"] == "g3"
    assert trace["otherData"]["overlapped"]["exposed_comm_us"] == 10.0
    path = write_chrome_trace_comparison(tmp_path / "c.json", runs)
    assert json.load(open(path))["traceEvents"] == chrome_trace_comparison(runs)["traceEvents"]


def test_gantt_comparison(tmp_path, g3):
    pytest.importorskip("matplotlib")
    from concerto_jax.simulator import write_gantt_comparison

    overlapped = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(2, "r"), ev(1, "d"), ev(3, "r")], NO_SLOW)
    serial = simulate(g3, [ev(0, "r"), ev(1, "s"), ev(1, "d"), ev(2, "r"), ev(3, "r")], NO_SLOW)
    p = write_gantt_comparison(tmp_path / "g.png", [("serial", serial, g3), ("overlapped", overlapped, None)],
                               title="g3")
    assert (tmp_path / "g.png").stat().st_size > 1000 and p.endswith("g.png")
