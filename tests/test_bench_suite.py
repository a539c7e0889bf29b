"""bench.suite helpers: case selection and the error-tolerant per-case loop."""

import pytest

from bench import suite


def test_select_cases():
    assert [c.name for c in suite.select_cases(None, quick=True)] == list(suite.QUICK)
    assert len(suite.select_cases(None, quick=False)) == len(suite.SUITE)
    name = suite.SUITE[-1].name
    assert [c.name for c in suite.select_cases([name])] == [name]
    with pytest.raises(ValueError, match="unknown case"):
        suite.select_cases(["no_such_case"])


def test_run_each_keeps_going_and_traces_the_first_success():
    cases = suite.SUITE[:3]
    traced, done = [], []

    def run_case(case, export_trace):
        if case is cases[0]:
            raise RuntimeError("compile failed\nmore lines")
        if export_trace:
            traced.append(case.name)
        return {"case": case.name, "status": "ok", "x": 1}

    rows = suite.run_each(cases, run_case, ("case", "status", "x", "cluster", "mesh"), None,
                          lambda k, case, row: done.append(k))
    assert rows[0]["status"] == "error: RuntimeError: compile failed" and rows[0]["x"] == ""
    assert [r["status"] for r in rows[1:]] == ["ok", "ok"]
    assert traced == [cases[1].name], "the trace goes to the first case that succeeds, once"
    assert done == [1, 2, 3]


def test_only_synchronous_collectives():
    """The decompose bench forces stock XLA's latency hiding scheduler on only where stock's final
    module has collectives and none of them asynchronous (jax >= 0.11 on the A100 targets)."""
    from bench.decompose_bench import only_synchronous_collectives

    sync = "ENTRY e {\n  p = f32[8] parameter(0)\n  ROOT ar = f32[8] all-reduce(p), to_apply=add\n}\n"
    asyn = ("ENTRY e {\n  p = f32[8] parameter(0)\n  s = f32[8] all-reduce-start(p), to_apply=add\n"
            "  ROOT d = f32[8] all-reduce-done(s)\n}\n")
    mixed = sync.replace("ROOT ar", "ar").replace("}\n", "  g = f32[64] all-gather-start(p)\n}\n")
    wrapped = sync.replace("}\n", "  a = ((f32[8]), f32[8]) async-start(p), calls=c\n}\n")
    none = "ENTRY e {\n  ROOT p = f32[8] parameter(0)\n}\n"
    assert only_synchronous_collectives(sync)
    assert not only_synchronous_collectives(asyn)
    assert not only_synchronous_collectives(mixed)
    assert not only_synchronous_collectives(wrapped)
    assert not only_synchronous_collectives(none)
