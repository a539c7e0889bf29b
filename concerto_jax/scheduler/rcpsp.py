"""Generic RCPSP (renewable cumulative resources, precedence, makespan) solved with CP-SAT.

The model follows the OR-tools samples (``rcpsp_sat``): one interval per task named
from its index, ``AddCumulative`` per resource (``AddNoOverlap`` when a resource is
unary), precedence as linear inequalities, a makespan variable minimised. It is
tightened with a horizon from a serial schedule-generation heuristic (which also
provides the solution hint), per-task time windows from forward/backward longest
paths, and the critical-path and energy lower bounds. Strengthening (facts from the
OR-tools ``rcpsp_sat`` example, our own code): the makespan is also an interval
``[makespan, horizon]`` demanding each resource's full capacity, so the cumulative
propagators push it; delayed precedences ``start_j >= end_i + gap`` from the
transitive closure, ``gap`` the energy bound of the tasks strictly between ``i`` and
``j`` (kept when longer than the path between them); ``push_all_tasks_toward_start``;
with 2+ workers the full-problem worker runs a set-times search (earliest start,
minimum value) beside CP-SAT's scheduling LNS.

References: Concerto (ASPLOS'25) §4.2 (program scheduling as RCPSP); Kolisch &
Hartmann, "Heuristic algorithms for the RCPSP" (serial SGS).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from ortools.sat.python import cp_model

from concerto_jax.scheduler.progress import Progress, SolutionProgress
from concerto_jax.scheduler.sgs import (
    earliest_starts,
    latest_tails,
    resource_lower_bound,
    serial_sgs_best,
    topological_order,
)

logger = logging.getLogger(__name__)


class SchedulerError(RuntimeError):
    """The solver failed (no solution within the limits, or an invalid model)."""


class SolverTimeout(SchedulerError):
    """CP-SAT found no solution within its time limit (status UNKNOWN): not a failure of the
    model; a caller holding a heuristic schedule keeps it."""


@dataclasses.dataclass(frozen=True)
class SolverParams:
    """CP-SAT parameters passed through to the solver."""

    time_limit_s: float = 10.0  # wall-clock limit of one solve
    num_workers: int = 2  # CP-SAT search workers (1 makes the search deterministic)
    seed: int = 0  # CP-SAT random seed
    log_search: bool = False  # CP-SAT search log on stderr
    export_path: str | None = None  # debug: write the model proto here before solving
    deterministic_time: float | None = None  # CP-SAT deterministic-time limit (reproducible)
    progress: bool = False  # log a throttled line per improving solution (INFO, with elapsed time)


@dataclasses.dataclass(frozen=True)
class RcpspInstance:
    """A single-mode RCPSP instance.

    Attributes:
      durations: integer duration of each task.
      demands: ``demands[i][r]`` units of resource ``r`` used by task ``i`` while it runs.
      capacities: capacity of each renewable resource.
      successors: ``successors[i]`` tasks that may start only after ``i`` ends.
      name: for logs and result tables.
    """

    durations: tuple[int, ...]
    demands: tuple[tuple[int, ...], ...]
    capacities: tuple[int, ...]
    successors: tuple[tuple[int, ...], ...]
    name: str = ""

    def __post_init__(self):
        n = len(self.durations)
        if len(self.demands) != n or len(self.successors) != n:
            raise ValueError(
                f"instance {self.name!r}: {n} durations, {len(self.demands)} demand rows and "
                f"{len(self.successors)} successor lists; all three must have one entry per task"
            )
        for i, row in enumerate(self.demands):
            if len(row) != len(self.capacities):
                raise ValueError(f"task {i} has {len(row)} demands, expected {len(self.capacities)}")
            for r, q in enumerate(row):
                if q > self.capacities[r]:
                    raise ValueError(
                        f"task {i} needs {q} of resource {r} but its capacity is {self.capacities[r]}"
                    )

    @property
    def num_tasks(self) -> int:
        return len(self.durations)


@dataclasses.dataclass(frozen=True)
class RcpspResult:
    """Outcome of one RCPSP solve.

    Attributes:
      status: CP-SAT status name (``OPTIMAL``, ``FEASIBLE``, ...), or ``HEURISTIC`` when
        only the schedule-generation heuristic ran.
      makespan: the schedule's makespan.
      starts: start time of each task.
      lower_bound: best proven lower bound on the optimal makespan.
      wall_time_s: wall time of the whole call (heuristic, model building and solve).
      heuristic_makespan: makespan of the heuristic schedule used as hint and horizon.
    """

    status: str
    makespan: int
    starts: tuple[int, ...]
    lower_bound: int
    wall_time_s: float
    heuristic_makespan: int

    @property
    def optimal(self) -> bool:
        return self.makespan == self.lower_bound


def energy_delays(instance: RcpspInstance, max_tasks: int = 400) -> list[tuple[int, int, int]]:
    """``(i, j, gap)``: ``start_j >= end_i + gap`` for ``j`` a transitive successor of ``i``.

    ``gap`` = max over resources of ceil(energy of the tasks strictly between ``i`` and
    ``j`` / capacity); only gaps longer than the longest path between them are kept
    (the others are implied by the precedences). Skipped above ``max_tasks`` tasks
    (the closure is quadratic).
    """
    n = instance.num_tasks
    if n > max_tasks:
        return []
    dur = instance.durations
    succs = instance.successors
    order = topological_order(succs)
    after = [0] * n  # bitset of transitive successors
    for i in reversed(order):
        b = 0
        for s in succs[i]:
            b |= after[s] | (1 << s)
        after[i] = b
    before = [0] * n
    for i in range(n):
        b = after[i]
        while b:
            low = b & -b
            before[low.bit_length() - 1] |= 1 << i
            b ^= low
    energy = [[dur[k] * instance.demands[k][r] for k in range(n)]
              for r in range(len(instance.capacities))]
    # Longest path from end_i to start_j (0 for a direct successor).
    out = []
    for i in order:
        b = after[i]
        while b:
            low = b & -b
            j = low.bit_length() - 1
            b ^= low
            common = after[i] & before[j]
            if not common:
                continue
            ks = []
            c = common
            while c:
                lo = c & -c
                ks.append(lo.bit_length() - 1)
                c ^= lo
            gap = 0
            for r, cap in enumerate(instance.capacities):
                e = sum(energy[r][k] for k in ks)
                if e:
                    gap = max(gap, -(-e // cap))
            path = _longest_between(ks, dur, succs) if gap else 0
            if gap > path:
                out.append((i, j, gap))
    return out


def _longest_between(ks, dur, succs) -> int:
    """Longest chain (durations) through the tasks ``ks`` (all between i and j)."""
    kset = set(ks)
    best: dict[int, int] = {}
    longest = 0
    # Kahn over the tasks of ks (edges inside ks only).
    indeg = {k: 0 for k in ks}
    for k in ks:
        for s in succs[k]:
            if s in kset:
                indeg[s] += 1
    stack = [k for k in ks if indeg[k] == 0]
    while stack:
        k = stack.pop()
        v = best.get(k, 0) + dur[k]
        longest = max(longest, v)
        for s in succs[k]:
            if s in kset:
                if v > best.get(s, 0):
                    best[s] = v
                indeg[s] -= 1
                if indeg[s] == 0:
                    stack.append(s)
    return longest


def solution_callback(params: SolverParams, what: str, scale: float = 1.0, unit: str = ""):
    """A progress callback for ``solver.solve`` when ``params.progress`` (else None)."""
    if not params.progress:
        return None
    progress = Progress(logger, what)
    return SolutionProgress(progress, scale, unit) if progress.enabled else None


def make_solver(params: SolverParams) -> cp_model.CpSolver:
    """A ``CpSolver`` configured from ``params``."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(params.time_limit_s)
    solver.parameters.num_workers = int(params.num_workers)
    solver.parameters.random_seed = int(params.seed)
    solver.parameters.log_search_progress = bool(params.log_search)
    if params.deterministic_time is not None:
        solver.parameters.max_deterministic_time = float(params.deterministic_time)
    return solver


def solve_rcpsp(
    instance: RcpspInstance,
    params: SolverParams = SolverParams(),
    hint: Sequence[int] | None = None,
) -> RcpspResult:
    """Minimise the makespan of an RCPSP instance with CP-SAT.

    Args:
      instance: the problem.
      params: solver parameters (time limit, workers, seed).
      hint: start times of a feasible schedule to warm-start from; by default the best
        serial-SGS schedule is used.

    Returns:
      The best schedule found, with the proven lower bound and status.

    Raises:
      SchedulerError: the solver found no solution (not even the hint) in time.

    References: Concerto (ASPLOS'25) §4.2; OR-tools ``rcpsp_sat`` sample.
    """
    t0 = time.perf_counter()
    n = instance.num_tasks
    dur = instance.durations
    succs = instance.successors
    heur_starts, heur_makespan = serial_sgs_best(instance)
    if hint is not None:
        hint = tuple(int(s) for s in hint)
        hint_makespan = max(hint[i] + dur[i] for i in range(n)) if n else 0
        if hint_makespan < heur_makespan:
            heur_starts, heur_makespan = hint, hint_makespan
    horizon = heur_makespan
    est = earliest_starts(dur, succs)
    tail = latest_tails(dur, succs)
    lb = max([est[i] + tail[i] for i in range(n)] + [resource_lower_bound(instance), 0])
    if lb >= horizon:
        return RcpspResult("OPTIMAL", horizon, tuple(heur_starts), horizon,
                           time.perf_counter() - t0, heur_makespan)

    model = cp_model.CpModel()
    task_to_start = []
    task_to_interval = []
    for i in range(n):
        start = model.new_int_var(est[i], horizon - tail[i], f"start_{i}")
        interval = model.new_fixed_size_interval_var(start, dur[i], f"interval_{i}")
        task_to_start.append(start)
        task_to_interval.append(interval)
    makespan = model.new_int_var(lb, horizon, "makespan")
    # The makespan as an interval [makespan, horizon] that fills every resource: the
    # cumulative propagators then push the makespan too (OR-tools rcpsp_sat sample).
    makespan_size = model.new_int_var(1, horizon + 1 - lb, "makespan_size")
    makespan_interval = model.new_interval_var(makespan, makespan_size, horizon + 1,
                                               "makespan_interval")
    for i in range(n):
        for s in succs[i]:
            model.add(task_to_start[i] + dur[i] <= task_to_start[s])
        if not succs[i]:
            model.add(task_to_start[i] + dur[i] <= makespan)
    for r, cap in enumerate(instance.capacities):
        users = [i for i in range(n) if instance.demands[i][r] > 0 and dur[i] > 0]
        if not users:
            continue
        model.add_cumulative(
            [task_to_interval[i] for i in users] + [makespan_interval],
            [instance.demands[i][r] for i in users] + [cap],
            cap,
        )
    # Redundant delayed precedences: every task strictly between i and j in the
    # precedence order runs inside [end_i, start_j], so that gap is at least the
    # energy of those tasks on any resource divided by its capacity.
    for i, j, gap in energy_delays(instance):
        model.add(task_to_start[i] + dur[i] + gap <= task_to_start[j])
    model.minimize(makespan)
    for i in range(n):
        model.add_hint(task_to_start[i], heur_starts[i])
    model.add_hint(makespan, heur_makespan)
    if params.export_path:
        model.export_to_file(params.export_path)

    # The time limit covers the whole call: the heuristic and model building count too.
    remaining = params.time_limit_s - (time.perf_counter() - t0)
    solver = make_solver(dataclasses.replace(params, time_limit_s=max(0.1, remaining)))
    # Portfolio: a set-times search (earliest start first, at its minimum value) on the
    # full-problem worker finds the hard j30 optima far more often than the default
    # LP-guided one in a 10 s budget (measured in bench/results/psplib_j30.md); the other
    # worker keeps CP-SAT's scheduling LNS neighbourhoods.
    if params.num_workers >= 2:
        model.add_decision_strategy(task_to_start, cp_model.CHOOSE_LOWEST_MIN,
                                    cp_model.SELECT_MIN_VALUE)
        solver.parameters.subsolvers.append("fixed")
        if params.num_workers >= 3:
            solver.parameters.subsolvers.append("default_lp")
    solver.parameters.push_all_tasks_toward_start = True
    status = solver.solve(model, solution_callback(params, f"CP-SAT {instance.name}"))
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SchedulerError(
            f"CP-SAT returned {solver.status_name(status)} on {instance.name!r} within "
            f"{params.time_limit_s}s; raise time_limit_s or check the instance"
        )
    starts = tuple(int(solver.value(v)) for v in task_to_start)
    value = int(solver.objective_value)
    bound = max(lb, int(round(solver.best_objective_bound)))
    if status == cp_model.OPTIMAL:
        bound = value
    logger.debug("%s: %s makespan %d bound %d (heuristic %d) in %.2fs", instance.name,
                 solver.status_name(status), value, bound, heur_makespan, wall)
    return RcpspResult(solver.status_name(status), value, starts, bound, wall, heur_makespan)
