"""Memory-safe by default: the scheduler's limit is the peak of the order it starts from.

Also: ``ScheduleOptions`` lets the user raise the limit (ratio) or set bytes, the pass
statistics carry both peaks and the limit, and progress lines stay quiet unless logging
is configured.
"""

import logging

import pytest

from concerto_jax.scheduler import ScheduleOptions, peak_memory, schedule
from concerto_jax.scheduler.progress import Progress, StageTimes
from concerto_jax.simulator import timeline
from tests.test_scheduler_memory import prefetch_graph

FAST = dict(full_model_max_tasks=0, odd_even=None)


def _peak(g, events):
    tl = timeline(g, events)
    return peak_memory(g, tl.start, tl.end)


def test_default_limit_is_the_input_orders_peak():
    g = prefetch_graph()
    program = g.synchronous_schedule()
    input_peak = _peak(g, program)
    unlimited = schedule(g, ScheduleOptions(memory_limit_ratio=None, **FAST), initial=program)
    assert unlimited.peak_memory_bytes > input_peak, "the graph must tempt the scheduler to prefetch"
    default = schedule(g, ScheduleOptions(**FAST), initial=program)
    assert default.memory_limit_bytes == default.input_peak_memory_bytes == input_peak
    assert default.peak_memory_bytes <= input_peak
    assert default.makespan_us <= default.input_makespan_us + 1e-9
    # Without an initial order the limit is program order's peak.
    no_initial = schedule(g, ScheduleOptions(**FAST))
    assert no_initial.memory_limit_bytes == input_peak
    assert no_initial.peak_memory_bytes <= input_peak


def test_user_raises_the_limit_or_sets_bytes():
    g = prefetch_graph()
    program = g.synchronous_schedule()
    input_peak = _peak(g, program)
    raised = schedule(g, ScheduleOptions(memory_limit_ratio=2.0, **FAST), initial=program)
    assert raised.memory_limit_bytes == 2 * input_peak
    assert input_peak < raised.peak_memory_bytes <= 2 * input_peak
    set_bytes = schedule(g, ScheduleOptions(memory_limit_bytes=input_peak + 1000, **FAST),
                         initial=program)
    assert set_bytes.memory_limit_bytes == input_peak + 1000
    assert set_bytes.peak_memory_bytes <= input_peak + 1000
    with pytest.raises(ValueError, match="memory_limit_ratio"):
        ScheduleOptions(memory_limit_ratio=0.5)
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        ScheduleOptions(memory_limit_bytes=0)


def test_a_budget_raises_the_limit_never_lowers_it():
    """``memory_budget_bytes`` (compile_for_target: XLA's own scheduler limit on the target):
    limit = max(ratio x input peak, budget); an absolute limit or no modelling win over it."""
    g = prefetch_graph()
    program = g.synchronous_schedule()
    input_peak = _peak(g, program)
    assert ScheduleOptions(memory_budget_bytes=3 * input_peak).memory_limit_for(input_peak) == 3 * input_peak
    assert ScheduleOptions(memory_budget_bytes=input_peak // 2).memory_limit_for(input_peak) == input_peak
    assert ScheduleOptions(memory_budget_bytes=10, memory_limit_bytes=5).memory_limit_for(100) == 5
    assert ScheduleOptions(memory_budget_bytes=10, memory_limit_ratio=None).memory_limit_for(100) is None
    wide = schedule(g, ScheduleOptions(memory_budget_bytes=3 * input_peak, **FAST), initial=program)
    assert wide.memory_limit_bytes == 3 * input_peak
    assert input_peak < wide.peak_memory_bytes <= 3 * input_peak
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        ScheduleOptions(memory_budget_bytes=-1)


def test_a_limit_above_all_bytes_runs_the_searches_without_memory():
    """A limit no order can reach (every output's bytes together fit under it) is vacuous: the
    searches run as with no memory model (same schedule), and the limit is still reported."""
    g = prefetch_graph()
    program = g.synchronous_schedule()
    total = sum(t.out_bytes for t in g.tasks)
    free = schedule(g, ScheduleOptions(memory_limit_ratio=None), initial=program)
    above = schedule(g, ScheduleOptions(memory_limit_bytes=total), initial=program)
    assert above.stats["memory_limit_cannot_bind"] and above.memory_limit_bytes == total
    assert above.events == free.events and above.makespan_us == free.makespan_us
    assert above.peak_memory_bytes <= total
    below = schedule(g, ScheduleOptions(memory_limit_bytes=total - 1), initial=program)
    assert not below.stats["memory_limit_cannot_bind"]


def test_progress_is_quiet_unless_logging_is_on(caplog):
    log = logging.getLogger("concerto_jax.scheduler.test_progress")
    log.setLevel(logging.NOTSET)
    logging.getLogger().setLevel(logging.WARNING)  # library default: nothing configured
    quiet = Progress(log, "work", every_s=0.0)
    assert not quiet.update(best=1.0) and quiet.lines == 0
    with caplog.at_level(logging.INFO, logger=log.name):
        loud = Progress(log, "work", every_s=0.0)
        assert loud.update(best_makespan_us=12.5, block="1/3")
    assert "work: best_makespan_us 12.5, block 1/3 (elapsed" in caplog.text


def test_stage_times_say_each_stage_and_draw_a_bar_only_on_a_terminal(caplog, monkeypatch):
    """compile_for_target's stage times: a line per finished stage with the call's expected
    time once known; a bar on stderr only where it is a terminal and not under CI."""
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    log = logging.getLogger("concerto_jax.deviceless.test_stages")
    monkeypatch.delenv("CI", raising=False)
    tty = Tty()
    with caplog.at_level(logging.INFO, logger=log.name):
        st = StageTimes(log, "compile_for_target(h100_sxm_8)", stream=tty)
        st["lower"] = 0.5
        st.expected_s = 36.0  # compile_for_target: the time budget's, once stock's compile is timed
        st["stock_compile"] = 10.0
        st["combine_thresholds"] = 7.0
        st.close()
    assert dict(st) == {"lower": 0.5, "stock_compile": 10.0, "combine_thresholds": 7.0}
    assert "compile_for_target(h100_sxm_8): lower 0.5 s (elapsed" in caplog.text
    assert "combine_thresholds 7.0 s" in caplog.text and "about 36 s in all" in caplog.text
    drawn = tty.getvalue()
    assert drawn.count("\r[") == 3 and "of ~36 s" in drawn and drawn.endswith("\n")
    # not a terminal, or under CI: no bar
    plain = io.StringIO()
    StageTimes(log, "x", stream=plain)["lower"] = 1.0
    monkeypatch.setenv("CI", "true")
    ci = Tty()
    StageTimes(log, "x", stream=ci)["lower"] = 1.0
    assert plain.getvalue() == "" and ci.getvalue() == ""


def test_the_time_budget_gives_the_calls_expected_seconds():
    """``TimeBudget.total_s``, the stage lines' estimate: "auto" its compiles at stock's compile
    time, a budget in seconds itself, no budget none."""
    from concerto_jax.deviceless.budget import TimeBudget, auto_budget_compiles
    from concerto_jax.options import DevicelessOptions, Options

    auto = Options()
    assert TimeBudget.start(auto, 100.0, 10.0).total_s(100.0) == pytest.approx(10.0 * auto_budget_compiles(auto))
    seconds = Options(deviceless=DevicelessOptions(time_budget_s=90.0))
    assert TimeBudget.start(seconds, 100.0, 10.0).total_s(100.0) == pytest.approx(90.0)
    assert TimeBudget.start(Options(deviceless=DevicelessOptions(time_budget_s=None)), 100.0, 10.0).total_s(100.0) is None


def test_solver_and_odd_even_report_progress(caplog, monkeypatch):
    from concerto_jax.scheduler import (
        OddEvenOptions,
        SolverParams,
        odd_even,
        progress,
        solve_program,
    )

    monkeypatch.setattr(progress, "DEFAULT_EVERY_S", 0.0)  # a line per update
    g = prefetch_graph(layers=12)
    with caplog.at_level(logging.INFO, logger="concerto_jax.scheduler"):
        res = odd_even(g, g.synchronous_schedule(),
                       OddEvenOptions(block_size=4, rounds=2, time_budget_s=None))
        assert res.makespan_us <= res.initial_makespan_us
        assert "odd-even: round 0, block 1/" in caplog.text and "best_makespan_us" in caplog.text
        caplog.clear()
        solve_program(g, SolverParams(time_limit_s=5.0, num_workers=1, progress=True))
        assert "CP-SAT program model (24 tasks): best " in caplog.text and "bound " in caplog.text
        caplog.clear()
        solve_program(g, SolverParams(time_limit_s=5.0, num_workers=1))
        assert "CP-SAT program model" not in caplog.text
