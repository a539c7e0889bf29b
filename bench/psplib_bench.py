"""PSPLIB bench: solve j30/j60 with the generic RCPSP entry point, compare with the optima.

Usage::

    python -m bench.psplib_bench --set j30 [--limit N] [--time-limit S] [--workers W]
    python -m bench.psplib_bench --set /path/to/any/psplib/set   # a directory of .sm files

Where the instances are: ``--set`` is a directory (absolute or relative to the current
directory) or a set name under the PSPLIB root, which is ``$PSPLIB_ROOT`` if set, else
``../shared/psplib`` next to the repository. Reference optima are read from
``<set>/optimum/optimum.csv`` when present (else deviations are left empty).

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
import time

from concerto_jax.scheduler.psplib import load_optima, load_psplib
from concerto_jax.scheduler.rcpsp import SolverParams, solve_rcpsp

logger = logging.getLogger("bench.psplib")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PSPLIB_ROOT = os.path.join(os.path.dirname(REPO_ROOT), "shared", "psplib")
"""``../shared/psplib`` relative to the repository (the workspace layout)."""


def _main_checkout(repo: str) -> str | None:
    """For a git worktree (``.git`` is a file ``gitdir: <main>/.git/worktrees/<name>``): ``<main>``."""
    dot_git = os.path.join(repo, ".git")
    if not os.path.isfile(dot_git):
        return None
    with open(dot_git) as f:
        line = f.readline().strip()
    if not line.startswith("gitdir:"):
        return None
    gitdir = os.path.normpath(os.path.join(repo, line.partition(":")[2].strip()))
    parts = gitdir.split(os.sep)
    return os.sep.join(parts[:parts.index(".git")]) if ".git" in parts else None


def psplib_root() -> str:
    """``$PSPLIB_ROOT`` if set, else ``../shared/psplib`` relative to the repository.

    In a git worktree, the main checkout's ``../shared/psplib`` is tried second.
    """
    if os.environ.get("PSPLIB_ROOT"):
        return os.environ["PSPLIB_ROOT"]
    main = _main_checkout(REPO_ROOT)
    if not os.path.isdir(DEFAULT_PSPLIB_ROOT) and main is not None:
        candidate = os.path.join(os.path.dirname(main), "shared", "psplib")
        if os.path.isdir(candidate):
            return candidate
    return DEFAULT_PSPLIB_ROOT


def resolve_set(set_arg: str) -> tuple[str, str]:
    """(name, folder) of a set given as a directory or as a name under ``psplib_root()``.

    Raises:
      FileNotFoundError: neither a directory nor a set under the root; says where it looked.
    """
    if os.path.isdir(set_arg):
        folder = os.path.abspath(set_arg)
        return os.path.basename(folder.rstrip(os.sep)), folder
    folder = os.path.join(psplib_root(), set_arg)
    if os.path.isdir(folder):
        return set_arg, folder
    raise FileNotFoundError(
        f"PSPLIB set {set_arg!r}: expected a directory of .sm files or a set name under the "
        f"PSPLIB root {psplib_root()!r}, found neither; pass --set /path/to/set or set PSPLIB_ROOT")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclasses.dataclass(frozen=True)
class Row:
    """One solved instance."""

    instance: str  # file name, e.g. j301_1.sm
    ref_lo: int | None  # best lower bound in the literature (== ref_hi when closed; None: unknown)
    ref_hi: int | None  # best known makespan (None: the set has no optimum.csv entry)
    makespan: int  # ours
    lower_bound: int  # our proven bound
    status: str  # CP-SAT status
    wall_s: float  # wall time of the whole solve
    deviation_pct: float  # 100 * (makespan - ref_hi) / ref_hi


def _natural_key(name: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def instances(folder: str) -> list[str]:
    """The ``.sm`` files of a set folder, in natural order."""
    return sorted((f for f in os.listdir(folder) if f.endswith(".sm")), key=_natural_key)


def run(set_name: str, limit: int | None, params: SolverParams, start: int = 0,
        only: list[str] | None = None, tag: str = "", retry_unproven_s: float = 0.0) -> list[Row]:
    """Solve the first ``limit`` instances of ``set_name`` (from index ``start``, or ``only``).

    With ``retry_unproven_s > 0``, an instance the solver did not *prove* optimal
    within ``params.time_limit_s`` is solved again for up to that many seconds,
    warm-started from the first solution. The decision uses only the solver's own
    status, never the reference optimum.
    """
    set_name, folder = resolve_set(set_name)
    optima_csv = os.path.join(folder, "optimum", "optimum.csv")
    optima = load_optima(optima_csv) if os.path.exists(optima_csv) else {}
    names = instances(folder)[start:]
    names = names[:limit] if limit else names
    if only:
        names = [n for n in instances(folder) if n in set(only)]
    rows: list[Row] = []
    t_run = time.perf_counter()
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
        ref = optima.get(name)
        dev = 100.0 * (res.makespan - ref.hi) / ref.hi if ref is not None else float("nan")
        rows.append(Row(name, ref.lo if ref else None, ref.hi if ref else None, res.makespan,
                        res.lower_bound, res.status, round(wall, 3), dev))
        ref_text = "?" if ref is None else ref.hi if ref.closed else f"{ref.lo}..{ref.hi}"
        elapsed = time.perf_counter() - t_run
        logger.info("[%d/%d] %s: makespan %d (ref %s) %s %.2fs | elapsed %.0f s, eta %.0f s",
                    k + 1, len(names), name, res.makespan, ref_text, res.status, res.wall_time_s,
                    elapsed, elapsed / (k + 1) * (len(names) - k - 1))
        if (k + 1) % 20 == 0 or k + 1 == len(names):
            _write(set_name, rows, params, limit, start, tag, retry_unproven_s)
    return rows


def summary(rows: list[Row]) -> dict:
    n = len(rows)
    all_rows, rows = rows, [r for r in rows if r.ref_hi is not None]  # with a reference
    with_lo = [r for r in rows if r.ref_lo is not None]
    return {
        "instances": n,
        "at_reference": sum(r.makespan <= r.ref_hi for r in rows),
        "better_than_reference": sum(r.makespan < r.ref_hi for r in rows),
        "proven_optimal": sum(r.status == "OPTIMAL" for r in all_rows),
        "mean_dev_pct": statistics.fmean(r.deviation_pct for r in rows) if rows else 0.0,
        "max_dev_pct": max((r.deviation_pct for r in rows), default=0.0),
        "mean_dev_vs_lo_pct": statistics.fmean(100.0 * (r.makespan - r.ref_lo) / r.ref_lo
                                               for r in with_lo) if with_lo else float("nan"),
        "mean_wall_s": statistics.fmean(r.wall_s for r in all_rows) if all_rows else 0.0,
        "max_wall_s": max((r.wall_s for r in all_rows), default=0.0),
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
    worst = sorted((r for r in rows if r.ref_hi is not None), key=lambda r: -r.deviation_pct)[:10]
    if worst and worst[0].deviation_pct > 0:
        lines += ["Instances above the reference:", "", "| instance | ours | reference | dev % | s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r.instance} | {r.makespan} | {r.ref_lo or ''}..{r.ref_hi} | {r.deviation_pct:.2f} "
                  f"| {r.wall_s:.1f} |" for r in worst if r.deviation_pct > 0]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="j30",
                    help="a set name under the PSPLIB root (j30, j60, ...) or a directory of .sm files")
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
