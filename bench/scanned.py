"""Scanned layers vs their unrolled twins: stock XLA (collective pipeliner + LHS) vs XLA's final module of ours.

For each case (GPT h=2048 with remat, ``--layers`` layers, bf16) in two variants,
``scan`` (layers under one ``nn.scan``: forward and backward while loops) and
``unrolled`` (the same blocks written out), ONE ``concerto_jax.compile_for_target``
(default path ``backend_only``, XLA's collective pipeliner on for all-gather,
reduce-scatter and all-reduce: ``xla_gpu_pipeline_*``) gives three modules:

* stock: XLA's final module of the original step (pipeliner + latency hiding
  scheduler), i.e. stock XLA at its best on loops;
* planned: XLA's scheduled module of our program (the one its post-scheduling pipelines
  receive, i.e. after LHS) with every computation (entry, while bodies and conditions,
  nested) in OUR order (``deviceless.reschedule.reschedule_text``), the module handed to XLA's
  backend;
* final: XLA's final module of that program (PJRT C API, ``run_backend_only``): what
  the GPUs would run. This is the column the bench judges ours on.

All three are judged by the same simulator, hierarchically (``judge_module``):
every computation that runs as a sequence of kernels (``schedulable_computations``:
loop bodies and conditions first, then the entry) is simulated in the module's own
order with the overlap slowdown; a while costs ``trips x (body + condition) +
condition``. Bound: per computation ``max(compute, busiest comm stream, critical
path)`` with nested loops at their bounds (of the final module). Overlap kept: per
collective ``min(final overlap, planned overlap)`` summed over every computation,
each weighted by how often it runs, over the planned total. Order survival: per
computation our scheduler changed (planned vs XLA's scheduled module, dumped as
``xla_scheduled.hlo``), whether XLA's final module lists the common instructions in
the planned order. Memory: the scheduler's peak vs its limit
(``ScheduleOptions.memory_limit_ratio`` x XLA's order's peak, per computation).

The figures are on task graphs, NOT measured on a GPU and NOT XLA's own cost
model. Command line::

    python -m bench.scanned [--case NAME] [--variant scan|unrolled] [--layers 4]
        [--passes schedule] [--memory-ratio R|none] [--prefix scanned]

``--passes pipeline_loops,schedule`` runs the FSDP prefetch rewrite on the post-SPMD
module first (XLA's pipeline then runs on our module up to its scheduler);
``prefetch_all`` is a bench-only pass that applies the same rewrite to every loop
without asking the cost model (to judge the rewrite itself on the final module).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import difflib
import logging
import os
import re
import sys
import tempfile
import time

from bench.suite import BenchCase
from concerto_jax import jax_compat
from concerto_jax.judge import judge_module, overlap_kept

log = logging.getLogger(__name__)

PIPELINER = jax_compat.collective_pipeliner_options(on=True)
"""XLA's collective pipeliner, on for every collective kind it handles."""

CASES: tuple[tuple[str, str, str, tuple[int, ...], str], ...] = (
    # (name, layout, cluster, mesh shape, note)
    ("gpt_tp8", "tp", "h100_sxm_8", (8,), "Megatron TP=8, 8x H100 SXM"),
    ("gpt_zero3_8", "zero3", "h100_sxm_8", (8,), "ZeRO-3/FSDP=8, 8x H100 SXM"),
    ("gpt_dp2_tp8_2hosts", "dp_tp", "h100_sxm_2x8", (2, 8), "DP=2 across 2 hosts x TP=8"),
)
VARIANTS = ("scan", "unrolled")

COLUMNS = (
    "case", "variant", "status", "via", "passes", "memory_ratio", "xla_pipeliner", "cluster", "mesh", "layers", "judged_on",
    "loops", "loop_trips", "collectives", "collectives_in_loops",
    "stock_us", "final_us", "final_gain",
    # bench.robust_columns: the gain's worst case over the plausible cost models, kernels and bytes added
    "worst_gain", "worst_variant", "adverse_gain", "calibrated_gain", "stock_kernels", "ours_kernels", "added_kernels", "added_mb",
    "stock_compute_us", "final_compute_us", "stock_comm_us", "final_comm_us",
    "planned_us", "final_vs_planned", "bound_us", "stock_bound_us",
    "final_gap_to_bound_pct", "overlap_kept", "planned_overlap_us", "computations", "changed", "survived", "moved",
    "bodies_changed", "bodies_survived", "entry_peak_mb", "entry_limit_mb", "body_peak_mb", "worst_peak_over_limit",
    "pass_stats", "fallback", "cut", "stock_compile_s", "compile_s", "wall_s", "note",
)


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def computation_orders(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction names in text order (XLA's printing: one per line)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.split("\n"):
        if cur is None:
            m = _HEADER.match(line)
            if m and not line.startswith(" "):
                cur = out.setdefault(m.group(1), [])
        elif line.strip() == "}":
            cur = None
        else:
            m = _INST.match(line)
            if m:
                cur.append(m.group(1))
    return out


@dataclasses.dataclass(frozen=True)
class Survival:
    """Did XLA's final module keep our order? (``order_survival``)

    Attributes:
      changed: computations whose order we changed (planned != XLA's scheduled order).
      survived: those among ``changed`` whose common instructions the final module lists in
        the planned order.
      moved: instructions the final module places elsewhere than planned, summed over ``changed``
        (per computation: common instructions outside difflib's common subsequence of the two orders).
      detail: per changed computation: common instructions, instructions only in the final
        module, whether it survived, the moved instructions (count and first names), and whether
        the planned order differs from XLA's on the common instructions.
    """

    changed: tuple[str, ...]
    survived: tuple[str, ...]
    moved: int
    detail: dict


def order_survival(xla_text: str, planned_text: str, final_text: str) -> Survival:
    """Compare each computation's instruction sequence: XLA's scheduled module, planned (ours), final."""
    xla, plan, final = (computation_orders(t) for t in (xla_text, planned_text, final_text))
    changed, survived, detail = [], [], {}
    for comp, order in plan.items():
        if xla.get(comp) == order:
            continue
        changed.append(comp)
        fin = final.get(comp, [])
        common = set(order) & set(fin) & set(xla.get(comp, []))
        p = [n for n in order if n in common]
        f = [n for n in fin if n in common]
        x = [n for n in xla.get(comp, []) if n in common]
        ok = bool(common) and f == p
        if ok:
            survived.append(comp)
        kept = sum(b.size for b in difflib.SequenceMatcher(a=p, b=f, autojunk=False).get_matching_blocks())
        moved = [n for n in p if n not in _in_lcs(p, f)] if kept < len(p) else []
        detail[comp] = {"instructions": len(order), "common": len(common), "only_final": len(set(fin) - set(order)),
                        "survived": ok, "moved": len(p) - kept, "moved_names": moved[:8],
                        "distinguishable": p != x}
    return Survival(tuple(changed), tuple(survived), sum(d["moved"] for d in detail.values()), detail)


def _in_lcs(a: list[str], b: list[str]) -> set[str]:
    """Names of ``a`` in the matching blocks of ``a`` and ``b`` (difflib's common subsequence)."""
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return {a[blk.a + k] for blk in sm.get_matching_blocks() for k in range(blk.size)}


@contextlib.contextmanager
def recording_reschedules():
    """Record every ``deviceless.reschedule.reschedule_text`` result while the block runs (read-only wrapper)."""
    from concerto_jax.deviceless import reschedule

    seen: list = []
    original = reschedule.reschedule_text

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    reschedule.reschedule_text = wrapped
    try:
        yield seen
    finally:
        reschedule.reschedule_text = original


def register_prefetch_all() -> None:
    """Register the bench-only pass ``prefetch_all``: ``pipeline_prefetch`` on every loop that has candidates."""
    from hlo_passes.ir.loops import analyze_while, schedulable_computations
    from hlo_passes.pipeline_loops import loop_shape_problem, pipeline_prefetch, prefetch_candidates
    from hlo_passes.registry import PASSES, PassOutcome

    def prefetch_all(module, options):  # noqa: ARG001 - pass signature
        loops = [i for c in schedulable_computations(module) for i in c.instructions if i.opcode == "while"]
        done = []
        for inst in loops:
            info = analyze_while(inst)
            if loop_shape_problem(module, inst, info) is not None or not info.trip_count:
                continue
            cands = prefetch_candidates(module, inst)
            if cands:
                pipeline_prefetch(module, inst, [c.collective for c in cands])
                done.append({"loop": inst.name, "gathers": len(cands), "bytes": sum(c.bytes for c in cands)})
        return PassOutcome(changed=bool(done), stats={"pipelined": done})

    PASSES["prefetch_all"] = prefetch_all


def run_case(name: str, layout: str, cluster: str, mesh: tuple[int, ...], note: str, variant: str,
             layers: int, passes: tuple[str, ...] = ("schedule",), memory_ratio: float | None = 1.0,
             dump_dir: str | None = None, pipeliner: bool = True,
             combine_thresholds: tuple[int, ...] | None = None) -> dict:
    """One case variant through ``compile_for_target``, its three modules judged; a row of ``COLUMNS``."""
    import concerto_jax
    from bench.baseline import model_case
    from concerto_jax.costmodel import CostModel, get_cluster
    from concerto_jax.scheduler import ScheduleOptions

    xla_options = PIPELINER if pipeliner else jax_compat.collective_pipeliner_options(on=False)
    case = BenchCase(name=f"{name}_{variant}", model="gpt", layout=layout, cluster=cluster, mesh_shape=mesh,
                     config="gpt_0_9b", dtype="bfloat16", xla_options=xla_options, note=note,
                     overrides=(("num_layers", layers), ("scan_layers", variant == "scan"), ("remat", True)))
    row = dict.fromkeys(COLUMNS, "")
    row.update(case=name, variant=variant, cluster=cluster, mesh="x".join(map(str, mesh)), layers=layers,
               note=note, passes="+".join(passes), memory_ratio=memory_ratio, xla_pipeliner=pipeliner,
               judged_on="final = XLA's final module of our program (task graph, our cost model, simulated)")
    t0 = time.perf_counter()
    built, _, _ = model_case(case)
    cost_model = CostModel(get_cluster(cluster))
    with tempfile.TemporaryDirectory(prefix="scanned_") as tmp, recording_reschedules() as seen:
        dump = os.path.join(dump_dir, f"{name}_{variant}") if dump_dir else tmp
        deviceless = concerto_jax.DevicelessOptions(
            **({} if combine_thresholds is None else {"combine_thresholds": tuple(combine_thresholds)}))
        options = concerto_jax.Options(passes=passes, target=cluster, compiler_options=dict(xla_options),
                                       scheduler=ScheduleOptions(memory_limit_ratio=memory_ratio), dump_dir=dump,
                                       deviceless=deviceless)
        res = concerto_jax.compile_for_target(built.step, built.abstract_state, built.abstract_batch,
                                              target=cluster, options=options)
        xla_sched = (_read(os.path.join(dump, "xla_scheduled.hlo"))
                     or _read(os.path.join(dump, "xla_after_lhs.hlo")))  # the dump's older name
    row.update(via=res.via, fallback=res.fallback_reason or "", cut="; ".join(res.cut),  # what the time budget left out
               stock_compile_s=res.seconds.get("stock_compile", ""),
               compile_s=res.seconds.get("compile", ""),
               pass_stats="; ".join(f"{r.name}: {_short_stats(r)}" for r in res.passes if r.name != "schedule"))
    stock = judge_module(res.stock_final_text, cost_model)
    final = judge_module(res.final_text, cost_model)
    from bench import robust_columns

    row.update({k: v for k, v in robust_columns.columns(res.stock_final_text, res.final_text, cluster).items()
                if k != "nominal_gain"})
    row.update(loops=len(final.loops), loop_trips=" ".join(str(lp["trips"]) for lp in final.loops),
               collectives=final.collectives, collectives_in_loops=final.collectives_in_loops,
               stock_us=round(stock.us, 1), final_us=round(final.us, 1), final_gain=round(stock.us / final.us, 4),
               stock_compute_us=round(stock.compute_us, 1), final_compute_us=round(final.compute_us, 1),
               stock_comm_us=round(stock.comm_us, 1), final_comm_us=round(final.comm_us, 1),
               bound_us=round(final.bound_us, 1), stock_bound_us=round(stock.bound_us, 1),
               final_gap_to_bound_pct=round(100 * (final.us / final.bound_us - 1), 2))
    if res.via == "backend_only" and res.emitted_text:
        planned = judge_module(res.emitted_text, cost_model)
        kept, planned_ov = overlap_kept(planned, final)
        row.update(planned_us=round(planned.us, 1), final_vs_planned=round(final.us / planned.us, 4),
                   overlap_kept=round(kept, 4), planned_overlap_us=round(planned_ov, 1))
        if xla_sched is not None:
            surv = order_survival(xla_sched, res.emitted_text, res.final_text)
            loop_bodies = {lp["body"] for lp in planned.loops}
            row.update(changed=len(surv.changed), survived=len(surv.survived), moved=surv.moved,
                       bodies_changed=sum(c in loop_bodies for c in surv.changed),
                       bodies_survived=sum(c in loop_bodies for c in surv.survived))
            row["_survival"] = surv
    if seen:
        recs = seen[-1].computations
        row["computations"] = len(recs)
        entry = recs[-1]
        if entry.peak_bytes is not None:
            row["entry_peak_mb"] = round(entry.peak_bytes / 1e6, 1)
        if entry.memory_limit_bytes is not None:
            row["entry_limit_mb"] = round(entry.memory_limit_bytes / 1e6, 1)
        body_peaks = [c.peak_bytes for c in recs if c.trip_count is not None and c.peak_bytes is not None]
        if body_peaks:
            row["body_peak_mb"] = round(max(body_peaks) / 1e6, 1)
        ratios = [c.peak_bytes / c.memory_limit_bytes for c in recs
                  if c.peak_bytes is not None and c.memory_limit_bytes]
        row["worst_peak_over_limit"] = round(max(ratios), 4) if ratios else "no limit"
    row.update(status="ok" if res.fallback_reason is None else "fallback", wall_s=round(time.perf_counter() - t0, 1))
    log.info("%s/%s: stock %.1f us, final %.1f us, planned %s us, bound %.1f us, survived %s/%s", name, variant,
             stock.us, final.us, row["planned_us"], final.bound_us, row["survived"], row["changed"])
    return row


def _short_stats(rec) -> str:
    keep = ("pipelined", "prefetched_collectives", "extra_carried_bytes", "peak_bytes", "memory_limit_bytes")
    s = {k: rec.stats[k] for k in keep if k in rec.stats}
    per = rec.stats.get("per_loop")
    if per:
        s["why"] = [r.get("why") for r in per]
    rotations = rec.stats.get("rotations")  # decompose: loop rotations after the region split
    if rotations:
        s["rotated"] = [f"{r['loop']}: {r.get('collective') if r.get('rotated') else r.get('why')}"
                        for r in rotations]
    return f"changed={rec.changed} {s}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


_MD = (("case", "case"), ("variant", "variant"), ("loop_trips", "loop trips"),
       ("stock_us", "stock XLA"), ("final_us", "**ours: XLA's final module**"),
       ("final_gain", "gain (stock/final)"), ("worst_gain", "worst-case gain"), ("worst_variant", "worst model"),
       ("adverse_gain", "adverse corner"), ("calibrated_gain", "H200 rates"), ("stock_kernels", "stock kernels"), ("ours_kernels", "ours kernels"),
       ("added_mb", "added MB"), ("stock_compute_us", "stock compute"),
       ("final_compute_us", "ours: compute"), ("stock_comm_us", "stock comm"), ("final_comm_us", "ours: comm"),
       ("planned_us", "ours: planned"), ("bound_us", "bound"),
       ("overlap_kept", "overlap kept"), ("changed", "changed"), ("survived", "survived"), ("moved", "moved"),
       ("bodies_changed", "bodies changed"), ("bodies_survived", "bodies survived"),
       ("entry_peak_mb", "entry peak MB"), ("entry_limit_mb", "entry limit MB"), ("body_peak_mb", "body peak MB"),
       ("worst_peak_over_limit", "worst peak/limit"), ("status", "status"))


def write(rows: list[dict], out_dir: str, prefix: str, command: str, elapsed: float) -> None:
    """``<prefix>.csv`` (every column) and ``<prefix>.md`` (the table with its legend)."""
    from bench import robust_columns

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{prefix}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    states = {"True" if r.get("xla_pipeliner") in (None, "") else str(r["xla_pipeliner"]) for r in rows}
    pipeliner_state = "on" if states == {"True"} else "off" if states == {"False"} else "mixed (column xla_pipeliner)"
    lines = [
        "# Scanned vs unrolled (remat): stock XLA vs XLA's final module of our program\n",
        f"Command: `{command}` ({elapsed:.0f} s wall). One `compile_for_target` per row (path `via` = "
        "backend_only: our order of every computation of XLA's scheduled (after-LHS) module, compiled backend-only). "
        "Simulated µs/step, one cost model and one simulator for every column, every computation simulated "
        "in its module's own order (while = trips x body). Columns (csv names): `stock_us` = stock XLA's final module "
        "(LHS; pipeliner: see the end of this legend); **`final_us` = XLA's final module of OUR program: the column ours is "
        "judged on**; `final_gain` = stock / final; `*_compute_us` / `*_comm_us` = kernel time and collective "
        "transfer time of one step at full speed, whatever the order (every computation weighted by its runs per "
        "step): a scanned program and its unrolled twin are different programs, compare each with its own stock; "
        "`planned_us` = the module we handed XLA in our order; "
        "`bound_us` = lower bound of the final module; `overlap_kept` = share of the planned overlapped "
        "transfer time the final module keeps (every computation, weighted by its runs per step); "
        "`changed`/`survived` = computations we reordered / of those, the ones whose order the final module "
        "keeps exactly (`bodies_*`: loop bodies among them), `moved` = instructions the final module places elsewhere "
        "than planned; memory = the scheduler's peak of the entry vs its limit "
        "(MB), the largest loop body's peak (MB, its carried state included) and the worst peak/limit over all "
        "computations (limit per computation: the larger of memory_limit_ratio x XLA's order's peak and, where "
        "compile_for_target kept the plan within XLA's own scheduler limit, that computation's share of it: "
        "entry 1/2, loop body 1/4). Not measured on a GPU. "
        f"XLA's collective pipeliner (`xla_gpu_pipeline_*`, stock and ours): {pipeliner_state}. "
        + robust_columns.legend() + "\n",
        "| " + " | ".join(label for _, label in _MD) + " |", "|" + "---|" * len(_MD)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c, _ in _MD) + " |" for r in rows]
    with open(os.path.join(out_dir, f"{prefix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    """Run the scanned-vs-unrolled bench; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m bench.scanned", description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c[0] for c in CASES])
    parser.add_argument("--variant", action="append", choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--passes", default="schedule", help="comma-separated Options.passes")
    parser.add_argument("--memory-ratio", default="1.0", help="ScheduleOptions.memory_limit_ratio, or 'none'")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--prefix", default="scanned")
    parser.add_argument("--no-xla-pipeliner", dest="pipeliner", action="store_false",
                        help="turn XLA's collective pipeliner off (xla_gpu_pipeline_*=OFF) for stock and ours")
    parser.add_argument("--dump-dir", help="keep each row's modules (captured, stock final, XLA scheduled, "
                        "emitted, final) under DUMP_DIR/<case>_<variant>/")
    parser.add_argument("--thresholds", default=None, metavar="B,B,...",
                        help="Options.deviceless.combine_thresholds in bytes (default: the Options default); "
                             "'none': XLA's combine thresholds only")
    args = parser.parse_args(argv)
    thresholds = None if args.thresholds is None else (
        () if args.thresholds == "none" else tuple(int(b) for b in args.thresholds.split(",")))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless GPU compile: JAX itself on CPU
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    passes = tuple(p for p in args.passes.split(",") if p)
    if "prefetch_all" in passes:
        register_prefetch_all()
    ratio = None if args.memory_ratio.lower() == "none" else float(args.memory_ratio)
    command = "python -m bench.scanned " + " ".join(argv if argv is not None else sys.argv[1:])
    rows, t0 = [], time.perf_counter()
    for name, layout, cluster, mesh, note in CASES:
        if args.case and name not in args.case:
            continue
        for variant in args.variant or VARIANTS:
            try:
                row = run_case(name, layout, cluster, mesh, note, variant, args.layers, passes, ratio,
                               args.dump_dir, args.pipeliner, thresholds)
                surv = row.pop("_survival", None)
                if surv is not None:
                    log.info("%s/%s survival: %s", name, variant, surv.detail)
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
                log.exception("%s/%s failed", name, variant)
                row = dict.fromkeys(COLUMNS, "")
                row.update(case=name, variant=variant, status=f"error: {type(e).__name__}: {str(e)[:120]}")
                rows.append(row)
            write(rows, args.out, args.prefix, command.strip(), time.perf_counter() - t0)
    with open(os.path.join(args.out, f"{args.prefix}.md")) as f:
        sys.stdout.write(f.read())
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
