"""Emit (scheduled module with async start/done pairs) and window pins, on captured CPU post-SPMD modules."""

import os

import pytest

import concerto_jax
import hlo_passes
import models
from hlo_passes.emit import emit_scheduled
from hlo_passes.pin import pin_windows, windows_from_order
from tests._helpers import FAST, run_bitwise_steps

DATA = os.path.join(os.path.dirname(__file__), "data", "hlo")


def _read(name):
    with open(os.path.join(DATA, name)) as f:
        return f.read()


def test_emit_scheduled_pairs_in_xla_form():
    text = _read("cpu_shard_map_collectives.hlo")
    out = emit_scheduled(text)
    assert "is_scheduled=true" in out.split("\n", 1)[0]
    module = hlo_passes.parse_module(out)
    (body,) = [c for c in module.computations if any(i.is_collective for i in c.instructions)]
    starts = [i for i in body.instructions if i.async_role == "start"]
    kinds = {i.opcode for i in starts}
    assert {"all-reduce-start", "all-gather-start", "collective-permute-start"} <= kinds, kinds
    order = {i.name: k for k, i in enumerate(body.instructions)}
    for s in starts:
        (done,) = [u for u in s.users if u.async_role == "done"]
        assert order[s.name] < order[done.name]
        # The done is where the first reader needs it: nothing but its own aliases reads it earlier.
        assert all(order[u.name] > order[done.name] for u in done.users)
    assert not [i for i in body.instructions if i.opcode in ("all-reduce", "all-gather", "collective-permute")]
    hlo_passes.xla_parse(out)  # XLA's parser accepts it (emit_scheduled checks it too)


def test_pins_tie_windows_and_keep_a_valid_module():
    from hlo_passes.schedule.run import schedule_pass

    module = hlo_passes.parse_module(_read("cpu_transformer_block.hlo"))
    assert not windows_from_order(module.entry)  # XLA's program order: each collective right before its reader
    schedule_pass(module, concerto_jax.Options(passes=("schedule",)))
    windows = windows_from_order(module.entry)
    assert windows, "the scheduled block overlaps no collective with compute"
    # This block's windows hold elementwise work only: the default (GEMM/conv anchors) ties nothing.
    assert pin_windows(hlo_passes.parse_module(hlo_passes.module_to_text(module)), windows).pinned == 0
    stats = pin_windows(module, windows, anchors=None)
    assert stats.pinned == len(windows) - len(stats.skipped) and stats.pinned > 0
    hlo_passes.verify(module)
    text = hlo_passes.module_to_text(module)
    hlo_passes.xla_parse(text)
    barriers = [i for i in module.entry.instructions if i.opcode == "opt-barrier"]
    assert len(barriers) == 2 * stats.pinned
    for w in windows:
        if w.collective in stats.skipped:
            continue
        c = module.entry.instruction(w.collective)
        # before: the collective reads a barrier output; after: every reader of c reads a barrier output
        assert all(o.opcode == "get-tuple-element" and o.operands[0].opcode == "opt-barrier" for o in c.operands)
        assert any(u.opcode == "tuple" and u.users[0].opcode == "opt-barrier" for u in c.users)


@pytest.mark.parametrize(("model", "layout"), [("gpt", "tp")])
def test_pinned_step_is_bitwise_equal_on_cpu(model, layout):
    case = models.make_case(model, layout, "tiny")
    reference = case.step.lower(case.state, case.batch).compile(compiler_options=FAST)
    step = concerto_jax.optimize(case.step, concerto_jax.Options(passes=("schedule", "pin"), compiler_options=FAST,
                                                                 fallback=False))
    run_bitwise_steps(reference, step, case, 2)
    (_, pin) = step.report().passes
    assert pin.stats["pinned"] > 0
