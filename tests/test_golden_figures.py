"""Golden figures: the refactor's identity check (bit for bit, floats through ``repr``).

Generated once on the code before the layout refactor, then every change must reproduce them
exactly. Deterministic settings only (the whole-graph CP-SAT and odd-even off, decompose's
judge rounds off), so that a loaded machine moves no figure:

* ``pipeline``: every ``tests/data/hlo/cpu_*.hlo`` through ``pipeline.run`` with several pass
  lists (target ``h100_sxm_8``): SHA-256 of the emitted text, every pass's ``changed``,
  ``tolerance`` and ``stats`` (minus wall times), and the SHA-256 of the scheduled form the
  dump writes (``hlo_passes.emit``).
* ``judge``: every ``tests/data/hlo/gpu_*.{after_lhs,final}.hlo``: ``judge_module`` (every
  field), ``reschedule_text`` of the after-LHS module (text SHA-256, figures of every
  computation) and ``measure(final, final, planned_text=after_lhs)``.
* ``scheduler``: ``scheduler.schedule`` alone on the entry task graphs of the same modules
  (events hashed, makespan, bound, peaks, source), and the full-speed timeline's makespan.
* ``deviceless`` (needs the CUDA plugin): ``compile_for_target`` of a small step on both
  paths, with a rewriting pass, the rewrite guard and the combine-threshold search, and the
  GPU route's deviceless compile half (figures, records and text hashes). These modules are
  compiled from Python here, so JAX writes the caller's stack into them (the ``FileNames`` ...
  ``StackFrames`` tables, ``stack_frame_id``, and XLA's ``fingerprint_before_lhs`` over all
  that): paths and line numbers of this checkout and of the library's own code. Their hashes
  are taken without those (``_compiled_sha``), so that moving code or the checkout moves none.

Regenerate only when a change of figures is intended: ``CONCERTO_REGEN_GOLDEN=1 pytest
tests/test_golden_figures.py`` and review the JSON diff. A row that moves between two runs of
the same code is not golden: leave it out (``VOLATILE``), do not regenerate it.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re

import jax
import pytest

from tests._helpers import without_default_emitter_configs

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "data", "golden")
HLO_DIR = os.path.join(os.path.dirname(__file__), "data", "hlo")
REGEN = os.environ.get("CONCERTO_REGEN_GOLDEN") == "1"
TARGET = "h100_sxm_8"
PASS_LISTS = (("schedule",), ("fuse_collectives",), ("decompose", "schedule"),
              ("pipeline_loops", "schedule"), ("schedule", "pin"),
              ("decompose", "fuse_collectives", "schedule", "pin"))
DEVICELESS_GOLDEN_JAX = "0.12.0.1"
"""The JAX release whose XLA compiled the ``deviceless`` group's modules (the newest supported)."""
VOLATILE = frozenset({"seconds", "solver_s", "wall_time_s", "compile_s"})
"""Stats keys that are wall times (left out of every record)."""


def _sha(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


_STACK_TABLES = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", re.M)
_STACK_REFS = re.compile(r",? ?stack_frame_id=\d+|,? ?fingerprint_before_lhs=\"[0-9a-f]*\"")


def _compiled_sha(text: str | None) -> str | None:
    """``_sha`` of a module compiled from Python here, without the caller's stack (paths, lines)
    and without the default emitter configs of XLA's generic-fusion autotuner, which
    ``compile_for_target``'s own compiles skip (``tests._helpers.without_default_emitter_configs``)."""
    if text is None:
        return None
    return _sha(without_default_emitter_configs(_STACK_REFS.sub("", _STACK_TABLES.sub("", text))))


def _plain(value):
    """A JSON-comparable form: dataclasses as dicts, tuples as lists, wall times dropped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _options(passes=()):
    from concerto_jax import DevicelessOptions, Options
    from concerto_jax.scheduler import ScheduleOptions
    from hlo_passes.decompose.options import DecomposeOptions

    return Options(passes=tuple(passes), target=TARGET, validate_with_xla=False,
                   deviceless=DevicelessOptions(time_budget_s=None),
                   scheduler=ScheduleOptions(full_model_max_tasks=0, odd_even=None, progress=False),
                   decompose=DecomposeOptions(judge_rounds=0))


def _target_options(passes, thresholds=(), **kw):
    """``_options(passes)`` for ``compile_for_target``: no fallback, these combine thresholds
    searched (none by default), ``kw`` replaced."""
    opts = _options(passes)
    return dataclasses.replace(opts, fallback=False, **kw, deviceless=dataclasses.replace(
        opts.deviceless, combine_thresholds=thresholds))


def _cost_model():
    from concerto_jax.costmodel import CostModel, get_cluster

    return CostModel(get_cluster(TARGET))


def _records(passes) -> list:
    return [{"name": p.name, "changed": p.changed, "tolerance": p.tolerance, "stats": _plain(p.stats)}
            for p in passes]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def pipeline_figures() -> dict:
    import warnings

    from concerto_jax import pipeline
    from hlo_passes.emit import emit_scheduled

    out = {}
    for path in sorted(glob.glob(os.path.join(HLO_DIR, "cpu_*.hlo"))):
        text = _read(path)
        for passes in PASS_LISTS:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = pipeline.run(text, _options(passes))
            try:
                scheduled = _sha(emit_scheduled(result.text))
            except Exception as e:  # noqa: BLE001 - the dump logs it: record the failure's type
                scheduled = f"error: {type(e).__name__}"
            out[f"{os.path.basename(path)} {'+'.join(passes)}"] = {
                "text": _sha(result.text), "instructions": result.instructions,
                "collectives": result.collectives, "passes": _records(result.passes),
                "scheduled_form": scheduled,
                "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught})}
    return out


def _gpu_modules():
    for path in sorted(glob.glob(os.path.join(HLO_DIR, "gpu_*.after_lhs.hlo"))):
        name = os.path.basename(path).split(".")[0]
        yield name, _read(path), _read(os.path.join(HLO_DIR, f"{name}.final.hlo"))


def judge_figures() -> dict:
    from concerto_jax.deviceless.reschedule import reschedule_text
    from concerto_jax.judge import judge_module, measure

    cm = _cost_model()
    out = {}
    for name, after_lhs, final in _gpu_modules():
        r = reschedule_text(after_lhs, cm, _options(("schedule",)))
        out[name] = {
            "judge_after_lhs": _plain(judge_module(after_lhs, cm)),
            "judge_final": _plain(judge_module(final, cm)),
            "reschedule": {"text": _sha(r.text), "input_us": r.input_us, "scheduled_us": r.scheduled_us,
                           "changed": list(r.changed), "computations": _plain(r.computations)},
            "measure": _plain(measure(final, final, cm, planned_text=after_lhs)),
            "measure_rescheduled": _plain(measure(final, final, cm, planned_text=r.text)),
        }
    return out


def scheduler_figures() -> dict:
    from concerto_jax import scheduler
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.simulator import makespan
    from hlo_passes import parse_module

    cm = _cost_model()
    opts = _options().scheduler
    texts = [(os.path.basename(p), _read(p)) for p in sorted(glob.glob(os.path.join(HLO_DIR, "cpu_*.hlo")))]
    texts += [(f"{n}.after_lhs", a) for n, a, _ in _gpu_modules()]
    out = {}
    for name, text in texts:
        for fold in (True, False):
            hg = build_taskgraph(parse_module(text), cm, fold_aliases=fold)
            r = scheduler.schedule(hg.graph, opts, initial=hg.events)
            out[f"{name} fold={fold}"] = {
                "events": _sha(repr([(e.task, e.phase.value) for e in r.events])),
                "makespan_us": r.makespan_us, "lower_bound_us": r.lower_bound_us,
                "input_makespan_us": r.input_makespan_us, "source": r.source,
                "peak_memory_bytes": r.peak_memory_bytes, "input_peak_memory_bytes": r.input_peak_memory_bytes,
                "memory_limit_bytes": r.memory_limit_bytes, "program_order_us": makespan(hg.graph, hg.events)}
    return out


def _mlp():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import concerto_jax

    mesh = concerto_jax.target_mesh(TARGET, (2, 4), ("dp", "tp"))

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    args = [jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp"))),
            jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", None))),
            jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp", None)))]
    return jax.jit(jax.grad(loss, argnums=(0, 1))), args


def _scanned():
    from tests._helpers import scanned_target_step

    return scanned_target_step(TARGET)


def _embedding_2x4():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import concerto_jax

    mesh = concerto_jax.target_mesh("h100_sxm_2x4", (2, 4), ("data", "model"))
    spec = {"emb": P(), "w1": P(None, "model"), "w2": P("model", None)}
    shapes = {"emb": (32768, 1024), "w1": (1024, 256), "w2": (256, 1024)}
    params = {k: jax.ShapeDtypeStruct(shapes[k], jnp.float32, sharding=NamedSharding(mesh, spec[k]))
              for k in spec}
    bsh = NamedSharding(mesh, P("data"))

    def loss(p, ids, y):
        return jnp.mean((jax.nn.gelu(jnp.take(p["emb"], ids, axis=0) @ p["w1"]) @ p["w2"] - y) ** 2)

    @jax.jit
    def step(params, ids, y):
        value, grads = jax.value_and_grad(loss)(params, ids, y)
        return jax.tree.map(lambda a, b: a - 0.01 * b, params, grads), value

    return step, [params, jax.ShapeDtypeStruct((16, 64), jnp.int32, sharding=bsh),
                  jax.ShapeDtypeStruct((16, 64, 1024), jnp.float32, sharding=bsh)]


def _target_result(res) -> dict:
    out = _plain(res)
    for key in ("final_text", "stock_final_text", "emitted_text", "scheduled_text"):
        out[key] = _compiled_sha(getattr(res, key))
    out["passes"] = _records(res.passes)
    return out


def deviceless_figures() -> dict:
    import concerto_jax
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.gpu_route import compile_deviceless

    step, args = _mlp()
    out = {}
    for label, passes, via, kw in (
            ("backend_only schedule", ("schedule",), "backend_only", {}),
            ("backend_only decompose+schedule thresholds", ("decompose", "schedule"), "backend_only",
             {"thresholds": (8 << 20, 512 << 10)}),
            ("pin schedule", ("schedule",), "pin", {})):
        opts = _target_options(passes, **kw)
        res = concerto_jax.compile_for_target(step, *args, target=TARGET, options=opts, via=via)
        out[label] = _target_result(res)
    forced = dataclasses.replace(_options().decompose, force_degree=2)
    for label, (s, a), target, kw in (
            ("scanned decompose+schedule thresholds", _scanned(), TARGET,
             {"thresholds": (8 << 20, 512 << 10)}),
            ("mlp forced decompose+schedule", (step, args), TARGET, {"decompose": forced}),
            ("embedding 2x4 forced decompose+schedule", _embedding_2x4(), "h100_sxm_2x4",
             {"decompose": forced})):
        opts = _target_options(("decompose", "schedule"), target=target, **kw)
        res = concerto_jax.compile_for_target(s, *a, target=target, options=opts)
        out[label] = _target_result(res)
    d = compile_deviceless(step, args, get_cluster(TARGET), _options(("decompose", "schedule")))
    out["gpu_route deviceless decompose+schedule"] = {
        "handed": _compiled_sha(d.plan.handed), "replicated": d.plan.replicated, "passes": _records(d.plan.passes),
        "final": _compiled_sha(d.payload.final_text), "num_devices": d.payload.num_devices,
        "compute_capability": d.payload.compute_capability}
    return out


def _plugin() -> bool:
    from concerto_jax.deviceless.compile import gpu_plugin_available

    return gpu_plugin_available()


GROUPS = {"pipeline": pipeline_figures, "judge": judge_figures, "scheduler": scheduler_figures,
          "deviceless": deviceless_figures}


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_golden_figures(group):
    if group == "deviceless" and not _plugin():
        pytest.skip("CUDA PJRT plugin missing: pip install -e .[gpu]")
    if group == "deviceless" and jax.__version__ != DEVICELESS_GOLDEN_JAX:
        pytest.skip(f"the deviceless figures are XLA {DEVICELESS_GOLDEN_JAX}'s modules; "
                    f"XLA {jax.__version__} compiles other ones")
    got = json.loads(json.dumps(GROUPS[group]()))
    path = os.path.join(GOLDEN_DIR, f"{group}.json")
    if REGEN:
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(path) as f:
        want = json.load(f)
    assert sorted(got) == sorted(want), "cases differ"
    bad = [k for k in sorted(want) if got[k] != want[k]]
    assert not bad, f"{len(bad)} cases moved: {bad[:5]}"
