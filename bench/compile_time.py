"""Compile time: stock XLA vs our first compile vs our compile from the plan cache.

A user compiles a step once per job start. Per case, each measurement runs in a fresh
process (what a restarted job pays; nothing warm in memory):

* ``stock_s``: lowering plus XLA's compile of the unmodified step, the same compile that
  ``compile_for_target`` runs for stock (deviceless GPU target), or, for the CPU rows,
  ``jax.jit``'s first call minus a steady call.
* ``first_s``: ``compile_for_target`` with ``Options(passes=("decompose", "schedule"))`` and an
  empty plan cache (CPU rows: ``optimize``'s first call minus a steady call; "GPU route
  rehearsed" rows: the same through ``optimize``'s GPU route on the CPU devices,
  ``gpu_route.rehearse()``: its stages, cache and first-step check as on a GPU, XLA:CPU's
  compiles).
* ``cached_s``: the same call again in a new process with the cache the first one filled.
* ``cut``: what ``Options.deviceless.time_budget_s`` (default "auto") left out of the first compile.
* ``all_s``, ``gain_all`` (``--exhaustive``): the first compile with every combine-threshold
  candidate compiled and no time budget (``combine_compiles=None, time_budget_s=None``): what
  the pruned search's time and gain are judged against.

The gain column is our simulator's (XLA's final modules, stock vs ours; CPU rows have none:
``optimize`` on the CPU mesh is checked, not timed). Ratios are of wall times on the same
machine in the same run. Stage times are ``TargetResult.seconds`` of the first compile.

Command line::

    python -m bench.cli compile_time [--layout NAME ...] [--layers 4] [--suite-case NAME ...]
        [--cpu-case gpt:dp_tp] [--route-case gpt:dp_tp] [--exhaustive] [--out bench/results]

``--suite-case`` adds the decompose suite's cases (``bench.suite``, each on its own cluster
and with its XLA options; ``--suite-case all`` for every one) as compile_for_target rows.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

COLUMNS = ("case", "entry", "stock_s", "first_s", "cached_s", "first_over_stock", "cached_over_stock",
           "cache_hit", "gain", "cut", "all_s", "all_over_stock", "gain_all", "stages_s", "status")
DEFAULT_LAYOUTS = ("tp", "fsdp", "dp_tp")
DEFAULT_CPU_CASES = ("gpt:dp_tp",)
DEFAULT_ROUTE_CASES = ("gpt:dp_tp",)
PASSES = ("decompose", "schedule")


def add_arguments(parser) -> None:
    from bench.heldout_target import LAYOUTS

    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS),
                        help=f"held-out layout compiled for its GPU target (default: {', '.join(DEFAULT_LAYOUTS)})")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--suite-case", action="append", metavar="NAME",
                        help="a decompose suite case (bench.suite) compiled for its GPU target; 'all': every one")
    parser.add_argument("--cpu-case", action="append", metavar="MODEL:LAYOUT",
                        help=f"models/ case through optimize on 8 CPU devices (default: {', '.join(DEFAULT_CPU_CASES)})")
    parser.add_argument("--route-case", action="append", metavar="MODEL:LAYOUT",
                        help="models/ case through optimize's GPU route rehearsed on 8 CPU devices "
                             f"(default: {', '.join(DEFAULT_ROUTE_CASES)})")
    parser.add_argument("--no-cpu", action="store_true", help="skip the optimize rows")
    parser.add_argument("--no-target", action="store_true", help="skip the compile_for_target rows")
    parser.add_argument("--exhaustive", action="store_true",
                        help="also compile each held-out case with every threshold candidate and no time budget "
                             "(all_s, gain_all: what the pruned search is judged against)")
    parser.add_argument("--out", default="bench/results")


# -- workers (one fresh process each) --------------------------------------------------------

def _worker_target(kind: str, layout: str, layers: int, cache_dir: str) -> dict:
    import concerto_jax
    from bench.heldout_target import build
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless.compile import compile_lowered, lower_for_target

    step, params, opt_state, data, cluster = build(layout, layers)
    t0 = time.perf_counter()
    if kind == "stock":
        compile_lowered(lower_for_target(step.trace(params, opt_state, data)), get_cluster(cluster))
        return {"wall_s": time.perf_counter() - t0}
    # "all": every threshold candidate compiled, no time budget (what the pruning is judged against)
    search = {"combine_compiles": None, "time_budget_s": None} if kind == "all" else {}
    res = concerto_jax.compile_for_target(step, params, opt_state, data, target=cluster, options=concerto_jax.Options(
        passes=PASSES, target=cluster, cache_dir=cache_dir,
        deviceless=concerto_jax.DevicelessOptions(**search)))
    return _ours(res, get_cluster(cluster), time.perf_counter() - t0)


def _ours(res, cluster, wall: float) -> dict:
    """A worker's record of one ``compile_for_target`` result: wall time, cache hit, gain."""
    from concerto_jax.costmodel import CostModel
    from concerto_jax.judge import judge_module

    cm = CostModel(cluster)
    gain = judge_module(res.stock_final_text, cm).us / judge_module(res.final_text, cm).us
    return {"wall_s": wall, "hit": "plan_cache" in res.seconds, "gain": gain,
            "seconds": {k: round(v, 1) for k, v in res.seconds.items()}, "fallback": res.fallback_reason,
            "cut": list(res.cut)}


def _worker_suite(kind: str, name: str, cache_dir: str) -> dict:
    """A decompose suite case (``bench.suite``) as ``_worker_target`` times a held-out one: its
    step, cluster and XLA options as ``bench.decompose_bench`` builds them."""
    import concerto_jax
    from bench.decompose_bench import _case_step
    from bench.suite import get_case
    from concerto_jax.deviceless.compile import CompileOptions, compile_lowered, lower_for_target

    case = get_case(name)
    c, cluster = _case_step(case)
    xla = dict(case.xla_options)
    t0 = time.perf_counter()
    if kind == "stock":
        compile_lowered(lower_for_target(c.step.trace(c.abstract_state, c.abstract_batch)), cluster,
                        CompileOptions(extra=tuple(xla.items())))
        return {"wall_s": time.perf_counter() - t0}
    search = {"combine_compiles": None, "time_budget_s": None} if kind == "all" else {}
    res = concerto_jax.compile_for_target(c.step, c.abstract_state, c.abstract_batch, target=case.cluster,
                                          options=concerto_jax.Options(
                                              passes=PASSES, target=case.cluster, compiler_options=xla,
                                              cache_dir=cache_dir, deviceless=concerto_jax.DevicelessOptions(**search)))
    return _ours(res, cluster, time.perf_counter() - t0)


def _worker_cpu(kind: str, case_name: str, cache_dir: str, rehearse: bool = False) -> dict:
    import contextlib

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import concerto_jax
    import models

    model, layout = case_name.split(":")
    case = models.make_case(model, layout, "tiny")
    hits = []

    class _Hits(logging.Handler):
        def emit(self, record):
            if "plan cache hit" in record.getMessage() or "loaded our executable" in record.getMessage():
                hits.append(record.getMessage())

    logging.getLogger("concerto_jax").addHandler(_Hits(level=logging.INFO))
    logging.getLogger("concerto_jax").setLevel(logging.INFO)
    step = case.step if kind == "stock" else concerto_jax.optimize(
        case.step, concerto_jax.Options(passes=PASSES, cache_dir=cache_dir))
    if rehearse:
        from concerto_jax.gpu_route import route
    with route.rehearse() if rehearse else contextlib.nullcontext():
        state = case.init_state(0)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, case.batch))  # the step donates its state
        first = time.perf_counter() - t0
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            state, _ = jax.block_until_ready(step(state, case.batch))
            steady.append(time.perf_counter() - t0)
    return {"wall_s": max(first - statistics.median(steady), 0.0), "hit": bool(hits)}


def _run_worker(*args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "bench.compile_time", "--worker", *args],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {' '.join(args)} exited {proc.returncode}: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- rows ------------------------------------------------------------------------------------

def _row(case: str, entry: str, worker_args, exhaustive: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="concerto-compile-time-") as cache_dir:
        stock = _run_worker(*worker_args("stock", cache_dir))
        log.info("%s stock: %.1f s", case, stock["wall_s"])
        first = _run_worker(*worker_args("ours", cache_dir))
        log.info("%s ours, first: %.1f s", case, first["wall_s"])
        cached = _run_worker(*worker_args("ours", cache_dir))
        log.info("%s ours, cached: %.1f s (hit: %s)", case, cached["wall_s"], cached["hit"])
        every = {}
        if exhaustive:
            every = _run_worker(*worker_args("all", cache_dir))
            log.info("%s ours, every threshold candidate: %.1f s", case, every["wall_s"])
    stages = first.get("seconds") or {}
    status = "ok"
    if first.get("hit"):
        status = "error: the first compile hit a cache"
    elif not cached.get("hit"):
        status = "cache miss on the second compile"
    elif first.get("fallback"):
        status = f"fallback: {first['fallback']}"
    return {"case": case, "entry": entry, "stock_s": round(stock["wall_s"], 2), "first_s": round(first["wall_s"], 2),
            "cached_s": round(cached["wall_s"], 2),
            "first_over_stock": round(first["wall_s"] / stock["wall_s"], 2) if stock["wall_s"] else "",
            "cached_over_stock": round(cached["wall_s"] / stock["wall_s"], 2) if stock["wall_s"] else "",
            "cache_hit": cached.get("hit"), "gain": round(first["gain"], 4) if "gain" in first else "",
            "cut": "; ".join(first.get("cut") or ()),
            "all_s": round(every["wall_s"], 2) if every else "",
            "all_over_stock": round(every["wall_s"] / stock["wall_s"], 2) if every and stock["wall_s"] else "",
            "gain_all": round(every["gain"], 4) if "gain" in every else "",
            "stages_s": " ".join(f"{k} {v}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1])[:6]),
            "status": status}


def write(rows: list[dict], out: str, command: str, elapsed: float) -> None:
    import csv

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compile_time.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    import jax

    ok = [r for r in rows if r.get("status") == "ok"]
    lines = ["# Compile time: stock XLA vs ours (first compile, from the plan cache)", "",
             __doc__.split("\n\n", 1)[1].split("Command line::")[0].strip(), "",
             f"Command: `{command}`; {elapsed:.0f} s; jax {jax.__version__}; {os.cpu_count()} CPU cores. "
             "Wall times measured on this machine; gains simulated.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    if ok:
        lines += ["", f"Median first / stock {statistics.median(r['first_over_stock'] for r in ok):.2f}x, "
                      f"median cached / stock {statistics.median(r['cached_over_stock'] for r in ok):.2f}x "
                      f"over {len(ok)} cases."]
        for group in ("heldout", "suite"):
            some = [r for r in ok if r["case"].startswith(group + " ")]
            if some and len(some) < len(ok):
                lines += [f"{group}: median first / stock "
                          f"{statistics.median(r['first_over_stock'] for r in some):.2f}x, "
                          f"largest {max(r['first_over_stock'] for r in some):.2f}x over {len(some)} cases."]
    with open(os.path.join(out, "compile_time.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def run(args, command: str) -> list[dict]:
    rows, t0 = [], time.perf_counter()
    cases = [] if args.no_target else [("target", layout) for layout in (args.layout or DEFAULT_LAYOUTS)]
    if args.suite_case:
        from bench.suite import SUITE, get_case

        names = [c.name for c in SUITE] if "all" in args.suite_case else [get_case(n).name for n in args.suite_case]
        cases += [("suite", n) for n in names]
    if not args.no_cpu:
        cases += [("optimize", c) for c in (args.cpu_case or DEFAULT_CPU_CASES)]
        cases += [("route", c) for c in (args.route_case or DEFAULT_ROUTE_CASES)]
    for entry, name in cases:
        if entry == "target":
            def worker_args(kind, cache_dir, name=name):
                return ("target", kind, name, str(args.layers), cache_dir)
            label = f"heldout {name} ({args.layers} layers)"
        elif entry == "suite":
            def worker_args(kind, cache_dir, name=name):
                return ("suite", kind, name, cache_dir)
            label = f"suite {name}"
        else:
            def worker_args(kind, cache_dir, name=name, entry=entry):
                return (entry, kind, name, cache_dir)
            label = f"{name} tiny, 8 CPU devices" + (", GPU route rehearsed" if entry == "route" else "")
        try:
            rows.append(_row(label, {"target": "compile_for_target", "suite": "compile_for_target",
                                     "optimize": "optimize", "route": "optimize (GPU route)"}[entry],
                             worker_args, exhaustive=args.exhaustive and entry in ("target", "suite")))
        except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
            log.exception("%s failed", label)
            rows.append({"case": label, "status": f"error: {type(e).__name__}: {str(e)[:200]}"})
        write(rows, args.out, command, time.perf_counter() - t0)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        kind, rest = argv[1], argv[2:]
        if kind == "target":
            out = _worker_target(rest[0], rest[1], int(rest[2]), rest[3])
        elif kind == "suite":
            out = _worker_suite(rest[0], rest[1], rest[2])
        else:
            out = _worker_cpu(rest[0], rest[1], rest[2], rehearse=kind == "route")
        print(json.dumps(out))
        return 0
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.compile_time", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), argv)


def run_from_args(args, argv) -> int:
    """The bench from parsed arguments; prints the markdown table; 0 when every row is ok."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = [a for a in argv if a != "compile_time"]
    rows = run(args, " ".join(["python -m bench.cli compile_time", *argv]))
    with open(os.path.join(args.out, "compile_time.md")) as f:
        sys.stdout.write(f.read())
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
