"""Baseline: stock XLA's GPU schedule of each suite case, simulated with our cost model.

For each case: build the train step on a deviceless mesh of the target
cluster, compile it with XLA's GPU compiler (LHS on), parse XLA's final
scheduled module, build the costed task graph and simulate

* ``xla``: XLA's own order (async collectives where XLA made them async);
* ``sync``: the same graph in the same order with every collective
  synchronous (program order, no overlap);
* ``pre_lhs``: the order of the module LHS received (memory scheduler order),
  async pairs as they are there;
* optionally ``pgle``: XLA recompiled with a PGLE profile written from our
  cost model (so LHS plans with our costs), simulated likewise;

and the lower bound ``max(total compute, total communication, critical path)``.
Every number in the tables is computed by the run that writes them.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Sequence

from bench import suite
from bench.suite import BenchCase

log = logging.getLogger(__name__)

COLUMNS = ("case", "status", "model", "layout", "cluster", "mesh", "tasks", "collectives", "compile_s",
           "lhs_ran", "xla_step_us", "sync_step_us", "pre_lhs_step_us", "pgle_step_us",
           "windowed_einsum_step_us", "windowed_einsum_changed_module", "lower_bound_us",
           "critical_path_us", "total_compute_us", "total_comm_us", "xla_exposed_comm_us",
           "xla_exposed_comm_pct", "xla_overlap_pct", "xla_speedup_vs_sync", "xla_gap_to_bound_pct",
           "xla_peak_mem_mib", "overlap_slowdown", "note")


@dataclasses.dataclass(frozen=True)
class BaselineOptions:
    """How the baseline runs.

    Attributes:
      out_dir: where CSV, markdown, trace and Gantt go.
      pgle: also compile with a PGLE profile from our cost model and simulate it.
      windowed_einsum: also compile with windowed einsum on (threshold 0 MiB) and simulate it.
      trace_case: case whose XLA schedule is exported as Perfetto trace + Gantt PNG (None: first run).
      prefix: file-name prefix of the results.
    """

    out_dir: str = "bench/results"
    pgle: bool = False
    windowed_einsum: bool = False
    trace_case: str | None = None
    prefix: str = "baseline"


def _config(spec, case: BenchCase):
    import jax.numpy as jnp

    name = case.config or next(k for k in spec.presets if k != "tiny")
    cfg = spec.config(name)
    fields = {f.name for f in dataclasses.fields(cfg)}
    repl = {k: v for k, v in case.overrides if k in fields}
    if case.dtype is not None and "dtype" in fields:
        repl["dtype"] = getattr(jnp, case.dtype)
    return name, dataclasses.replace(cfg, **repl)


@dataclasses.dataclass(frozen=True)
class CompiledCase:
    """A suite case compiled deviceless for its cluster (``compile_case``)."""

    preset: str  # model preset the config was derived from
    config: object  # the model config (preset with the case's overrides)
    cluster: object  # concerto_jax.costmodel.Cluster
    cost_model: object  # CostModel of that cluster (default options)
    lowered: object  # the lowered train step (recompile it with other XLA options)
    compiled: object  # concerto_jax.deviceless.TargetCompile (final text, LHS dumps)


def model_case(case: BenchCase):
    """``case``'s train step (a ``models.Case``, abstract state/batch) on a deviceless mesh of its
    cluster, with its preset name and config."""
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless import topology
    from models.layouts import make_mesh
    from models.registry import MODELS, make_case

    cluster = get_cluster(case.cluster)
    devices = sorted(topology(cluster).devices, key=lambda d: d.id)
    mesh = make_mesh(case.layout, case.mesh_shape, devices=devices)
    preset, cfg = _config(MODELS[case.model], case)
    return make_case(case.model, case.layout, cfg, mesh=mesh), preset, cfg


def compile_case(case: BenchCase) -> CompiledCase:
    """Build ``case``'s train step on a deviceless mesh of its cluster and compile it with LHS dumps."""
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.deviceless import CompileOptions, compile_lowered

    cluster = get_cluster(case.cluster)
    mcase, preset, cfg = model_case(case)
    lowered = mcase.lower()
    tc = compile_lowered(lowered, cluster, CompileOptions(dump_lhs=True, extra=case.xla_options))
    return CompiledCase(preset, cfg, cluster, CostModel(cluster), lowered, tc)


def _simulate_text(text: str, cost_model):
    from concerto_jax.hlo_taskgraph import build_taskgraph
    from concerto_jax.simulator import SimOptions, simulate
    from hlo_passes.ir.parser import parse_module

    built = build_taskgraph(parse_module(text), cost_model)
    opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown)
    return built, simulate(built.graph, built.events, opts)


def _strip_names(text: str) -> str:
    """Module text without metadata, backend configs and the fingerprint (to compare two compiles)."""
    import re

    text = re.sub(r", metadata=\{[^{}]*\}", "", text)
    text = re.sub(r", backend_config=\{.*?\}(?=(, [a-z_]+=|$))", "", text, flags=re.M)
    return re.sub(r"fingerprint_before_lhs=\"[0-9a-f]+\"", "", text)


def run_case(case: BenchCase, options: BaselineOptions, *, export_trace: bool = False) -> dict:
    """Compile, build, simulate one case; returns a row of ``COLUMNS``."""
    from concerto_jax.deviceless import (
        CompileOptions,
        compile_lowered,
        costs_from_graph,
        write_profile,
    )
    from concerto_jax.simulator import (
        SimOptions,
        lower_bounds,
        order_of,
        simulate_synchronous,
        write_chrome_trace,
        write_gantt,
    )
    from models.registry import MODELS

    row = dict.fromkeys(COLUMNS, "")
    row.update(case=case.name, model=case.model, layout=case.layout, cluster=case.cluster,
               mesh="x".join(map(str, case.mesh_shape)), note=case.note)
    if case.model not in MODELS:
        row["status"] = f"skipped: model {case.model!r} not registered in models"
        log.warning("%s: %s", case.name, row["status"])
        return row
    cc = compile_case(case)
    cluster, cost_model, lowered, tc = cc.cluster, cc.cost_model, cc.lowered, cc.compiled
    preset, cfg = cc.preset, cc.config
    built, xla = _simulate_text(tc.final_text, cost_model)
    g = built.graph
    sim_opts = SimOptions(overlap_slowdown=cost_model.options.overlap_slowdown)
    sync = simulate_synchronous(g, order_of(built.events), sim_opts)
    lb = lower_bounds(g)
    pre = _simulate_text(tc.before_lhs_text, cost_model)[1] if tc.before_lhs_text else None
    pgle_step = ""
    if options.pgle and tc.before_lhs_text:
        pre_built = _simulate_text(tc.before_lhs_text, cost_model)[0]
        with tempfile.TemporaryDirectory() as d:
            path = write_profile(os.path.join(d, "profile.pbtxt"), costs_from_graph(pre_built.graph))
            tp = compile_lowered(lowered, cluster, CompileOptions(pgle_profile=path, dump_lhs=False,
                                                                      extra=case.xla_options))
        pgle_step = round(_simulate_text(tp.final_text, cost_model)[1].step_time_us, 1)
    we_step = we_changed = ""
    if options.windowed_einsum:
        tw = compile_lowered(lowered, cluster, CompileOptions(windowed_einsum_mib=0, dump_lhs=False,
                                                              extra=case.xla_options))
        we_step = round(_simulate_text(tw.final_text, cost_model)[1].step_time_us, 1)
        we_changed = _strip_names(tw.final_text) != _strip_names(tc.final_text)
    row.update(
        lhs_ran=tc.before_lhs_text is not None,
        windowed_einsum_step_us=we_step, windowed_einsum_changed_module=we_changed,
        status=f"ok ({preset}, {', '.join(f'{k}={v}' for k, v in case.overrides if hasattr(cfg, k))})",
        tasks=len(g), collectives=sum(t.is_collective for t in g.tasks), compile_s=round(tc.compile_s, 1),
        xla_step_us=round(xla.step_time_us, 1), sync_step_us=round(sync.step_time_us, 1),
        pre_lhs_step_us=round(pre.step_time_us, 1) if pre else "", pgle_step_us=pgle_step,
        lower_bound_us=round(lb.bound_us, 1), critical_path_us=round(lb.critical_path_us, 1),
        total_compute_us=round(lb.total_compute_us, 1), total_comm_us=round(lb.total_comm_us, 1),
        xla_exposed_comm_us=round(xla.exposed_comm_us, 1), xla_exposed_comm_pct=round(xla.exposed_comm_pct, 1),
        xla_overlap_pct=round(xla.overlap_pct, 1),
        xla_speedup_vs_sync=round(sync.step_time_us / xla.step_time_us, 3) if xla.step_time_us else "",
        xla_gap_to_bound_pct=round(100 * (xla.step_time_us / lb.bound_us - 1), 1) if lb.bound_us else "",
        xla_peak_mem_mib=round(xla.peak_memory_bytes / 2**20, 1),
        overlap_slowdown=cost_model.options.overlap_slowdown,
    )
    if export_trace:
        base = os.path.join(options.out_dir, f"{options.prefix}_{case.name}")
        meta = {"case": case.name, "cluster": cluster.name, "order": "xla final"}
        write_chrome_trace(base + ".trace.json", xla, g, process_name=f"{case.name} (XLA order)", metadata=meta)
        write_gantt(base + ".gantt.png", xla, g, title=f"{case.name}: XLA order")
    return row


def _markdown(rows: Sequence[dict], cost_desc: dict, elapsed: float) -> str:
    cols = ("case", "cluster", "mesh", "tasks", "collectives", "lhs_ran", "xla_step_us", "sync_step_us", "pre_lhs_step_us",
            "pgle_step_us", "windowed_einsum_step_us", "windowed_einsum_changed_module", "lower_bound_us", "xla_exposed_comm_pct", "xla_overlap_pct", "xla_speedup_vs_sync",
            "xla_gap_to_bound_pct")
    out = ["# Baseline: stock XLA schedule vs program order vs lower bound (simulated)", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if not str(r["status"]).startswith("ok"):
            out.append(f"| {r['case']} | {r['cluster']} | {r['mesh']} | {r['status']} |" + " |" * (len(cols) - 4))
            continue
        out.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    out += ["", "Columns: times in microseconds per step on one device, simulated with the cost model;",
            "`xla` = XLA's final order (LHS on), `sync` = same graph and order with every collective synchronous,",
            "`pre_lhs` = order of the module XLA's LHS received, `pgle` = XLA recompiled with a PGLE profile from our",
            "cost model (empty unless `--pgle`), `windowed_einsum` = XLA with windowed einsum at threshold 0 MiB\n"
            "(empty unless `--windowed-einsum`), bound = max(total compute, total comm, critical path).",
            "exposed % = communication time with no kernel running / step; overlap % = share of communication hidden.",
            "`lhs_ran` = XLA wrote a latency-hiding-scheduler dump (when False, `pre_lhs`/`pgle` are empty: XLA",
            "scheduled without LHS for this target); `windowed_einsum_changed_module` = the windowed-einsum",
            "compile differs from the stock one (ignoring metadata and backend configs).",
            "", f"Cost model: overlap slowdown {rows[0].get('overlap_slowdown') if rows else ''} (configured, not "
            "measured); compute and collective options: " + str(cost_desc.get("options", {})), "",
            f"Wall time of the run: {elapsed:.0f} s."]
    return "\n".join(out) + "\n"


def run_baseline(cases: Sequence[BenchCase], options: BaselineOptions = BaselineOptions()) -> list[dict]:
    """Run ``cases``, write ``<prefix>.csv`` and ``<prefix>.md`` under ``options.out_dir``; returns the rows."""
    from concerto_jax.costmodel import CostModel, get_cluster

    os.makedirs(options.out_dir, exist_ok=True)
    t0 = time.perf_counter()

    def done(k, case, row):
        log.info("[%d/%d] %s: xla %s us, sync %s us, bound %s us (%s) [%.0fs elapsed]", k, len(cases),
                 case.name, row["xla_step_us"], row["sync_step_us"], row["lower_bound_us"], row["status"],
                 time.perf_counter() - t0)

    rows = suite.run_each(cases, lambda case, export_trace: run_case(case, options, export_trace=export_trace),
                          COLUMNS, options.trace_case, done)
    csv_path = os.path.join(options.out_dir, f"{options.prefix}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    desc = CostModel(get_cluster(cases[0].cluster)).describe() if cases else {}
    md = _markdown(rows, desc, time.perf_counter() - t0)
    with open(os.path.join(options.out_dir, f"{options.prefix}.md"), "w") as f:
        f.write(md)
    log.info("wrote %s and %s.md", csv_path, os.path.join(options.out_dir, options.prefix))
    return rows


def _train_step_program(model: str, config):
    """(fn, args) of one single-device train step of ``model`` (no donation: it is run many times)."""
    from models.registry import make_case

    case = make_case(model, "dp", config, (1,), materialize=True)

    def step(state, batch):
        return case.step(state, batch)  # inside an outer jit the inner donation is dropped

    return step, [case.state, case.batch]


def gpt_block_config():
    """GPT with one decoder block (h=256, 4 heads, seq 128, batch 4, vocab 1024), float32."""
    from models import gpt

    return dataclasses.replace(gpt.PRESETS["tiny"], vocab_size=1024, hidden=256, num_layers=1, num_heads=4,
                               seq_len=128, batch_size=4)


def evoformer_block_config():
    """Evoformer with one block (c_m=64, c_z=32, 4 heads of 16, s=16, r=32, batch 2), float32."""
    from models import evoformer

    return dataclasses.replace(evoformer.PRESETS["tiny"], c_m=64, c_z=32, msa_heads=4, pair_heads=4, head_dim=16,
                               c_opm=16, num_seq=16, num_res=32, batch_size=2)


VALIDATION_PROGRAMS = ("mlp_grad", "transformer_block", "softmax_rows", "conv3x3", "gpt_block_train_step",
                       "evoformer_block_train_step")
"""Programs of ``python -m bench.cli validate-cpu`` (the last two: a whole AdamW train step each)."""


def _validation_programs(names=None):
    """Single-device CPU programs for the validation of the method (name, fn, args).

    Args:
      names: the programs to build (default ``VALIDATION_PROGRAMS``).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)

    def f32(*shape):
        return r.standard_normal(shape).astype(np.float32)

    def mlp_grad(w1, w2, x):
        return jax.grad(lambda a, b: jnp.mean((jnp.tanh(x @ a) @ b) ** 2), argnums=(0, 1))(w1, w2)

    def block(x, wqkv, wo, w1, w2):
        def ln(v):
            m = v.mean(-1, keepdims=True)
            return (v - m) * jax.lax.rsqrt(((v - m) ** 2).mean(-1, keepdims=True) + 1e-5)

        q, k, v = jnp.split(ln(x) @ wqkv, 3, axis=-1)
        att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 16.0, axis=-1)
        x = x + jnp.einsum("bqk,bkd->bqd", att, v) @ wo
        return x + jax.nn.gelu(ln(x) @ w1) @ w2

    def softmax_rows(x):
        return jax.nn.softmax(x, axis=-1) * jnp.tanh(x)

    def conv(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y).sum(axis=(1, 2))

    makers = {
        "mlp_grad": lambda: (mlp_grad, [f32(512, 1024), f32(1024, 512), f32(256, 512)]),
        "transformer_block": lambda: (block, [f32(4, 256, 256), f32(256, 768), f32(256, 256), f32(256, 1024),
                                              f32(1024, 256)]),
        "softmax_rows": lambda: (softmax_rows, [f32(2048, 1024)]),
        "conv3x3": lambda: (conv, [f32(8, 32, 32, 32), f32(3, 3, 32, 64)]),
        "gpt_block_train_step": lambda: _train_step_program("gpt", gpt_block_config()),
        "evoformer_block_train_step": lambda: _train_step_program("evoformer", evoformer_block_config()),
    }
    names = VALIDATION_PROGRAMS if names is None else names
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown validation program(s) {unknown}; expected some of {list(makers)}")
    return [(n, *makers[n]()) for n in names]


def _validation_markdown(rows, command: str, setup: str, load: tuple, seconds: float, top: int) -> str:
    from bench.cpu_validation import mean_abs_error_pct

    md = ["# CPU validation: simulated vs measured single-device programs", "",
          f"`{command}` ({seconds:.0f} s). {setup}",
          f"Load average (1/5/15 min) at start {load[0][0]:.2f}/{load[0][1]:.2f}/{load[0][2]:.2f}, "
          f"at end {load[1][0]:.2f}/{load[1][1]:.2f}/{load[1][2]:.2f}.", "",
          "| program | measured us | store us | error % | analytic us | error % | roofline us | error % "
          "| wall: measured us | store us "
          "| error % | kernels in program (profiler, wall) us | kernels | failed | temp MiB | page faults/run |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r.name} | {r.measured_us:.0f} | {r.from_store_us:.0f} | {r.store_error_pct:+.1f} | "
           f"{r.analytic_us:.0f} | {r.analytic_error_pct:+.1f} | {r.roofline_us:.0f} | {r.roofline_error_pct:+.1f} | "
           f"{r.measured_wall_us:.0f} | {r.from_store_wall_us:.0f} | "
           f"{r.store_wall_error_pct:+.1f} | {r.in_program_sum_us:.0f} | {r.kernels} | {r.failed} | "
           f"{r.temp_bytes / 2**20:.1f} | {r.page_faults} |" for r in rows]
    md += ["", "Mean |error| (process CPU time): per-kernel store "
           f"{mean_abs_error_pct([r.store_error_pct for r in rows]):.1f} %, analytic "
           f"{mean_abs_error_pct([r.analytic_error_pct for r in rows]):.1f} % (per-class model), one-rate roofline "
           f"{mean_abs_error_pct([r.roofline_error_pct for r in rows]):.1f} %; wall time: per-kernel store "
           f"{mean_abs_error_pct([r.store_wall_error_pct for r in rows]):.1f} %.",
           "analytic: each kernel classified by what it contains (`cpu_kernel_class`: YNNPACK dot fusion, plain dot, "
           "reduction, inner-dimension transpose with a read stride below or from 4 KiB, stream) and costed at "
           "its class's rate, probed by a "
           "micro-benchmark in each program's rounds (`cpu_spec_probes`); roofline: one GEMM rate and one "
           "bandwidth (the model before the classes). Probes:", ""]
    md += [f"- {r.name}: {r.cpu_spec}" for r in rows]
    md += ["",
           "measured: median process CPU time of the jitted program less a program with the same arguments and",
           "output leaves that does nothing (its dispatch); one pinned core, so that is the time the core spent on it",
           "(waiting for a neighbour does not count). store: every kernel of XLA:CPU's optimized module compiled",
           "alone, median process CPU time less a trivial module's (kernels shorter than that: median of the profiler's",
           "kernel event), summed by the simulator on the module's task graph. Every runner is timed right after an",
           "untimed run of itself (warm caches), in interleaved rounds. wall columns: least wall times (inflated under",
           "load, most for long programs). kernels in program: sum of the entry kernels' median durations inside the",
           "program from XLA:CPU's profiler (wall).", "",
           f"## Largest per-kernel differences (top {top} per program by |store - in program|)", "",
           "| program | kernel | in program us | store us | analytic us |", "|---|---|---|---|---|"]
    for r in rows:
        known = [k for k in r.kernel_rows if k.in_program_us is not None]
        known.sort(key=lambda k: -abs(k.store_us - k.in_program_us))
        md += [f"| {r.name} | {k.name} | {k.in_program_us:.1f} | {k.store_us:.1f} | {k.analytic_us:.1f} |"
               for k in known[:top]]
    md += ["", "Per-kernel sums by the store's kernel time (kernels found in the profile):", "",
           "| program | kernel time | kernels | in program us | store us | analytic us |", "|---|---|---|---|---|---|"]
    for r in rows:
        for lo, hi in ((0, 5), (5, 20), (20, 100), (100, 1000), (1000, float("inf"))):
            ks = [k for k in r.kernel_rows if k.in_program_us is not None and lo <= k.store_us < hi]
            if ks:
                md.append(f"| {r.name} | {lo}-{hi} us | {len(ks)} | {sum(k.in_program_us for k in ks):.0f} | "
                          f"{sum(k.store_us for k in ks):.0f} | {sum(k.analytic_us for k in ks):.0f} |")
    md += ["", "Per-class sums (analytic model's kernel classes):", "",
           "| program | class | kernels | store us | analytic us | analytic / store |", "|---|---|---|---|---|---|"]
    for r in rows:
        for cls in sorted({k.kernel_class for k in r.kernel_rows}):
            ks = [k for k in r.kernel_rows if k.kernel_class == cls]
            st, an = sum(k.store_us for k in ks), sum(k.analytic_us for k in ks)
            md.append(f"| {r.name} | {cls} | {len(ks)} | {st:.0f} | {an:.0f} | {an / st if st else float('nan'):.2f} |")
    return "\n".join(md) + "\n"


def run_cpu_validation(out_dir: str = "bench/results", prefix: str = "baseline_cpu_validation",
                       repeats: int = 15, programs=None, command: str = "python -m bench.cli validate-cpu",
                       setup: str = "", top: int = 5) -> list:
    """Simulated vs measured time of single-device CPU programs; writes ``<prefix>.csv`` and ``.md``.

    Args:
      out_dir: output directory.
      prefix: output file prefix.
      repeats: interleaved timing rounds per program.
      programs: program names (default ``VALIDATION_PROGRAMS``).
      command: the command line, for the report.
      setup: how XLA:CPU was configured (threads, affinity), for the report.
      top: kernels listed per program in the per-kernel table.
    """
    from bench.cpu_validation import validate_program

    t0 = time.perf_counter()
    load0 = os.getloadavg()
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    progs = _validation_programs(programs)
    for k, (name, fn, args) in enumerate(progs, 1):
        log.info("[%d/%d] validating %s", k, len(progs), name)
        rows.append(validate_program(name, fn, args, repeats=repeats))
        log.info("%s: measured %.0f us, store %+.1f %%, analytic %+.1f %% (roofline %+.1f %%)", name,
                 rows[-1].measured_us, rows[-1].store_error_pct, rows[-1].analytic_error_pct,
                 rows[-1].roofline_error_pct)
    fields = ("name", "measured_us", "from_store_us", "store_error_pct", "analytic_us", "analytic_error_pct",
              "roofline_us", "roofline_error_pct",
              "measured_wall_us", "from_store_wall_us", "store_wall_error_pct", "in_program_sum_us", "kernels", "failed",
              "temp_bytes", "page_faults")
    with open(os.path.join(out_dir, prefix + ".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow([round(v, 1) if isinstance(v, float) else v for v in (getattr(r, k) for k in fields)])
    md = _validation_markdown(rows, command, setup, (load0, os.getloadavg()), time.perf_counter() - t0, top)
    with open(os.path.join(out_dir, prefix + ".md"), "w") as f:
        f.write(md)
    return rows
