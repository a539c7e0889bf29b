"""The checks of ``python -m concerto_jax.gpu_check`` (the package docstring lists them), their
reports, and ``main``. Every build here runs with the plan cache off (``cache_dir=None``): each
check is about a build, and a cache hit would skip the stages it patches or times."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import gzip
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from concerto_jax import jax_compat
from concerto_jax.api import ConcertoFallbackWarning, optimize
from concerto_jax.costmodel import CostModel, get_cluster, op_info
from concerto_jax.costmodel.compute import kernel_count, work_of
from concerto_jax.costmodel.specs import gpu_spec_from_target_config
from concerto_jax.deviceless.compile import compile_replicated_for_target, gpu_plugin_available
from concerto_jax.deviceless.pjrt_c import RIEGELI_SIGNATURE
from concerto_jax.deviceless.reschedule import permute_text
from concerto_jax.gpu_route import route
from concerto_jax.judge import judge_module
from concerto_jax.options import OptimizeOptions, Options
from concerto_jax.scheduler import ScheduleOptions
from hlo_passes.ir import parse_module
from hlo_passes.ir.loops import schedulable_computations

log = logging.getLogger("concerto_jax.gpu_check")

DEFAULT_BUDGET_S = 480.0
CPU_CASES = ("gpt_tp8_nvlink",)
"""Suite cases the CPU half compiles deviceless by default (``--cases all``: every one)."""
CHECK_COLUMNS = ("check", "status", "seconds", "detail")


@dataclasses.dataclass
class Run:
    """The rows so far, the output directory and the time budget."""

    out: str
    budget_s: float
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    rows: list = dataclasses.field(default_factory=list)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def check(self, name: str, fn: Callable[[], str | None], *, needs_s: float = 0.0) -> bool:
        """Run one check: ``fn`` returns a detail string (pass) or raises (FAIL); skipped when
        less than ``needs_s`` of the budget is left."""
        if self.left_s() < needs_s:
            self.skip(name, f"budget: {self.left_s():.0f} s left, needs about {needs_s:.0f} s")
            return False
        log.info("[%4.0f s] %s ...", time.perf_counter() - self.t0, name)
        t = time.perf_counter()
        try:
            detail = fn() or ""
            status = "pass"
        except _Skip as e:
            detail, status = str(e), f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - a failed check is a row
            detail = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:500]}"
            status = "FAIL"
            log.debug("%s", traceback.format_exc())
        dt = time.perf_counter() - t
        self.rows.append({"check": name, "status": status, "seconds": round(dt, 1), "detail": detail})
        log.log(logging.ERROR if status == "FAIL" else logging.INFO, "%s: %s (%.1f s) %s",
                name, status, dt, detail[:300])
        self.write()  # the rows so far survive a run killed at its time limit
        return status == "pass"

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "status": f"skipped: {why}", "seconds": 0, "detail": ""})
        log.info("%s: skipped (%s)", name, why)

    def write(self, extra_md: str = "") -> None:
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        write_csv(os.path.join(self.out, "checks.csv"), self.rows, CHECK_COLUMNS)
        failed = [r for r in self.rows if r["status"] == "FAIL"]
        passed = [r for r in self.rows if r["status"] == "pass"]
        lines = ["# gpu_check", "", _environment_line(), "",
                 f"{len(passed)} passed, {len(failed)} failed, "
                 f"{len(self.rows) - len(passed) - len(failed)} skipped "
                 f"({time.perf_counter() - self.t0:.0f} s)", "", markdown_table(self.rows, CHECK_COLUMNS)]
        if extra_md:
            lines += ["", extra_md]
        with open(os.path.join(self.out, "checks.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


class _Skip(Exception):
    """A check that does not apply here (its row says why)."""


def write_csv(path: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")[:300]

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def _environment_line() -> str:
    devs = jax.devices()
    kinds = sorted({jax_compat.gpu_device_facts(d)["device_kind"] for d in devs})
    return (f"jax {jax.__version__}, jaxlib {jax_compat.jax_versions()[1]}, backend "
            f"{jax.default_backend()}, {len(devs)} device(s): {', '.join(kinds)}; "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")


def _bitwise_diff(a, b) -> list[str]:
    """Leaves of two pytrees that are not bitwise equal (dtype, shape, bits)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return [f"trees differ: {ta} vs {tb}"]
    bad = []
    for k, (x, y) in enumerate(zip(la, lb, strict=True)):
        if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            bad.append(f"leaf {k} {x.dtype}{list(x.shape)}")
    return bad


# -- collective stand-ins ------------------------------------------------------------------------

def _shape_text(line: str) -> tuple[str, int]:
    """The result shape text of an instruction line and the index where it ends."""
    i = line.index("=") + 1
    while line[i] == " ":
        i += 1
    start, depth = i, 0
    while i < len(line):
        c = line[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == " " and depth == 0:
            break
        i += 1
    return line[start:i], i


def _split_tuple(shape: str) -> list[str]:
    """Element shape texts of a tuple shape text ``(a, b, ...)`` (nested tuples kept whole)."""
    inner, out, depth, cur = shape[1:-1], [], 0, ""
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur.strip())
    return [re.sub(r"^/\*index=\d+\*/", "", e).strip() for e in out]  # XLA's /*index=5*/ marks


def _standin_lines(name: str, shape: str, indent: str, root: bool, operands: Sequence = ()) -> list[str]:
    """Lines defining ``%name`` (result ``shape``) locally from the collective's ``operands``
    (``(name, Shape)``, element by element for a tuple result): the operand itself where the
    shape is the same (a ``bitcast``; a ``copy`` of a parameter), padded with zeros where it
    grows (all-gather), sliced where it shrinks (reduce-scatter), else a zero broadcast. Reading
    the operand keeps its producers alive: a zero alone lets XLA drop the whole backward pass
    that feeds a gradient all-reduce."""
    lines: list[str] = []

    def zero(var: str, dtype: str) -> str:
        lines.append(f"{indent}%{var}.zero = {dtype}[] constant({'false' if dtype == 'pred' else '0'})")
        return f"%{var}.zero"

    def array(var: str, s: str, op) -> str:
        m = re.match(r"([a-z0-9]+)\[([^\]]*)\]", s)
        if m is None:
            raise ValueError(f"no stand-in for a collective result of shape {s!r}")
        dtype = m.group(1)
        dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
        if op is not None:
            src, oshape = op
            odims = tuple(oshape.dims)
            if oshape.is_array and oshape.dtype == dtype and len(odims) == len(dims):
                if odims == dims:
                    how = "copy" if src in _parameters else "bitcast"
                    lines.append(f"{indent}%{var} = {s} {how}(%{src})")
                    return var
                if all(d >= o for d, o in zip(dims, odims, strict=True)):
                    z = zero(var, dtype)
                    pad = "x".join(f"0_{d - o}" for d, o in zip(dims, odims, strict=True))
                    lines.append(f"{indent}%{var} = {s} pad(%{src}, {z}), padding={pad}")
                    return var
                if all(d <= o for d, o in zip(dims, odims, strict=True)):
                    box = ", ".join(f"[0:{d}]" for d in dims)
                    lines.append(f"{indent}%{var} = {s} slice(%{src}), slice={{{box}}}")
                    return var
        z = zero(var, dtype)
        lines.append(f"{indent}%{var} = {s} broadcast({z}), dimensions={{}}")
        return var

    def build(var: str, s: str, ops: list) -> str:
        if s.startswith("("):
            parts = [build(f"{var}.e{k}", e, [ops[k]] if k < len(ops) else [])
                     for k, e in enumerate(_split_tuple(s))]
            lines.append(f"{indent}%{var} = {s} tuple(" + ", ".join(f"%{p}" for p in parts) + ")")
            return var
        return array(var, s, ops[0] if ops else None)

    build(name, shape, list(operands))
    if root:
        lines[-1] = lines[-1].replace(f"{indent}%{name} =", f"{indent}ROOT %{name} =", 1)
    return lines


def _operand_ref(module, operand) -> str:
    """How the text names ``operand``: ``x#k`` for the parser's stand-in of a tuple element
    written that way (it has no line of its own), else its name."""
    if operand.name in module.implicit_tuple_elements:
        return f"{operand.operands[0].name}#{operand.attrs.get('index', 0)}"
    return operand.name


_parameters: set[str] = set()
"""Names of the parameters of the module being stood in (``standin_collectives`` sets it)."""


_HEADER_DROP = ("input_output_alias", "buffer_donor")
"""Header attributes a stand-in module loses (one device, no donation through the stand-in's step)."""


def _drop_attr(line: str, key: str) -> str:
    """``line`` without its ``, key={...}`` attributes (braces balanced)."""
    marker = f", {key}={{"
    at = line.find(marker)
    while at >= 0:
        i, depth = at + len(marker), 1
        while i < len(line) and depth:
            depth += {"{": 1, "}": -1}.get(line[i], 0)
            i += 1
        line = line[:at] + line[i:]
        at = line.find(marker)
    return line


def _drop_sharding(line: str) -> str:
    return _drop_attr(line, "sharding")


def standin_collectives(text: str) -> tuple[str, dict]:
    """``text`` (a scheduled per-device module) with every collective replaced by a local stand-in
    of the same output shape: a sync collective or an async pair's done becomes a zero broadcast
    (a tuple of them), its start and updates are removed; the header loses the aliasing, donor,
    partition and replica settings and the instructions their shardings (one device, one
    partition). Returns the text and ``{kind: count}`` of what was replaced."""
    module = parse_module(text, source="standin")
    drop: set[str] = set()
    replace: dict[str, list] = {}
    counts: dict[str, int] = {}
    _parameters.clear()
    for comp in module.computations:
        for inst in comp.instructions:
            if inst.opcode == "parameter":
                _parameters.add(inst.name)
            kind = inst.collective_kind
            if kind is None:
                continue
            role = inst.async_role
            if role in ("start", "update"):
                drop.add(inst.name)
            else:
                src = inst.async_start() if role == "done" else inst
                replace[inst.name] = [(_operand_ref(module, o), o.shape)
                                      for o in (src.operands if src is not None else ())]
                counts[kind] = counts.get(kind, 0) + 1
    out: list[str] = []
    lines = text.split("\n")
    header = lines[0]
    for key in _HEADER_DROP:
        header = _drop_attr(header, key)
    header = re.sub(r",\s*(num_partitions|replica_count)=\d+", "", header)
    out.append(header)
    inst_re = re.compile(r"^(\s+)(ROOT\s+)?%?([\w.\-]+)\s*=")
    for line in lines[1:]:
        m = inst_re.match(line)
        if m is None:
            out.append(line)
            continue
        indent, root, name = m.group(1), bool(m.group(2)), m.group(3)
        if name in drop:
            continue
        if name in replace:
            shape, _ = _shape_text(line)
            out.extend(_standin_lines(name, shape, indent, root, replace[name]))
            continue
        line = _drop_sharding(line)
        if drop and "control-predecessors={" in line:
            line = re.sub(r"control-predecessors=\{([^}]*)\}", lambda mm: "control-predecessors={" + ", ".join(
                p for p in (x.strip() for x in mm.group(1).split(",")) if p and p.lstrip("%") not in drop) + "}", line)
            line = line.replace(", control-predecessors={}", "")
        out.append(line)
    return "\n".join(out), counts


# -- the CPU half ---------------------------------------------------------------------------------

def suite_options(case, passes: Sequence[str], fast: bool):
    """``Options`` for a suite case; ``fast``: the scheduler's quick settings (no window search)."""
    sched = ScheduleOptions(odd_even=None, progress=False) if fast else ScheduleOptions(progress=False)
    return Options(cache_dir=None, passes=tuple(passes), target=case.cluster, scheduler=sched,
                   compiler_options=dict(case.xla_options))


def deviceless_case(case, passes: Sequence[str], fast: bool = True):
    """``route.compile_deviceless`` of a suite case."""
    # lazy: bench/ and models/ are not installed; only a run from the repository root imports them
    from bench.baseline import model_case

    mcase, _, _ = model_case(case)
    return route.compile_deviceless(mcase.step, (mcase.abstract_state, mcase.abstract_batch),
                                           get_cluster(case.cluster), suite_options(case, passes, fast))


def check_deviceless(d, case) -> str:
    """Assert what the deviceless half must give; returns the row's detail."""
    p = d.payload
    assert p.data.startswith(RIEGELI_SIGNATURE), f"payload starts {p.data[:8].hex()}, not Riegeli"
    assert b"PjRtStreamExecutorClient" in p.data, "no PJRT client name in the payload"
    kept = route.order_kept(d.plan.handed, p.final_text)
    assert kept["kept"], f"XLA's backend moved our order: {kept}"
    fake = [types.SimpleNamespace(id=i, device_kind="x", compute_capability=p.compute_capability,
                                  core_count=None, process_index=0) for i in range(p.num_devices)]
    route.check_payload(p, fake, p.num_devices)
    other = "7.0" if p.compute_capability != "7.0" else "8.0"
    for bad, n in (([types.SimpleNamespace(**{**vars(f), "compute_capability": other}) for f in fake],
                    p.num_devices),
                   (fake[:-1], p.num_devices - 1)):
        try:
            route.check_payload(p, bad, n)
        except route.LoadRefused:
            continue
        raise AssertionError("the load's checks accepted a payload for other devices")
    changed = [r.name for r in d.plan.passes if r.changed]
    return (f"{len(p.data)} B serialized for {case.cluster} (cc {p.compute_capability}); passes changed "
            f"{changed}; our order kept ({kept['in_our_order']}/{kept['common']} entry instructions); "
            f"stages {json.dumps({k: round(v, 1) for k, v in d.seconds.items()})}")


def rehearsal_checks(run: Run) -> None:
    """The JAX side of the load with CPU executables on 8 CPU devices."""
    if len(jax.devices("cpu")) < 8:
        for name in ("rehearsal/steps", "rehearsal/callbacks", "rehearsal/device_order", "negative/cpu"):
            run.skip(name, f"needs 8 CPU devices (jax_num_cpu_devices=8), have {len(jax.devices('cpu'))}")
        return
    step, make_args, _ = _mlp(jax.devices("cpu")[:8])
    opts = Options(cache_dir=None, passes=("schedule",))

    def steps() -> str:
        with route.rehearse():
            opt = optimize(step, opts)
            p_ref, x = make_args(0)
            p_opt, _ = make_args(0)
            for _ in range(3):
                donated, donated_ref = p_opt, p_ref
                p_ref, v_ref = step(p_ref, x)
                p_opt, v_opt = opt(p_opt, x)
                bad = _bitwise_diff((p_opt, v_opt), (p_ref, v_ref))
                assert not bad, f"differs from plain jit: {bad}"
            rep = opt.report()
        assert rep.optimized and rep.executable.startswith("backend-only"), rep.fallback_reason
        # (jaxlib 0.11 keeps a CPU buffer it shares with NumPy: plain jit's donation is the reference)
        assert donated["w1"].is_deleted() == donated_ref["w1"].is_deleted(), \
            "the donated state was not consumed as plain jit consumes it"
        return f"3 steps bitwise; {rep.first_step_check}"

    def callbacks() -> str:
        seen: list = []

        @jax.jit
        def cb_step(p, x):
            new, v = step(p, x)
            jax.debug.callback(lambda t: seen.append(float(t)), v)
            return new, v

        with route.rehearse():
            opt = optimize(cb_step, opts)
            p, x = make_args(1)
            got = opt(p, x)
            jax.effects_barrier()
            rep = opt.report()
        assert rep.optimized and rep.executable.startswith("backend-only"), rep.fallback_reason
        assert not _bitwise_diff(got, step(*make_args(1)))
        assert len(seen) == 1, f"the callback fired {len(seen)} times"
        return "host callback fired once, outputs bitwise"

    def device_order() -> str:
        rstep, rmake, _ = _mlp(jax.devices("cpu")[:8][::-1])
        built = route.build(rstep, rmake(0), {}, opts, route.CpuRehearsal())
        assert not _bitwise_diff(built.compiled(*rmake(2)), rstep(*rmake(2)))
        return "devices in reverse order: the load's options put the step's assignment back"

    run.check("rehearsal/steps", steps)
    run.check("rehearsal/callbacks", callbacks)
    run.check("rehearsal/device_order", device_order)
    run.check("negative/cpu", lambda: negative_checks(step, make_args, opts, route.CpuRehearsal))


def _mlp(devices):
    """A DP x TP MLP train step over ``devices`` (8), donating its parameters."""
    mesh = Mesh(np.array(devices).reshape(2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    xs, w1s, w2s = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P(None, "tp")), \
        NamedSharding(mesh, P("tp", None))

    def loss(params, x):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)

    @partial(jax.jit, in_shardings=({"w1": w1s, "w2": w2s}, xs),
             out_shardings=({"w1": w1s, "w2": w2s}, NamedSharding(mesh, P())), donate_argnums=(0,))
    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    def make_args(seed=0):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        return ({"w1": jax.device_put(jax.random.normal(k1, (16, 32)), w1s),
                 "w2": jax.device_put(jax.random.normal(k2, (32, 16)), w2s)},
                jax.device_put(jax.random.normal(k3, (8, 16)), xs))

    return step, make_args, mesh


def negative_checks(step, make_args, opts, backend_cls) -> str:
    """Raw bytes without a header, another device count, another compute capability: each a
    clear error before the runtime, and through ``optimize`` one warning naming the load and the
    original's outputs. ``backend_cls``: ``CpuRehearsal`` or ``GpuBackend``."""
    args = make_args(0)
    built = route.build(step, args, {}, opts, backend_cls())
    devices = built.stock.device_list
    try:
        jax_compat.deserialize(built.payload.data, devices)
    except ValueError as e:
        assert "not a serialized executable" in str(e), e
    else:
        raise AssertionError("raw PJRT bytes without a header were loaded")
    words = []
    real = backend_cls.compile
    header = jax_compat.step_header(jax_compat.xla_executable(built.stock.compiled))
    cc = built.payload.compute_capability
    for bad in ("no_header", "device_count", "compute_capability"):
        def compile_bad(self, plan, devs, target, env, callbacks, bad=bad):
            good = real(self, plan, devs, target, env, callbacks)
            if bad == "no_header":
                return dataclasses.replace(good, data=header + good.data)
            if bad == "device_count":
                return dataclasses.replace(good, num_devices=good.num_devices * 2)
            other = "7.0" if cc != "7.0" else "8.0"
            data = good.data if good.data.startswith(RIEGELI_SIGNATURE) else RIEGELI_SIGNATURE + good.data
            return dataclasses.replace(good, data=data, compute_capability=other)

        backend_cls.compile = compile_bad
        try:
            opt = optimize(step, opts)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if backend_cls is route.CpuRehearsal:
                    with route.rehearse():
                        got = opt(*make_args(4))
                else:
                    got = opt(*make_args(4))
        finally:
            backend_cls.compile = real
        fb = [str(w.message) for w in caught if issubclass(w.category, ConcertoFallbackWarning)]
        assert len(fb) == 1 and "stage 'load'" in fb[0] and "LoadRefused" in fb[0], fb
        assert not _bitwise_diff(got, step(*make_args(4))), "the fallback's outputs differ"
        words.append(f"{bad}: {fb[0].split('LoadRefused: ', 1)[-1][:80]}")
    return "; ".join(words)


# -- the GPU half ---------------------------------------------------------------------------------

def gpt_steps(devices):
    """The GPT-block train steps of item a over ``devices`` (one GPU there; the CPU rehearsal
    uses 8 CPU devices, data parallel): ``({name: (step, models.Case)}, the callback's log)``."""
    # lazy: bench/ and models/ are not installed; only a run from the repository root imports them
    from models.gpt import PRESETS
    from models.layouts import make_mesh  # lazy: as above
    from models.registry import make_case  # lazy: as above

    mesh = make_mesh("dp", (len(devices),), devices=list(devices))
    base = PRESETS["tiny"]
    out = {}
    for name, dtype in (("gpt_f32", jnp.float32), ("gpt_bf16", jnp.bfloat16)):
        cfg = dataclasses.replace(base, num_layers=1, hidden=256, num_heads=4, seq_len=128,
                                  batch_size=8, vocab_size=512, dtype=dtype)
        case = make_case("gpt", "dp", cfg, mesh=mesh, materialize=True)
        out[name] = (case, dtype)
    steps = {}
    f32, _ = out["gpt_f32"]
    bf16, _ = out["gpt_bf16"]

    def plain(case):
        return jax.jit(lambda s, b: case.step(s, b))  # no donation (inner donation is ignored)

    def with_callback(case, seen):
        @jax.jit
        def step(s, b):
            new, metrics = case.step(s, b)
            jax.debug.callback(lambda v: seen.append(np.asarray(v).tolist()), jax.tree.leaves(metrics)[0])
            return new, metrics
        return step

    seen: list = []
    steps["gpt_f32"] = (plain(f32), f32)
    steps["gpt_bf16"] = (plain(bf16), bf16)
    steps["gpt_f32_callback"] = (with_callback(f32, seen), f32)
    steps["gpt_f32_donated"] = (f32.step, f32)
    return steps, seen


def perturbed_order(text: str) -> str:
    """``text`` with its entry in another legal order: Kahn's topological sort taking the most
    recently readied instruction first (XLA's order takes them otherwise); the same text if the
    entry has only one legal order."""
    module = parse_module(text, source="perturb")
    entry = module.entry
    names = [i.name for i in entry.instructions if i.name not in module.implicit_tuple_elements]
    keep = set(names)
    implicit = module.implicit_tuple_elements

    def base(o):  # an implicit tuple element (``%x#3``) has no line: its producer's
        while o.name in implicit and o.operands:
            o = o.operands[0]
        return o.name

    deps = {i.name: {base(o) for o in list(i.operands) + list(i.control_predecessors)} & keep
            for i in entry.instructions if i.name in keep}
    users: dict[str, list[str]] = {n: [] for n in names}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    waiting = {n: len(ds) for n, ds in deps.items()}
    ready = [n for n in names if waiting[n] == 0]
    order = []
    while ready:
        n = ready.pop()  # the latest readied first
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if len(order) != len(names):
        raise ValueError("the entry has a dependency cycle")
    root = entry.root.name
    if order[-1] != root and root in order:
        order.remove(root)
        order.append(root)
    return permute_text(text, {entry.name: order}) if order != names else text


def route_check(name: str, step, case, passes: Sequence[str], seen: list | None = None,
                backend: str = "gpu", ratios: dict | None = None) -> str:
    """Item a for one step: 3 steps of ``optimize`` (the route) bitwise equal to the plain step,
    no fallback, our order in the loaded executable's module; ``ratios`` (if given) receives
    ``{name: ours / plain}`` of the interleaved step times."""
    opt = optimize(step, Options(cache_dir=None, passes=tuple(passes), optimize=OptimizeOptions(check_first_step=True)))
    batch = case.batch
    s_a, s_b = case.init_state(0), case.init_state(0)
    for k in range(3):  # bitwise equality needs a reproducible reference
        s_a, m_a = step(s_a, batch)
        s_b, m_b = step(s_b, batch)
        bad = _bitwise_diff((s_a, m_a), (s_b, m_b))
        assert not bad, (f"plain jax.jit is not reproducible here (step {k}: {bad[:3]}); run with "
                         "XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true")
    s_ref, s_opt = case.init_state(0), case.init_state(0)
    jax.effects_barrier()
    n_seen = len(seen) if seen is not None else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            s_ref, m_ref = step(s_ref, batch)
            s_opt, m_opt = opt(s_opt, batch)
            bad = _bitwise_diff((s_opt, m_opt), (s_ref, m_ref))
            assert not bad, f"step {k}: differs from plain jax.jit: {bad[:5]}"
    jax.effects_barrier()
    fb = [str(w.message) for w in caught if issubclass(w.category, ConcertoFallbackWarning)]
    rep = opt.report()
    assert not fb and rep.optimized and rep.executable.startswith(f"backend-only ({backend}"), \
        f"the route was not used: {fb or rep.fallback_reason}"
    if seen is not None:
        assert len(seen) - n_seen == 6, f"the callback fired {len(seen) - n_seen} times in 6 steps"
    entry = opt._cache[opt._last_key]
    loaded_text = jax_compat.executable_text(jax_compat.xla_executable(entry.runner))
    kept = route.order_kept(entry.emitted, loaded_text)
    # (XLA:CPU reorders what it compiles: only a GPU backend keeps the handed order)
    assert kept["kept"] or backend != "gpu", f"the loaded executable does not run our order: {kept}"
    sched = next((p for p in rep.passes if p.name == "schedule"), None)
    timed = "5x4"
    med = interleaved_step_us({"plain": step, "ours": opt}, case)
    if med["ours"] > STEP_TIME_LIMIT * med["plain"]:
        # 5 blocks of 4 steps of a ~1 ms step cannot hold 3 % (a run on an H200 timed XLA's own
        # order through the route at 1.049x): a step over the limit is timed again, longer, and
        # that timing is the verdict's
        first = med["ours"] / med["plain"]
        med = interleaved_step_us({"plain": step, "ours": opt}, case, rounds=9, per=10)
        timed = f"9x10, re-timed after {first:.3f}x over 5x4"
    if ratios is not None:
        ratios[name] = med["ours"] / med["plain"]
    return (f"3 steps bitwise; order kept {kept['in_our_order']}/{kept['common']}; schedule changed="
            f"{sched.changed if sched else None}; step us (median of {timed}, interleaved): plain "
            f"{med['plain']:.0f}, ours {med['ours']:.0f} (ours/plain {med['ours'] / med['plain']:.3f}); "
            f"{rep.first_step_check}; stages {json.dumps(rep.stage_seconds)}")


STEP_TIME_LIMIT = 1.03
"""Item a's speed criterion: ``optimize`` on every 1-GPU step within this factor of plain
``jax.jit``'s step time (none of them has a collective to overlap: the route must cost nothing)."""


def step_time_verdict(ratios: dict) -> str:
    """Pass when every item-a step ran within ``STEP_TIME_LIMIT`` of plain ``jax.jit``."""
    if not ratios:
        raise _Skip("no item-a step was timed")
    words = ", ".join(f"{k} {v:.3f}x" for k, v in sorted(ratios.items()))
    slow = {k: v for k, v in ratios.items() if v > STEP_TIME_LIMIT}
    assert not slow, f"slower than plain jax.jit by more than {STEP_TIME_LIMIT:g}x: {words}"
    return f"ours / plain: {words} (limit {STEP_TIME_LIMIT:g}x)"


def interleaved_step_us(fns: dict, case, rounds: int = 5, per: int = 4) -> dict:
    """Median microseconds per step of each of ``fns`` (``{name: step}``), timed in ``rounds``
    interleaved blocks of ``per`` steps from the case's initial state (donation-safe: each
    block carries its state on)."""
    states = {k: case.init_state(0) for k in fns}
    times: dict = {k: [] for k in fns}
    for k, fn in fns.items():  # warm: the first call of each is not timed
        states[k], m = fn(states[k], case.batch)
        jax.block_until_ready((states[k], m))
    for _ in range(rounds):
        for k, fn in fns.items():
            s = states[k]
            t0 = time.perf_counter()
            for _ in range(per):
                s, m = fn(s, case.batch)
            jax.block_until_ready((s, m))
            times[k].append((time.perf_counter() - t0) / per * 1e6)
            states[k] = s
    return {k: statistics.median(v) for k, v in times.items()}


def perturbed_check(step, case) -> str:
    """Item a with a deliberately different legal order: it must be the loaded module's and the
    results must stay bitwise equal."""
    class Perturbed(route.GpuBackend):
        def plan(self, stock, options):
            p = super().plan(stock, options)
            text = perturbed_order(p.handed)
            return route.Plan(text, p.replicated, p.passes, route._sha(text))

    opts = Options(cache_dir=None, passes=())
    built = route.build(step, (case.init_state(0), case.batch), {}, opts, Perturbed())
    xla_order = route.entry_order(built.stock.scheduled)
    ours = route.entry_order(built.plan.handed)
    if ours == xla_order:
        raise _Skip("the entry has a single legal order")
    loaded = jax_compat.executable_text(jax_compat.xla_executable(built.compiled))
    kept = route.order_kept(built.plan.handed, loaded)
    assert kept["kept"], f"the loaded executable does not run the handed order: {kept}"
    s_ref, s_opt = case.init_state(0), case.init_state(0)
    for k in range(3):
        s_ref, m_ref = step(s_ref, case.batch)
        s_opt, m_opt = built.compiled(s_opt, case.batch)
        bad = _bitwise_diff((s_opt, m_opt), (s_ref, m_ref))
        assert not bad, f"step {k}: differs: {bad[:5]}"
    moved = sum(a != b for a, b in zip(ours, xla_order, strict=False))
    return f"{moved} entry positions differ from XLA's order; kept in the loaded module; 3 steps bitwise"


def probe_subprocess(code: str, timeout_s: float) -> str:
    """Run ``code`` in a fresh Python and report what happened, an abort included (the probes
    of the raw runtime: our route never hands it such bytes, its own checks refuse them first).
    FAIL only where the probe could not set itself up (it prints ``SETUP FAILED``)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                       cwd=os.getcwd())
    lines = (r.stdout + r.stderr).strip().splitlines()
    if any(ln.startswith("SETUP FAILED") for ln in lines):
        raise AssertionError(" | ".join(ln for ln in lines if ln.startswith("SETUP FAILED"))[:400])
    said = [ln for ln in lines if ln.startswith("RUNTIME")]
    if r.returncode != 0:
        said.append(f"the runtime ended the process (exit {r.returncode}; negative: signal): "
                    + " | ".join(lines[-2:])[:200])
    return " | ".join(said)[:500]


_PROBE_SETUP = r'''
try:
    import dataclasses
    from importlib import resources
    import jax, jax.numpy as jnp
    import concerto_jax
    from concerto_jax import jax_compat
    from concerto_jax.gpu_route import route
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    built = route.build(f, (jnp.ones((64, 64)),), {}, concerto_jax.Options(cache_dir=None, passes=()),
                               route.GpuBackend())
    dev = built.stock.device_list
    client = dev[0].client
    header = jax_compat.step_header(jax_compat.xla_executable(built.stock.compiled))
except Exception as e:
    print("SETUP FAILED", type(e).__name__, str(e).splitlines()[0][:200]); raise SystemExit(0)
'''

_PROBE_NO_HEADER = _PROBE_SETUP + r'''
try:
    client.deserialize_executable(built.payload.data, jax_compat.device_list(dev))
    print("RUNTIME loaded PJRT bytes without a header")
except Exception as e:
    print("RUNTIME raised for bytes without a header:", type(e).__name__, str(e).splitlines()[0][:150])
'''

_PROBE_COMPUTE_CAPABILITY = _PROBE_SETUP + r'''
try:
    t = route.device_target(dev)
    other = "a100_sxm_80.txtpb" if t.compute_capability != "8.0" else "h100_sxm.txtpb"
    text = resources.files("concerto_jax").joinpath("gpu_configs", other).read_text()
    bad = dataclasses.replace(t, config_text=text, compute_capability=route.config_compute_capability(text))
    p = route.compile_payload(built.plan.handed, bad, 1, replicated=False)
except Exception as e:
    print("SETUP FAILED", type(e).__name__, str(e).splitlines()[0][:200]); raise SystemExit(0)
try:
    client.deserialize_executable(header + p.data, jax_compat.device_list(dev))
    print(f"RUNTIME loaded an executable for compute capability {bad.compute_capability} on "
          f"{t.compute_capability}")
except Exception as e:
    print("RUNTIME raised for another compute capability:", type(e).__name__, str(e).splitlines()[0][:150])
'''


def gpu_negative_checks(run: Run) -> None:
    f = jax.jit(lambda x, y: (jnp.tanh(x @ y), x.sum()))

    def make_args(seed=0):
        k1, k2 = jax.random.split(jax.random.key(seed))
        return jax.random.normal(k1, (128, 128)), jax.random.normal(k2, (128, 128))

    run.check("b/through_optimize", lambda: negative_checks(
        f, make_args, Options(cache_dir=None, passes=("schedule",)), route.GpuBackend), needs_s=30)

    def two_devices() -> str:  # a payload for 2 GPUs of this kind, refused on 1
        dev = jax.devices()[0]
        built = route.build(f, make_args(0), {}, Options(cache_dir=None, passes=()), route.GpuBackend())
        t = dataclasses.replace(route.device_target([dev]), num_devices=2, topology="1x1x2")
        try:
            p = route.compile_payload(built.plan.handed, t, 2, replicated=True)
        except Exception as e:  # noqa: BLE001
            raise _Skip(f"no 2-device payload of this module: {type(e).__name__}") from e
        try:
            route.load_payload(built.stock.compiled, p)
        except route.LoadRefused as e:
            return f"refused: {e}"[:200]
        raise AssertionError("a 2-device payload was loaded on 1 device")

    run.check("b/device_count", two_devices, needs_s=20)
    def compute_capability() -> str:  # our check refuses an executable built for another GPU
        dev = jax.devices()[0]
        t = route.device_target([dev])
        other = "a100_sxm_80.txtpb" if t.compute_capability != "8.0" else "h100_sxm.txtpb"
        text = resources.files("concerto_jax").joinpath("gpu_configs", other).read_text()
        bad = dataclasses.replace(t, config_text=text,
                                  compute_capability=route.config_compute_capability(text))
        built = route.build(f, make_args(0), {}, Options(cache_dir=None, passes=()), route.GpuBackend())
        p = route.compile_payload(built.plan.handed, bad, 1, replicated=False)
        try:
            route.load_payload(built.stock.compiled, p)
        except route.LoadRefused as e:
            return f"refused: {e}"[:200]
        raise AssertionError("an executable for another compute capability was loaded")

    run.check("b/compute_capability", compute_capability, needs_s=20)
    for name, code in (("b/runtime_no_header", _PROBE_NO_HEADER),
                       ("b/runtime_compute_capability", _PROBE_COMPUTE_CAPABILITY)):
        run.check(name, lambda code=code: probe_subprocess(code, timeout_s=max(30, min(90, run.left_s() - 5))),
                  needs_s=40)


@dataclasses.dataclass
class Prepared:
    """One suite case's modules for calibration: XLA's scheduled module of stock and ours,
    collectives stood in, with the model's predictions for the target GPU of the case."""

    case: str
    cluster: str
    stock: str
    ours: str
    passes: list
    meta: dict


def _jax_version() -> str:
    return jax.__version__


def prepare(out_dir: str, cases: Sequence, passes: Sequence[str], run: Run | None = None) -> list[str]:
    """Write ``<case>.stock.hlo.gz``, ``<case>.ours.hlo.gz`` and ``<case>.json`` for each case
    (the deviceless compile stages; stock = XLA's scheduled module of the step, ours = the
    module the route hands to the backend); ``standin_collectives`` runs where they are used."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for case in cases:
        def one(case=case) -> str:
            d = deviceless_case(case, passes, fast=True)
            stock_src = d.stock.scheduled_text or d.stock.after_lhs_text
            detail = check_deviceless(d, case)
            sc = standin_collectives(stock_src)[1]
            oc = standin_collectives(d.plan.handed)[1]
            # the modules as the backend gets them (collectives are stood in where they are used)
            # *_post: the modules before XLA's pipeline (the post-SPMD module; ours rewritten where
            # the rewrite was kept), for a GPU to compile with its autotuning (``calibrate_case``)
            post = d.stock.post_spmd_text
            for suffix, text in (("stock", stock_src), ("ours", d.plan.handed), ("stock_post", post),
                                 ("ours_post", d.plan.rewritten or post)):
                if text is None:
                    continue
                with gzip.open(os.path.join(out_dir, f"{case.name}.{suffix}.hlo.gz"), "wt") as f:
                    f.write(text)
            meta = {"case": case.name, "cluster": case.cluster, "passes": list(passes),
                    "changed": [r.name for r in d.plan.passes if r.changed], "stood_in": {"stock": sc, "ours": oc},
                    "replicated": d.plan.replicated, "jax": _jax_version()}
            with open(os.path.join(out_dir, f"{case.name}.json"), "w") as f:
                json.dump(meta, f, indent=1)
            written.append(case.name)
            return detail + f"; stood in {sum(sc.values())} / {sum(oc.values())} collectives"

        if run is not None:
            run.check(f"deviceless/{case.name}", one, needs_s=60)
        else:
            one()
    return written


def validate_prepared(prepared_dir: str, run: Run, kind: str = "NVIDIA H100 80GB HBM3") -> None:
    """Compile every prepared module backend-only for one GPU of ``kind`` (deviceless, the
    calibration's options) and cost its final module: what item c does before it runs them."""
    device = types.SimpleNamespace(id=0, device_kind=kind, compute_capability="9.0", core_count=None,
                                   process_index=0)
    target = route.device_target([device])
    for meta_file in sorted(f for f in os.listdir(prepared_dir) if f.endswith(".json")):
        name = meta_file[:-5]

        def one(name=name) -> str:
            with open(os.path.join(prepared_dir, f"{name}.json")) as f:
                meta = json.load(f)
            words = []
            for program in ("stock", "ours"):
                with gzip.open(os.path.join(prepared_dir, f"{name}.{program}.hlo.gz"), "rt") as f:
                    text, _ = standin_collectives(f.read())
                p = route.compile_payload(text, target, 1, replicated=False,
                                                 env={"xla_gpu_enable_command_buffer": ""})
                pred, _, step_us = _predictions(p.final_text, CostModel(get_cluster(meta["cluster"])))
                params, results = _split_layout(route.jax_compat.entry_layout_of_text(p.final_text))
                words.append(f"{program}: {len(pred)} kernels, {step_us:.0f} us predicted, "
                             f"{len(params)} params -> {len(results)} results")
            return "; ".join(words)

        run.check(f"prepared/{name}", one)


_KERNEL_COLUMNS = ("case", "program", "modules", "instruction", "class", "predicted_us", "measured_us", "launches",
                   "executions",
                   "mm_peak_us", "vector_us", "mem_peak_us", "model_kernels", "dtype")
_CALIBRATION_COLUMNS = ("case", "program", "modules", "predicted_step_us", "measured_step_us", "error",
                        "measured_step_cmdbuf_us", "kernels_mapped", "kernels_unmapped", "standins")


def kernel_class(inst) -> str:
    """A kernel's class for the error table: gemm, conv, reduction fusion, loop fusion, custom
    call, copy, other."""
    op = inst.opcode
    text = json.dumps({k: str(v) for k, v in inst.attrs.items()})[:2000]
    if op == "custom-call":
        target = inst.custom_call_target or ""
        return "gemm" if "gemm" in target.lower() or "matmul" in target.lower() else "custom_call"
    if op == "fusion":
        if ("__triton" in text and "gemm" in text) or "cublas" in text.lower() or "__cudnn$fusion" in text:
            return "gemm"  # Triton GEMM fusions (``__triton_gemm``, ``__triton_nested_gemm_fusion``), cuDNN's
        if "kind=kInput" in text or "kInput" in text:
            return "reduction_fusion"
        if "kCustom" in text:
            return "custom_fusion"
        return "loop_fusion"
    if op in ("dot",):
        return "gemm"
    if op == "convolution":
        return "conv"
    if op == "copy":
        return "copy"
    return op


def _predictions(final_text: str, cost_model, work: dict | None = None) -> tuple[dict, dict, float]:
    """``({instruction: predicted us}, {instruction: class}, predicted step us)`` of a final module;
    ``work`` (if given) receives ``{instruction: {mm_peak_us, vector_us, mem_peak_us,
    model_kernels, dtype}}``: the roofline terms at full efficiency, for refitting the model's rates."""
    module = parse_module(final_text, source="final")
    pred, cls = {}, {}
    gpu = cost_model.gpu
    skip = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier", "while",
            "conditional", "call"}
    for comp in schedulable_computations(module):  # the computations whose instructions launch kernels
        for inst in comp.instructions:
            if inst.opcode in skip:
                continue
            try:
                op = op_info(inst)
                pred[inst.name] = cost_model.compute_us(op)
            except Exception:  # noqa: BLE001 - an instruction the model cannot cost
                continue
            cls[inst.name] = kernel_class(inst)
            if work is not None:
                try:
                    w = work_of(op)
                    work[inst.name] = {
                        "mm_peak_us": round(1e6 * sum(f / gpu.matmul_flops_per_s(d) for d, f in w.matmul_flops), 3),
                        "vector_us": round(1e6 * w.vector_flops / gpu.vector_flops_per_s("f32"), 3),
                        "mem_peak_us": round(1e6 * w.bytes / gpu.hbm_bytes_per_s, 3),
                        "model_kernels": kernel_count(op),
                        # the tensor-core dtype (GEMM rates differ by it: TF32 against bf16)
                        "dtype": "+".join(sorted(d for d, _ in w.matmul_flops))}
                except Exception:  # noqa: BLE001 - the row keeps its prediction without the terms
                    pass
    return pred, cls, judge_module(final_text, cost_model).us


def _dummy_step(entry_layout: str, device):
    """A jitted function with the parameter and result shapes of ``entry_layout`` on ``device``
    (its header and calling convention carry the stood-in module)."""
    params_text, result_text = _split_layout(entry_layout)

    def parse(s):
        m = re.match(r"([a-z0-9]+)\[([^\]]*)\]", s)
        dims = tuple(int(d) for d in m.group(2).split(",") if d.strip())
        return _DTYPES[m.group(1)], dims

    params = [parse(p) for p in params_text]
    results = [parse(r) for r in result_text]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def f(*args):
        return tuple(jnp.zeros(s, d) for d, s in results)

    abstract = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for d, s in params]
    compiled = jax.jit(f, keep_unused=True, out_shardings=sharding).lower(*abstract).compile()

    def make_inputs(seed=0):
        rng = np.random.default_rng(seed)
        out = []
        for d, s in params:
            if jnp.issubdtype(d, jnp.floating):
                out.append(jax.device_put((rng.standard_normal(s) * 0.02).astype(d), device))
            else:
                out.append(jax.device_put(np.zeros(s, d), device))
        return out

    return compiled, make_inputs


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s32": "int32",
           "u32": "uint32", "s64": "int64", "u64": "uint64", "s8": "int8", "u8": "uint8", "pred": "bool",
           "s16": "int16", "u16": "uint16"}


def _split_layout(layout: str) -> tuple[list[str], list[str]]:
    """Array shape texts of an ``entry_computation_layout`` body: (parameters, results)."""
    depth, arrow = 0, None
    for i, c in enumerate(layout):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "-" and layout[i:i + 2] == "->" and depth == 0:
            arrow = i
            break
    params, result = layout[:arrow], layout[arrow + 2:]

    def arrays(s):
        return re.findall(r"[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?", s)

    return arrays(params), arrays(result)


def calibrate_case(prepared_dir: str, case_name: str, out_dir: str, iters: int = 20,
                   tuned: bool = True) -> tuple[list, list]:
    """Item c for one prepared case on the first GPU: (kernel rows, calibration rows).

    ``tuned`` (where the prepared ``*_post`` modules exist): the modules are XLA's scheduled
    modules compiled here, with this GPU's autotuning, from the modules before XLA's pipeline
    (XLA's order, compute only); else the prepared deviceless scheduled modules (default GEMM
    configurations: what a deviceless compile picks, not what a GPU runs)."""
    device = jax.devices()[0]
    target = route.device_target([device])
    with open(os.path.join(prepared_dir, f"{case_name}.json")) as f:
        meta = json.load(f)
    cluster = get_cluster(meta["cluster"])
    cost_model = CostModel(cluster, gpu=gpu_spec_from_target_config(target.config_text, fallback=cluster.gpu))
    env = {"xla_gpu_enable_command_buffer": ""}  # one profiler event per kernel (no CUDA graphs)
    kernels, steps = [], []
    for program in ("stock", "ours"):
        post_file = os.path.join(prepared_dir, f"{case_name}.{program}_post.hlo.gz")
        if tuned and os.path.exists(post_file):
            # XLA's whole pipeline on this GPU (its autotuning picks the GEMM and convolution
            # configurations) on the module before XLA's pipeline, collectives stood in: a
            # deviceless compile cannot autotune, its default GEMM tiles run slower.
            with gzip.open(post_file, "rt") as f:
                post, _ = standin_collectives(f.read())
            try:
                # XLA's defaults here, not the run's deterministic-ops flag (item a's bitwise checks)
                text = route._require_scheduled(compile_replicated_for_target(
                    post, [device], {"xla_gpu_exclude_nondeterministic_ops": False}, after_lhs=True)[3])
                modules = "tuned"
            except Exception as e:  # noqa: BLE001 - the deviceless modules still calibrate the rest
                log.warning("%s %s: XLA's pipeline on this GPU failed (%s); the deviceless module is timed",
                            case_name, program, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                tuned = False
        if not (tuned and os.path.exists(post_file)):
            with gzip.open(os.path.join(prepared_dir, f"{case_name}.{program}.hlo.gz"), "rt") as f:
                text, _ = standin_collectives(f.read())
            modules = "deviceless"
        try:
            payload = route.compile_payload(text, target, 1, replicated=False, env=env)
        except Exception as e:  # noqa: BLE001 - the option refused: command buffers stay on
            log.warning("%s %s: compile with %s failed (%s); compiling with XLA's defaults", case_name,
                        program, env, str(e).splitlines()[0][:200])
            env = {}
            payload = route.compile_payload(text, target, 1, replicated=False)
        layout = jax_compat.entry_layout_of_text(payload.final_text)
        dummy, make_inputs = _dummy_step(layout, device)
        if jax_compat.entry_layout(jax_compat.xla_executable(dummy)) != layout:
            raise RuntimeError(f"{program}: the stand-in's entry layout is not the default one")
        run, inputs, step_us = _timed_step(dummy, payload, make_inputs, env, iters)
        profile_dir = os.path.join(out_dir, "profile", f"{case_name}.{program}")
        with jax.profiler.trace(profile_dir):
            for _ in range(3):
                jax.block_until_ready(run(*inputs))
        measured = kernel_times(profile_dir, runs=3)
        work: dict = {}
        pred, cls, pred_step = _predictions(payload.final_text, cost_model, work)
        mapped = 0
        for kernel, (us, launches, executions) in sorted(measured.items()):
            name = instruction_of(kernel, pred)
            if name in pred:
                mapped += 1
            kernels.append({"case": case_name, "program": program, "modules": modules, "instruction": name,
                            "class": cls.get(name, "unmapped"), "predicted_us": round(pred.get(name, float("nan")), 2),
                            "measured_us": round(us, 2), "launches": launches, "executions": executions,
                            **work.get(name, {})})
        cmdbuf_us = _step_us_with_xla_defaults(text, target, dummy, make_inputs, iters) if env else None
        steps.append({"case": case_name, "program": program, "modules": modules,
                      "predicted_step_us": round(pred_step, 1),
                      "measured_step_us": round(step_us, 1),
                      "measured_step_cmdbuf_us": round(cmdbuf_us, 1) if cmdbuf_us else "",
                      "error": round((pred_step - step_us) / step_us, 3) if step_us else "",
                      "kernels_mapped": mapped, "kernels_unmapped": len(measured) - mapped,
                      "standins": sum(meta["stood_in"][program].values())})
    return kernels, steps


def _timed_step(dummy, payload, make_inputs, env: dict, iters: int) -> tuple:
    """``payload`` loaded behind ``dummy``'s header and run once, then ``iters`` timed steps:
    ``(the step, its inputs, median microseconds)``."""
    loaded = route.load_payload(dummy, payload, env=env)
    run = jax_compat.swapped_step(dummy, loaded, assemble_outputs=False)
    inputs = make_inputs()
    jax.block_until_ready(run(*inputs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*inputs))
        times.append((time.perf_counter() - t0) * 1e6)
    return run, inputs, statistics.median(times)


def _step_us_with_xla_defaults(text: str, target, dummy, make_inputs, iters: int) -> float | None:
    """Median step microseconds of ``text`` compiled with XLA's defaults (command buffers on, as
    a user runs it), or None where that compile or run fails (logged): the step time the
    calibration's per-kernel cost outside kernels is meant for."""
    try:
        payload = route.compile_payload(text, target, 1, replicated=False, env={})
        return _timed_step(dummy, payload, make_inputs, {}, iters)[2]
    except Exception as e:  # noqa: BLE001 - the column stays empty; the rest of the case stands
        log.warning("step with XLA's defaults not timed: %s: %s", type(e).__name__, str(e)[:200])
        return None


def instruction_of(kernel: str, instructions) -> str:
    """The HLO instruction a profiled kernel belongs to: its ``hlo_op`` as is, or XLA's kernel
    name of it ('.' and '-' written '_'); the kernel's own name when neither matches."""
    if kernel in instructions:
        return kernel
    norm = {n.replace(".", "_").replace("-", "_"): n for n in instructions}
    return norm.get(kernel.replace(".", "_").replace("-", "_"), kernel)


def kernel_times(profile_dir: str, runs: int) -> dict[str, tuple[float, int, int]]:
    """``{HLO instruction: (device microseconds per run, kernels launched per run, executions per
    run)}`` of the GPU kernels in a profile (the kernel's ``hlo_op`` stat, else its name).

    One execution of an instruction may launch several kernels (cuBLAS: a memset and the GEMM;
    a split-K GEMM and its reduction): executions per run count the launches of the
    instruction's longest kernel (one per execution outside a loop, the trip count inside one),
    the unit the model prices (``predicted_us`` is per execution)."""
    paths = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no .xplane.pb under {profile_dir}")
    data = jax_compat.profile_data_from_file(sorted(paths)[-1])
    out: dict[str, dict[str, list]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() and "kernel" not in line.name.lower():
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op") or ev.name
                t = out.setdefault(str(op), {}).setdefault(ev.name, [0.0, 0])
                t[0] += ev.duration_ns / 1e3
                t[1] += 1
    runs = max(runs, 1)
    result = {}
    for op, by_kernel in out.items():
        main = max(by_kernel.values(), key=lambda v: v[0])
        result[op] = (sum(v[0] for v in by_kernel.values()) / runs,
                      sum(v[1] for v in by_kernel.values()) // runs, max(main[1] // runs, 1))
    return result


def class_errors(kernels: Sequence[dict]) -> list[dict]:
    """Per program and kernel class: kernels, predicted and measured sums, relative error."""
    agg: dict[tuple, list] = {}
    for k in kernels:
        if k["class"] == "unmapped" or not isinstance(k["predicted_us"], float) or math.isnan(k["predicted_us"]):
            continue
        a = agg.setdefault((k["program"], k["class"]), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += k["predicted_us"] * max(int(k.get("executions") or 1), 1)  # per execution, not per kernel
        a[2] += k["measured_us"]
    return [{"program": p, "class": c, "kernels": n, "predicted_us": round(pu, 1), "measured_us": round(mu, 1),
             "error": round((pu - mu) / mu, 3) if mu else ""} for (p, c), (n, pu, mu) in sorted(agg.items())]


def gpu_half(run: Run, prepared: str | None, cases: Sequence, passes: Sequence[str],
             items: Sequence[str] = ("a", "b", "c")) -> str:
    device = jax.devices()[0]
    run.check("target_config", lambda: json.dumps(dataclasses.asdict(dataclasses.replace(
        route.device_target([device]), config_text="..."))))
    if "a" in items:
        steps, seen = gpt_steps([device])
        ratios: dict = {}
        for name, (step, case) in steps.items():
            run.check(f"a/{name}", lambda step=step, case=case, name=name: route_check(
                name, step, case, passes, seen if name.endswith("callback") else None, ratios=ratios),
                needs_s=25)
        run.check("a/step_time", lambda: step_time_verdict(ratios))
        f32_step, f32_case = steps["gpt_f32"]
        run.check("a/perturbed_order", lambda: perturbed_check(f32_step, f32_case), needs_s=25)
    if "b" in items:
        gpu_negative_checks(run)
    md = ""
    if "c" not in items:
        return md
    if prepared is None or not os.path.isdir(prepared):
        run.skip("c/calibration", f"no prepared modules ({prepared!r}); make them on a CPU machine with "
                                  "`python -m concerto_jax.gpu_check --prepare DIR` and pass --prepared DIR")
        return md
    kernels, calib = [], []
    # the smaller modules first: within the budget, as many cases as possible
    names = sorted((f[:-5] for f in os.listdir(prepared) if f.endswith(".json")),
                   key=lambda n: os.path.getsize(os.path.join(prepared, f"{n}.stock.hlo.gz")))
    wanted = {c.name for c in cases}
    for name in [n for n in names if n in wanted]:
        def one(name=name) -> str:
            k, s = calibrate_case(prepared, name, run.out)
            kernels.extend(k)
            calib.extend(s)
            _write_calibration(run.out, kernels, calib)
            stock, ours = (next(r for r in s if r["program"] == p) for p in ("stock", "ours"))
            return (f"{stock['modules']}/{ours['modules']} modules; compute-only step: stock "
                    f"{stock['measured_step_us']} us measured / "
                    f"{stock['predicted_step_us']} predicted, ours {ours['measured_step_us']} / "
                    f"{ours['predicted_step_us']}; kernels mapped {stock['kernels_mapped']}+{ours['kernels_mapped']}")
        run.check(f"c/{name}", one, needs_s=60)
    return _write_calibration(run.out, kernels, calib)


def _write_calibration(out: str, kernels: Sequence[dict], calib: Sequence[dict]) -> str:
    """Item c's tables so far: kernels.csv, calibration.csv, kernel_classes.csv, calibration.md."""
    write_csv(os.path.join(out, "kernels.csv"), kernels, _KERNEL_COLUMNS)
    write_csv(os.path.join(out, "calibration.csv"), calib, _CALIBRATION_COLUMNS)
    errors = class_errors(kernels)
    write_csv(os.path.join(out, "kernel_classes.csv"), errors,
              ("program", "class", "kernels", "predicted_us", "measured_us", "error"))
    md = ("## Calibration (compute only: collectives stood in)\n\n" + markdown_table(calib, _CALIBRATION_COLUMNS)
          + "\n\n## Cost-model error per kernel class\n\n"
          + markdown_table(errors, ("program", "class", "kernels", "predicted_us", "measured_us", "error")))
    with open(os.path.join(out, "calibration.md"), "w") as f:
        f.write(md + "\n")
    return md


# -- main -----------------------------------------------------------------------------------------

def _select(names: str):
    # lazy: bench/ and models/ are not installed; only a run from the repository root imports them
    from bench import suite

    if names == "all":
        return list(suite.SUITE)
    if names == "quick":
        return [suite.get_case(n) for n in CPU_CASES]
    return [suite.get_case(n) for n in names.split(",") if n]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m concerto_jax.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for checks.csv/.md (and calibration, profiles)")
    ap.add_argument("--prepare", metavar="DIR", default=None,
                    help="CPU machine: write the calibration modules of --cases into DIR and exit")
    ap.add_argument("--prepared", metavar="DIR", default=None, help="GPU machine: the modules of --prepare")
    ap.add_argument("--validate", metavar="DIR", default=None,
                    help="CPU machine: compile the modules of --prepare for one GPU, deviceless, and exit")
    ap.add_argument("--cases", default=None,
                    help="suite cases: 'all', 'quick', or names (default: all with --prepare or on a "
                         "GPU, quick on a CPU)")
    ap.add_argument("--passes", default="decompose,schedule", help="the route's passes (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"stop starting checks when this is spent (default {DEFAULT_BUDGET_S:g}; "
                         "with --prepare, none)")
    ap.add_argument("--items", default="a,b,c",
                    help="GPU half: which items to run, of a (route), b (negative cases), c (calibration); "
                         "default: %(default)s")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    items = tuple(i for i in args.items.split(",") if i)
    if set(items) - {"a", "b", "c"}:
        ap.error(f"--items takes a comma-separated subset of a,b,c; got {args.items!r}")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "concerto_jax.scheduler", "concerto_jax.deviceless", "concerto_jax.pipeline"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts (the CPU rehearsal)
    except RuntimeError as e:  # backends already started (called from Python): keep theirs
        log.debug("jax_num_cpu_devices not set: %s", e)
    on_gpu = jax.default_backend() == "gpu"
    passes = tuple(p for p in args.passes.split(",") if p)
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.prepare or args.validate else DEFAULT_BUDGET_S)
    run = Run(args.out, budget)
    cases = _select(args.cases if args.cases is not None else ("all" if args.prepare or on_gpu else "quick"))
    if args.validate:
        validate_prepared(args.validate, run)
        run.write()
        return _verdict(run)
    if args.prepare:
        prepare(args.prepare, cases, passes, run)
        validate_prepared(args.prepare, run)
        run.write()
        return _verdict(run)
    log.info("gpu_check on %s; results under %s", _environment_line(), args.out)
    md = ""
    if not gpu_plugin_available():
        run.skip("deviceless", "the CUDA PJRT plugin is not installed")
    elif on_gpu:
        run.skip("deviceless", "done by --prepare on a CPU machine (its modules: --prepared)")
    else:
        for case in cases:
            run.check(f"deviceless/{case.name}", lambda case=case: check_deviceless(
                deviceless_case(case, passes), case), needs_s=60)
    if on_gpu:
        md = gpu_half(run, args.prepared, cases, passes, items)
    else:
        rehearsal_checks(run)
        for item, what in (("a", "the full route on 1-device GPT train steps"),
                           ("b", "the negative cases on the real GPU client"),
                           ("c", "kernel calibration on the GPU")):
            run.skip(f"{item}/gpu", f"{what}: no GPU here (backend {jax.default_backend()})")
    run.write(md)
    return _verdict(run)


def _verdict(run: Run) -> int:
    failed = [r["check"] for r in run.rows if r["status"] == "FAIL"]
    passed = sum(r["status"] == "pass" for r in run.rows)
    log.info("%d passed, %d failed, %d skipped; %s", passed, len(failed), len(run.rows) - passed - len(failed),
             os.path.join(run.out, "checks.md"))
    return 1 if failed else 0

