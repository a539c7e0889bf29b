"""bench.scanned's judge: hierarchical simulation with runs per step, overlap kept, order survival (no compile)."""

import pytest

from bench.scanned import computation_orders, order_survival
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.judge import Judged, judge_module, overlap_kept

_TEXT = """HloModule loops, num_partitions=1

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %bound = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %bound), direction=LT
}

%body (bp: (s32[], f32[8])) -> (s32[], f32[8]) {
  %bp = (s32[], f32[8]) parameter(0)
  %bi = s32[] get-tuple-element(%bp), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%bi, %one)
  %bx = f32[8] get-tuple-element(%bp), index=1
  %ar = f32[8] all-reduce(%bx), replica_groups={}, to_apply=%add
  %y = f32[8] multiply(%ar, %ar)
  ROOT %t = (s32[], f32[8]) tuple(%next, %y)
}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %x)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""

_BP = "  %bp = (s32[], f32[8]) parameter(0)\n"
_BX = "  %bx = f32[8] get-tuple-element(%bp), index=1\n"


def _moved(text: str) -> str:
    """The body with %bx listed right after its parameter (a valid reorder)."""
    return text.replace(_BX, "").replace(_BP, _BP + _BX)


def test_judge_counts_runs_and_costs_the_loop_by_trips():
    j = judge_module(_TEXT, CostModel(get_cluster("h100_sxm_8")))
    assert j.runs == {"main": 1, "body": 5, "cond": 6}
    assert j.computations == 3 and j.collectives == 1 and j.collectives_in_loops == 1
    (loop,) = j.loops
    assert loop["body"] == "body" and loop["trips"] == 5
    assert j.us >= 5 * loop["us"] - 1e-6 and j.bound_us <= j.us + 1e-6


def test_judge_sums_compute_and_communication_by_runs():
    """compute_us / comm_us: every computation's own kernels and transfers, times its runs per
    step (the while itself is not a kernel): 5 all-reduces, 5 multiplies and adds, 6 compares."""
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from hlo_passes.ir.parser import parse_module

    text = _TEXT.replace("num_partitions=1", "num_partitions=8").replace(
        "replica_groups={}", "replica_groups={{0,1,2,3,4,5,6,7}}")
    cm = CostModel(get_cluster("h100_sxm_8"))
    j = judge_module(text, cm)
    module = parse_module(text)
    own = {}
    for comp in module.computations:
        if comp.name in j.runs:
            tasks = build_taskgraph(module, cm, computation=comp, nested_us={"w": 0.0}).graph.tasks
            own[comp.name] = (sum(t.duration_us for t in tasks if not t.is_collective and t.opcode != "while"),
                              sum(t.duration_us for t in tasks if t.is_collective))
    assert own["body"][1] > 0 and own["main"][1] == 0 and own["body"][0] > 0
    assert j.comm_us == pytest.approx(5 * own["body"][1])
    assert j.compute_us == pytest.approx(own["main"][0] + 5 * own["body"][0] + 6 * own["cond"][0])
    assert j.compute_us + j.comm_us >= j.bound_us - 1e-6  # nothing overlaps in the sum


def test_computation_orders_reads_every_computation():
    orders = computation_orders(_moved(_TEXT))
    assert orders["body"] == ["bp", "bx", "bi", "one", "next", "ar", "y", "t"]
    assert set(orders) == {"add", "cond", "body", "main"} and orders["main"] == ["x", "zero", "init", "w"]


def test_order_survival_tells_kept_from_lost_orders():
    planned = _moved(_TEXT)
    kept = order_survival(_TEXT, planned, planned)
    assert kept.changed == ("body",) and kept.survived == ("body",)
    assert kept.detail["body"]["distinguishable"] and kept.moved == 0
    lost = order_survival(_TEXT, planned, _TEXT)  # the final module went back to XLA's order
    assert lost.changed == ("body",) and lost.survived == ()
    assert lost.moved == 1 and lost.detail["body"]["moved_names"] == ["bx"]
    # An instruction only the final module has (e.g. a copy XLA's backend adds) does not count.
    extra = planned.replace("  %y = f32[8]", "  %cp9 = f32[8] copy(%ar)\n  %y = f32[8]")
    assert order_survival(_TEXT, planned, extra).survived == ("body",)
    assert order_survival(_TEXT, _TEXT, _TEXT).changed == ()


def test_overlap_kept_weights_computations_by_runs():
    def judged(overlap):
        return Judged(0.0, 0.0, 2, [], 0, 0, overlap, {"main": 1, "body": 4})

    planned = judged({"main": {"a": 10.0}, "body": {"b": 5.0}})
    final = judged({"main": {"a": 10.0}, "body": {"b": 0.0}})
    share, total = overlap_kept(planned, final)
    assert total == pytest.approx(10.0 + 4 * 5.0)
    assert share == pytest.approx(10.0 / 30.0)
    # Overlap the final module adds beyond the plan does not make up for lost overlap.
    more = judged({"main": {"a": 50.0}, "body": {"b": 0.0}})
    assert overlap_kept(planned, more)[0] == pytest.approx(10.0 / 30.0)
