"""Scheduler scaling bench: time and quality vs task count on training-step-like graphs.

Usage::

    python -m bench.scheduler_scaling [--sizes 1000 5000 20000 50000 100000]
        [--block-size B] [--rounds K] [--seed S]

Graphs: ``training_step_graph`` builds an FSDP + tensor-parallel style step: per layer a
weight all-gather, a forward chain with a synchronous TP all-reduce, a backward
dgrad/wgrad pair with a re-gather, a gradient reduce-scatter and an optimizer update.
The input order is the program order with every collective synchronous (no overlap).
Writes ``bench/results/scheduler_scaling.csv`` and ``.md``.

References: Concerto (ASPLOS'25) §4.4 (odd-even scheduling), §6 (scalability).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import random
import sys
import time

from concerto_jax.scheduler.oddeven import OddEvenOptions
from concerto_jax.scheduler.schedule import ScheduleOptions, schedule
from concerto_jax.simulator import lower_bounds
from concerto_jax.taskgraph import CollectiveInfo, Task, TaskGraph, TaskKind

logger = logging.getLogger("bench.scheduler_scaling")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def training_step_graph(num_tasks: int, seed: int = 0, comm_scale: float = 1.0) -> TaskGraph:
    """A random training-step-like graph with about ``num_tasks`` tasks (10 per layer).

    Args:
      num_tasks: approximate size.
      seed: RNG seed.
      comm_scale: multiplies collective durations (1.0: comm about 60% of compute).
    """
    rng = random.Random(seed)
    layers = max(1, num_tasks // 10)
    tasks: list[Task] = []
    preds: list[list[int]] = []

    def add(name, kind, dur, deps, nbytes=0, op=""):
        coll = None
        if kind is TaskKind.COLLECTIVE:
            coll = CollectiveInfo(op=op, bytes=nbytes, group_size=8, groups_key=(op, 8))
        tasks.append(Task(name, kind, dur, 1 if coll else 0, out_bytes=nbytes or 1 << 20,
                          opcode=op or "fusion", collective=coll))
        preds.append(list(deps))
        return len(tasks) - 1

    def comp():
        return rng.lognormvariate(4.0, 0.5)  # ~55 µs median

    def comm(base):
        return comm_scale * base * rng.uniform(0.5, 1.5)

    C, K = TaskKind.COMPUTE, TaskKind.COLLECTIVE
    x = add("input", C, 5.0, [])
    fa, fb = [], []
    for layer in range(layers):
        ag = add(f"ag.{layer}", K, comm(40), [], 1 << 22, "all-gather")
        a = add(f"fwd_a.{layer}", C, comp(), [x, ag])
        b = add(f"fwd_b.{layer}", C, comp(), [a])
        ar = add(f"tp_ar.{layer}", K, comm(15), [b], 1 << 20, "all-reduce")
        x = add(f"fwd_c.{layer}", C, comp() * 0.3, [ar])
        fa.append(a)
        fb.append(b)
    g = add("loss", C, 10.0, [x])
    for layer in reversed(range(layers)):
        ag = add(f"bwd_ag.{layer}", K, comm(40), [], 1 << 22, "all-gather")
        d = add(f"dgrad.{layer}", C, comp(), [g, fb[layer], ag])
        w = add(f"wgrad.{layer}", C, comp(), [g, fa[layer]])
        rs = add(f"rs.{layer}", K, comm(45), [w], 1 << 22, "reduce-scatter")
        add(f"update.{layer}", C, comp() * 0.2, [rs])
        g = d
    return TaskGraph(tasks, preds)


@dataclasses.dataclass(frozen=True)
class Row:
    """One scheduled graph."""

    tasks: int  # task count
    block_size: int  # odd-even b
    rounds: int  # odd-even k (maximum)
    input_us: float  # program order, synchronous collectives
    heuristic_us: float  # list heuristic
    justified_us: float  # the best list schedule after forward-backward justification
    final_us: float  # after odd-even
    lower_bound_us: float  # max(sum compute, sum comm, critical path)
    gap_pct: float  # 100 * (final - lb) / lb
    heuristic_s: float  # time of the heuristic (both list schedules)
    justified_s: float  # time of their justification (heuristics.justified_schedule)
    odd_even_s: float  # time of the odd-even search
    total_s: float  # schedule() wall time
    blocks_solved: int  # CP-SAT windows solved
    blocks_accepted: int  # improvements kept


def run_case(n: int, block_size: int, rounds: int, seed: int, budget: float | None) -> Row:
    g = training_step_graph(n, seed)
    initial = g.synchronous_schedule()
    opts = ScheduleOptions(full_model_max_tasks=0, seed=seed,
                           odd_even=OddEvenOptions(block_size=block_size, rounds=rounds,
                                                   seed=seed, time_budget_s=budget))
    res = schedule(g, opts, initial=initial)
    lb = lower_bounds(g).bound_us
    st = res.stats
    return Row(len(g), block_size, rounds, res.input_makespan_us, st["heuristic_makespan_us"],
               st["heuristic_justified_makespan_us"], res.makespan_us, lb,
               100.0 * (res.makespan_us - lb) / lb, st["heuristic_s"], st["heuristic_justified_s"],
               st.get("odd_even_s", 0.0), res.wall_time_s, st.get("odd_even_solved", 0),
               st.get("odd_even_accepted", 0))


def write(rows: list[Row], name: str, command: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, name)
    fields = [f.name for f in dataclasses.fields(Row)]
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow([getattr(r, k) for k in fields])
    lines = [f"# Scheduler scaling ({name})", "", f"Command: `{command}` (CPU, {os.cpu_count()} "
             "cores shared with other jobs; CP-SAT 1 worker per block).", "",
             "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    for r in rows:
        vals = [getattr(r, k) for k in fields]
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v)
                                       for v in vals) + " |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000, 50000, 100000])
    ap.add_argument("--block-size", type=int, nargs="+", default=[OddEvenOptions.block_size])
    ap.add_argument("--rounds", type=int, nargs="+", default=[OddEvenOptions.rounds])
    ap.add_argument("--budget", type=float, default=OddEvenOptions.time_budget_s,
                    help="odd-even wall budget (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="scheduler_scaling")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    rows = []
    cmd = "python -m bench.scheduler_scaling " + " ".join(argv or sys.argv[1:])
    for n in args.sizes:
        for b in args.block_size:
            for k in args.rounds:
                t = time.perf_counter()
                rows.append(run_case(n, b, k, args.seed, args.budget))
                logger.info("%s (%.1fs)", rows[-1], time.perf_counter() - t)
                write(rows, args.name, cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
