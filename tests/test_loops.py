"""Loops: trip counts and carried values (hlo_passes.ir.loops), every computation scheduled (schedule pass),
bitwise results for trip counts 1, 2 and odd, one warning for loops the pass cannot cost."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax.capture import capture
from concerto_jax.costmodel import CostModel, get_cluster
from concerto_jax.hlo_taskgraph import build_taskgraph, loops_of
from concerto_jax.options import Options
from concerto_jax.simulator import makespan, timeline
from hlo_passes.ir.loops import analyze_while, schedulable_computations
from hlo_passes.registry import PASSES
from tests._helpers import assert_tree_bitwise

_LOOP = """HloModule loops, num_partitions=1

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%cond (cp: (s32[], f32[8])) -> pred[] {{
  %cp = (s32[], f32[8]) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %bound = s32[] constant({bound})
  ROOT %lt = pred[] compare({lhs}), direction={direction}
}}

%body (bp: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %bp = (s32[], f32[8]) parameter(0)
  %bi = s32[] get-tuple-element(%bp), index=0
  %one = s32[] constant({step})
  %next = s32[] add(%bi, %one)
  %bx = f32[8] get-tuple-element(%bp), index=1
  %ar = f32[8] all-reduce(%bx), replica_groups={{}}, to_apply=%add
  %y = f32[8] multiply(%ar, %ar)
  ROOT %t = (s32[], f32[8]) tuple(%next, %y)
}}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {{
  %x = f32[8] parameter(0)
  %zero = s32[] constant({init})
  %init = (s32[], f32[8]) tuple(%zero, %x)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body{config}
}}
"""


def _loop(bound=5, init=0, step=1, direction="LT", swapped=False, config=""):
    lhs = "%bound, %ci" if swapped else "%ci, %bound"
    text = _LOOP.format(bound=bound, init=init, step=step, direction=direction, lhs=lhs,
                        config=config)
    return hlo_passes.parse_module(text)


@pytest.mark.parametrize(
    ("kwargs", "trips"),
    [
        (dict(bound=5), 5),
        (dict(bound=1), 1),
        (dict(bound=0), 0),
        (dict(bound=7, init=2, step=2), 3),
        (dict(bound=4, direction="LE"), 5),
        (dict(bound=6, direction="NE", step=2), 3),
        (dict(bound=5, direction="GT", swapped=True), 5),  # 5 > i  ==  i < 5
        (dict(bound=99, config=', backend_config={"known_trip_count":{"n":"3"}}'), 3),
    ],
)
def test_trip_count(kwargs, trips):
    module = _loop(**kwargs)
    info = analyze_while(module.entry.root)
    assert info.trip_count == trips, info
    assert info.induction_index == 0
    assert info.source == ("backend_config" if "config" in kwargs else "pattern")
    # Carried: the counter (4 bytes) and the f32[8] (32 bytes); neither is loop-invariant.
    assert [(c.index, c.bytes, c.invariant) for c in info.carried] == [(0, 4, False), (1, 32, False)]
    assert info.carried_bytes == 36


def test_trip_count_unknown_says_why():
    text = _LOOP.format(bound=5, init=0, step=1, direction="LT", lhs="%ci, %bound", config="")
    text = text.replace("%zero = s32[] constant(0)", "%zero = s32[] partition-id()")
    info = analyze_while(hlo_passes.parse_module(text).entry.root)
    assert info.trip_count is None and "initial value" in info.source


def test_schedulable_computations_callees_first():
    module = _loop()
    names = [c.name for c in schedulable_computations(module)]
    assert names == ["cond", "body", "main"], names  # the reducer %add is part of a kernel


def test_memory_budget_is_shared_along_the_nesting():
    """A whole-program budget: the entry plans within half, a loop body within a quarter
    (its live bytes come on top of its caller's), never below its own input order's peak;
    a module without control flow gives its entry the whole budget."""
    from concerto_jax.judge import budget_share, plan_computation
    from concerto_jax.scheduler import ScheduleOptions
    from hlo_passes.ir.loops import control_flow_depths

    module = _loop(bound=3)
    assert control_flow_depths(module) == {"main": 0, "body": 1, "cond": 1}
    budget = 1 << 20
    assert budget_share(module, module.entry, budget) == budget // 2
    assert budget_share(module, module.computation("body"), budget) == budget // 4
    head = _LOOP.split("%cond")[0].replace("{{", "{").replace("}}", "}")
    flat = hlo_passes.parse_module(head + """ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  ROOT %ar = f32[8] all-reduce(%x), replica_groups={}, to_apply=%add
}
""")
    assert control_flow_depths(flat) == {"main": 0}
    assert budget_share(flat, flat.entry, budget) == budget
    cm = CostModel(get_cluster("h100_sxm_8"))
    times: dict = {"program": {}, "scheduled": {}, "bound": {}}
    opts = Options(passes=("schedule",), scheduler=ScheduleOptions(memory_budget_bytes=budget))
    limits = {c.name: plan_computation(module, c, cm, opts.scheduler, times, [])[0].memory_limit_bytes
              for c in schedulable_computations(module)}
    assert limits == {"cond": budget // 4, "body": budget // 4, "main": budget // 2}
    tiny = Options(passes=("schedule",), scheduler=ScheduleOptions(memory_budget_bytes=8))
    body, _ = plan_computation(module, module.computation("body"), cm, tiny.scheduler, times, [])
    assert body.memory_limit_bytes == body.input_peak_bytes > 2  # never below the input peak


def test_body_graph_knows_its_loop():
    module = _loop(bound=3)
    hg = build_taskgraph(module, CostModel(get_cluster("h100_sxm_8")), computation="body")
    assert hg.loop is not None and hg.loop.trip_count == 3 and hg.loop.carried_bytes == 36
    assert sum(t.is_collective for t in hg.graph.tasks) == 1
    param = hg.task_of["bp"]
    assert hg.graph.tasks[param].out_bytes == 36
    # Unfolded, the root tuple waits for the carried state: it stays live the whole iteration.
    hg = build_taskgraph(module, CostModel(get_cluster("h100_sxm_8")), computation="body",
                         fold_aliases=False)
    assert hg.task_of["bp"] in hg.graph.preds[hg.task_of["t"]]


def test_while_costs_trips_times_body():
    module = _loop(bound=3)
    stats = PASSES["schedule"](module, Options(passes=("schedule",))).stats
    (loop,) = stats["loops"]
    assert loop["trips"] == 3 and loop["collectives"] == 1 and stats["collectives_in_loops"] == 1
    assert stats["collectives"] == 1 and stats["computations"] == 3
    # The entry is the while alone (+ free ops): 3 x (body + cond) + cond.
    cm = CostModel(get_cluster("h100_sxm_8"))
    body = makespan(build_taskgraph(module, cm, computation="body").graph,
                    build_taskgraph(module, cm, computation="body").events)
    assert stats["program_order_us"] >= 3 * body - 1e-6
    assert stats["program_order_us"] < 4 * body + 10


# --------------------------------------------------------------------------------------
# JAX programs: stacked weights under lax.scan, tensor-parallel, forward and backward loops.

def _scan_step(num_layers: int, fsdp: bool = False):
    """Tensor parallel (column then row sharded weights), or FSDP (weights and batch sharded)."""
    mesh = jax.make_mesh((8,), ("m",), axis_types=(jax.sharding.AxisType.Auto,))
    col = NamedSharding(mesh, P(None, None, "m"))
    row = NamedSharding(mesh, P(None, "m", None))
    rep = NamedSharding(mesh, P("m") if fsdp else P())
    if fsdp:
        col = row

    def loss(params, x):
        def layer(h, w):
            wi, wo = w
            return h + jnp.tanh(h @ wi) @ wo, None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, params)
        return jnp.mean(h ** 2)

    @partial(jax.jit, in_shardings=((col, row), rep),
             out_shardings=((col, row), NamedSharding(mesh, P())))
    def step(params, x):
        v, g = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, q: p - 0.1 * q, params, g), v

    k1, k2, k3 = jax.random.split(jax.random.key(num_layers), 3)
    wi = jax.device_put(jax.random.normal(k1, (num_layers, 32, 64)) * 0.1, col)
    wo = jax.device_put(jax.random.normal(k2, (num_layers, 64, 32)) * 0.1, row)
    x = jax.device_put(jax.random.normal(k3, (64 if fsdp else 16, 32)), rep)
    return step, (wi, wo), x


@pytest.mark.parametrize("num_layers", [1, 3])  # 2 layers: tests/test_models_scan, test_loops_optimize
def test_scanned_tp_step_bitwise_with_loops_scheduled(num_layers):
    step, params, x = _scan_step(num_layers)
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), fallback=False))
    got, want = opt(params, x), step(params, x)
    assert_tree_bitwise(got, want)
    stats = opt.report().passes[0].stats
    assert len(stats["loops"]) == 2, stats["loops"]  # forward and backward layer loops
    assert {loop["trips"] for loop in stats["loops"]} == {num_layers}
    assert stats["collectives_in_loops"] >= 2, "the TP all-reduces live in the loop bodies"
    assert stats["collectives"] >= stats["collectives_in_loops"]
    assert stats["scheduled_us"] <= stats["program_order_us"] + 1e-6
    captured, _ = opt.hlo_texts()
    assert captured.count(" while(") == 2


def test_dynamic_trip_count_warns_once_and_stays_bitwise():
    mesh = jax.make_mesh((8,), ("m",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = NamedSharding(mesh, P("m"))

    @partial(jax.jit, in_shardings=(sh, None), out_shardings=sh)
    def step(x, n):
        def body(i, h):
            return jnp.tanh(h + jnp.sum(h))  # the sum is an all-reduce over "m"
        return jax.lax.fori_loop(0, n, body, x)

    x = jax.device_put(jnp.arange(64.0) / 64, sh)
    n = jnp.int32(3)
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), fallback=False))
    with pytest.warns(UserWarning, match="trip count unknown") as record:
        got = opt(x, n)
    assert len([w for w in record if "trip count unknown" in str(w.message)]) == 1
    assert_tree_bitwise(got, step(x, n))
    stats = opt.report().passes[0].stats
    assert stats["loops"] and stats["loops"][0]["trips"] is None
    assert stats["collectives_in_loops"] >= 1


@pytest.mark.xfail(strict=False, reason=(
    "open: since the collective model took NCCL 2.27.7's latencies and NVLS (DECISIONS D33), the "
    "schedule pass's plan of this FSDP backward body overlaps no collective with recomputed "
    "forward work (it did under the old constants); whether that plan is worse is not yet checked"))
def test_remat_work_in_backward_body_is_costed_and_used(monkeypatch):
    """The backward loop body recomputes the forward layer (jax.checkpoint): those tasks are
    costed, and the plan the pass gives the body runs a collective while recomputed forward
    compute runs.

    The overlap is read from the scheduler's plan (its events) for the body, the plan the pass
    put the body in: rebuilt from the reordered module, whose collectives are synchronous,
    no collective can overlap any compute (their START and DONE are adjacent). Collectives
    do not count as recomputed work (the partitioner of jax 0.10.2 tagged a remat'd dot's
    all-gather ``rematted_computation``, so the check once passed on that gather overlapping
    itself). CP-SAT stops at its default deterministic limit, not at the 5 s wall-clock one
    (on a loaded machine that stopped it at a 90.4 us plan without the overlap, 82.4 us
    with it at the deterministic limit, both within the body's memory limit: jax 0.12)."""
    from concerto_jax import scheduler
    from concerto_jax.judge import order_from_events
    from concerto_jax.scheduler import ScheduleOptions

    step, params, x = _scan_step(4, fsdp=True)
    module = hlo_passes.parse_module(capture(step, (params, x)).hlo_text)
    cm = CostModel(get_cluster("h100_sxm_8"))
    loops = loops_of(module)
    bodies = {info.body for info in loops.values()}
    (bwd,) = [b for b in bodies if any("rematted_computation" in str(i.metadata)
                                       for i in module.computation(b).instructions)]
    body = module.computation(bwd)
    remat = {i.name for i in body.instructions if "rematted_computation" in str(i.metadata)}
    assert remat, "jax.checkpoint should leave recomputed forward work in the backward body"
    hg = build_taskgraph(module, cm, computation=body, fold_aliases=False)
    remat_us = sum(hg.graph.tasks[hg.task_of[n]].duration_us for n in remat if n in hg.task_of)
    assert remat_us > 0
    before = [i.name for i in body.instructions]
    plans = []
    real = scheduler.schedule

    def recorded(graph, options, initial=None):
        plans.append((graph, real(graph, options, initial=initial)))
        return plans[-1][1]

    monkeypatch.setattr(scheduler, "schedule", recorded)
    PASSES["schedule"](module, Options(passes=("schedule",),
                                       scheduler=ScheduleOptions(full_model_time_limit_s=120.0)))
    assert [i.name for i in body.instructions] != before, "the backward body should be reordered"
    (graph, plan), = [(g, r) for g, r in plans if len(g) == len(hg.graph)
                      and [t.name for t in g.tasks] == [t.name for t in hg.graph.tasks]]
    # the body is in that plan's order
    order = order_from_events(hg, plan.events, [module.computation(bwd).instruction(n) for n in before])
    assert [i.name for i in body.instructions] == [i.name for i in order]
    tl = timeline(graph, plan.events)
    tasks = graph.tasks
    colls = [i for i, t in enumerate(tasks) if t.is_collective and t.duration_us > 0]
    recomputed = [i for i, t in enumerate(tasks) if t.name in remat and not t.is_collective
                  and t.duration_us > 0]
    assert recomputed
    overlap = [(tasks[c].name, tasks[r].name) for c in colls for r in recomputed
               if tl.start[r] < tl.end[c] and tl.start[c] < tl.end[r]]
    assert overlap, "no collective of the backward body overlaps recomputed forward work"
    assert plan.makespan_us < plan.input_makespan_us


_COND = """HloModule cond, num_partitions=1

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%yes (yp: f32[8]) -> f32[8] {
  %yp = f32[8] parameter(0)
  %ya = f32[8] all-reduce(%yp), replica_groups={}, to_apply=%add
  %yt = f32[8] tanh(%yp)
  ROOT %ym = f32[8] multiply(%ya, %yt)
}

%no (np: f32[8]) -> f32[8] {
  %np = f32[8] parameter(0)
  ROOT %nn = f32[8] negate(%np)
}

ENTRY %main (p: pred[], x: f32[8]) -> f32[8] {
  %p = pred[] parameter(0)
  %x = f32[8] parameter(1)
  ROOT %c = f32[8] conditional(%p, %x, %x), true_computation=%yes, false_computation=%no
}
"""


def test_conditional_branches_are_scheduled():
    module = hlo_passes.parse_module(_COND)
    assert [c.name for c in schedulable_computations(module)] == ["yes", "no", "main"]
    stats = PASSES["schedule"](module, Options(passes=("schedule",))).stats
    assert stats["computations"] == 3 and stats["collectives"] == 1
    assert stats["collectives_in_loops"] == 0 and stats["loops"] == []
    # The entry's only task is the conditional: it costs its longer branch.
    cm = CostModel(get_cluster("h100_sxm_8"))
    yes = build_taskgraph(module, cm, computation="yes")
    assert stats["program_order_us"] >= makespan(yes.graph, yes.events) - 0.05  # stats are rounded
