"""PSPLIB bench: solve j30/j60 with the generic RCPSP entry point, compare with the optima.

Usage::

    python -m bench.psplib_bench --set j30 [--limit N] [--time-limit S] [--workers W]

Writes ``bench/results/psplib_<set>.csv`` (one row per instance, rewritten after every
instance so a partial run keeps its rows) and ``psplib_<set>.md`` (summary + command).

References: Concerto (ASPLOS'25) §4.2; PSPLIB (Kolisch & Sprecher 1997).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import re
import statistics
import sys

from concerto_jax.scheduler.psplib import load_optima, load_psplib
from concerto_jax.scheduler.rcpsp import SolverParams, solve_rcpsp

logger = logging.getLogger("bench.psplib")

PSPLIB_ROOT = os.environ.get("PSPLIB_ROOT", "/work/shared/psplib")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclasses.dataclass(frozen=True)
class Row:
    """One solved instance."""

    instance: str  # file name, e.g. j301_1.sm
    ref_lo: int | None  # best lower bound in the literature (== ref_hi when closed; None: unknown)
    ref_hi: int  # best known makespan
    makespan: int  # ours
    lower_bound: int  # our proven bound
    status: str  # CP-SAT status
    wall_s: float  # wall time of the whole solve
    deviation_pct: float  # 100 * (makespan - ref_hi) / ref_hi


def _natural_key(name: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def instances(set_name: str) -> list[str]:
    folder = os.path.join(PSPLIB_ROOT, set_name)
    return sorted((f for f in os.listdir(folder) if f.endswith(".sm")), key=_natural_key)


def run(set_name: str, limit: int | None, params: SolverParams, start: int = 0,
        only: list[str] | None = None, tag: str = "", retry_unproven_s: float = 0.0) -> list[Row]:
    """Solve the first ``limit`` instances of ``set_name`` (from index ``start``, or ``only``).

    With ``retry_unproven_s > 0``, an instance the solver did not *prove* optimal
    within ``params.time_limit_s`` is solved again for up to that many seconds,
    warm-started from the first solution. The decision uses only the solver's own
    status, never the reference optimum.
    """
    folder = os.path.join(PSPLIB_ROOT, set_name)
    optima = load_optima(os.path.join(folder, "optimum", "optimum.csv"))
    names = instances(set_name)[start:]
    names = names[:limit] if limit else names
    if only:
        names = [n for n in instances(set_name) if n in set(only)]
    rows: list[Row] = []
    for k, name in enumerate(names):
        inst = load_psplib(os.path.join(folder, name))
        res = solve_rcpsp(inst, params)
        wall = res.wall_time_s
        if retry_unproven_s > 0 and res.status != "OPTIMAL":
            again = solve_rcpsp(inst, dataclasses.replace(params, time_limit_s=retry_unproven_s),
                                hint=res.starts)
            wall += again.wall_time_s
            if (again.makespan, -again.lower_bound) <= (res.makespan, -res.lower_bound):
                res = again
        ref = optima[name]
        rows.append(Row(name, ref.lo, ref.hi, res.makespan, res.lower_bound, res.status,
                        round(wall, 3), 100.0 * (res.makespan - ref.hi) / ref.hi))
        logger.info("[%d/%d] %s: %d (ref %s) %s %.2fs", k + 1, len(names), name, res.makespan,
                    ref.hi if ref.closed else f"{ref.lo}..{ref.hi}", res.status, res.wall_time_s)
        if (k + 1) % 20 == 0 or k + 1 == len(names):
            _write(set_name, rows, params, limit, start, tag, retry_unproven_s)
    return rows


def summary(rows: list[Row]) -> dict:
    n = len(rows)
    with_lo = [r for r in rows if r.ref_lo is not None]
    return {
        "instances": n,
        "at_reference": sum(r.makespan <= r.ref_hi for r in rows),
        "better_than_reference": sum(r.makespan < r.ref_hi for r in rows),
        "proven_optimal": sum(r.status == "OPTIMAL" for r in rows),
        "mean_dev_pct": statistics.fmean(r.deviation_pct for r in rows) if rows else 0.0,
        "max_dev_pct": max((r.deviation_pct for r in rows), default=0.0),
        "mean_dev_vs_lo_pct": statistics.fmean(100.0 * (r.makespan - r.ref_lo) / r.ref_lo
                                               for r in with_lo) if with_lo else float("nan"),
        "mean_wall_s": statistics.fmean(r.wall_s for r in rows) if rows else 0.0,
        "max_wall_s": max((r.wall_s for r in rows), default=0.0),
    }


def _write(set_name: str, rows: list[Row], params: SolverParams, limit, start, tag="",
           retry_unproven_s: float = 0.0) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"psplib_{set_name}{tag}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in dataclasses.fields(Row)])
        for r in rows:
            w.writerow([getattr(r, fl.name) for fl in dataclasses.fields(Row)])
    s = summary(rows)
    cmd = f"python -m bench.psplib_bench --set {set_name} --time-limit {params.time_limit_s} " \
          f"--workers {params.num_workers}" + (f" --limit {limit}" if limit else "") + \
          (f" --start {start}" if start else "") + \
          (f" --retry-unproven {retry_unproven_s}" if retry_unproven_s else "") + \
          (f" --only {' '.join(r.instance for r in rows)} --tag {tag}" if tag else "")
    lines = [
        f"# PSPLIB {set_name}",
        "",
        f"Command: `{cmd}` (CPU, {os.cpu_count()} cores shared with other jobs).",
        "Deviation is from the best known makespan (`hi` of `lo..hi` for open instances).",
        "",
        "| instances | at/below reference | better than reference | proven optimal | "
        "mean dev % | max dev % | mean dev vs known LB % | mean s | max s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {s['instances']} | {s['at_reference']} | {s['better_than_reference']} | "
        f"{s['proven_optimal']} | {s['mean_dev_pct']:.3f} | {s['max_dev_pct']:.2f} | "
        f"{s['mean_dev_vs_lo_pct']:.3f} | {s['mean_wall_s']:.2f} | {s['max_wall_s']:.2f} |",
        "",
    ]
    worst = sorted(rows, key=lambda r: -r.deviation_pct)[:10]
    if worst and worst[0].deviation_pct > 0:
        lines += ["Instances above the reference:", "", "| instance | ours | reference | dev % | s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r.instance} | {r.makespan} | {r.ref_lo or ''}..{r.ref_hi} | {r.deviation_pct:.2f} "
                  f"| {r.wall_s:.1f} |" for r in worst if r.deviation_pct > 0]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="j30", choices=["j30", "j60"])
    ap.add_argument("--limit", type=int, default=None, help="solve only the first N instances")
    ap.add_argument("--start", type=int, default=0, help="skip the first N instances")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per instance")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", default=None, help="solve only these instance files")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--retry-unproven", type=float, default=0.0,
                    help="seconds for a second, warm-started solve of instances not proven optimal")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    params = SolverParams(time_limit_s=args.time_limit, num_workers=args.workers, seed=args.seed)
    rows = run(args.set, args.limit, params, args.start, args.only, args.tag, args.retry_unproven)
    s = summary(rows)
    logger.info("%s: %d/%d at reference, mean dev %.3f%%, mean %.2fs/instance", args.set,
                s["at_reference"], s["instances"], s["mean_dev_pct"], s["mean_wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
