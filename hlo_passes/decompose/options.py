"""Options of the ``decompose`` pass: one frozen dataclass, one comment per field."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecomposeOptions:
    """How the ``decompose`` pass searches and judges strategies."""

    # Count independent compute without per-kernel launch overhead in the critical rule
    # (the unfused graph's small ops fuse on the GPU; see critical.find_critical).
    fused_slack: bool = True
    # Which collectives are critical: "schedule" (the P/S/I rule first, then the stall the
    # judge's simulated schedule leaves at each collective's DONE; see critical.py) or
    # "psi" (the paper's sum rule alone: on full train steps it finds none).
    criticality: str = "schedule"
    # Critical when the exposed time exceeds max(min_exposed_us, min_exposed_frac x time).
    min_exposed_us: float = 1.0
    min_exposed_frac: float = 0.05
    # Odd-even rounds of the judge's schedule (the schedule pass's scheduler with its
    # memory rule, whole-graph CP-SAT off): the criticality and every joint evaluation use
    # it. 0: the list heuristic alone (fast; under the memory rule it often falls back
    # to program order, which overlaps nothing).
    judge_rounds: int = 1
    # Degrees tried per context: powers of two up to this (bounded by the shape).
    max_degree: int = 8
    # Members per side of a context (BFS limit).
    max_context_ops: int = 256
    # Stop a context side once its compute reaches this multiple of the collective's time.
    cover_factor: float = 1.0
    # Also price each two-sided context with only its pre side or only its post side
    # split (Context.trimmed): the slices / concatenations of one side can cost more
    # than that side hides.
    one_sided: bool = True
    # Judge the chosen strategies by scheduling + simulating the rewritten graph and
    # revise them (other degree, other axis, none) where that is faster (joint search).
    joint: bool = True
    # At most this many rewrite-schedule-simulate evaluations in the joint search.
    joint_max_evaluations: int = 24
    # Per chosen collective, "none" and at most this many other strategies (the best
    # predicted first) are simulated.
    joint_alternatives: int = 2
    # Decompose collectives inside while bodies (scanned layers) too.
    loop_bodies: bool = True
    # Path of the measured calibration JSON (None: the one shipped with the package).
    calibration_path: str | None = None
    # CP-SAT wall limit of the strategy choice.
    choice_time_limit_s: float = 5.0
    # Testing / ablation only: take, for every critical collective, the candidate of
    # this degree (and axis, if set) whatever its predicted gain, critical or not; no
    # joint revision.
    force_degree: int | None = None
    force_axis: int | None = None
    # Relative tolerance the pass declares to the first-step check when a decomposed
    # context holds a dot or convolution (XLA:CPU may block a chunk's GEMM differently:
    # observed max relative 4e-5, tests/test_decompose_rules.py); other splits keep every
    # element's arithmetic and are declared bitwise (0).
    split_tolerance: float = 1e-4
    # Where the pass is given XLA's scheduled module of the step (PassInputs.fused_reference:
    # compile_for_target), fused_costs' ``unmapped`` rule for instructions mapped to no XLA
    # kernel: "zero" (their time is already in the kernels XLA folded them into: totals
    # equal XLA's kernel time on all 8 bench cases) or "estimate" (their unfused estimate: 0.2-7.5 % more compute).
    fused_unmapped: str = "zero"
    # With fused costs: the slices / concatenations a split adds cost their unfused estimate
    # ("estimate": a memory pass each) or nothing ("zero": XLA fuses them into the
    # neighbouring kernels). Measured in docs/DECISIONS.md D22.
    split_copies: str = "estimate"
    # Which splits isolate their chunks: chunk k >= 1 reads every operand from outside its
    # context through its own chain of k opt-barriers (split_instructions(isolate=True));
    # without them XLA's GPU pipeline fuses the chunks back together (sibling multi-output
    # fusion, dot merger: they share weights and norms) and the merged kernel waits for
    # every chunk's collective. "regions" (default): region splits only; "all": contexts
    # too; "none". Measured (docs/DECISIONS.md D24): a region split of
    # gpt_tp8_nvlink is 10,306.2 us without, 8,379.0 with; the context split kept on
    # gpt_dp2_tp8_2hosts 7,024.7 without, 7,170.8 with.
    isolate_chunks: str = "regions"
    # Region strategy (hlo_passes.decompose.region), tried first: in every computation, the
    # best-scoring region of a collective is split into this many chunks (micro-batches of
    # the whole step sharing the weights, weight gradients summed). Where no computation has
    # a region with a positive score, the per-collective contexts are searched instead.
    # None: contexts only. Ignored with force_degree (tests of the contexts).
    region_degree: int | None = 2
    # In a while body (scanned layers), the region also takes the loop state it reads split
    # (grow_through_carries) and that state is carried in chunks across iterations
    # (hlo_passes.decompose.rewrite.split_while_body): sliced once before the loop and
    # concatenated once after it, instead of in every iteration. False: the body is split
    # alone (every iteration slices and concatenates its carried activations).
    carry_chunks: bool = True
    # A region also takes in the outside operands it would slice that can split at their
    # own sources (region.pull_in_inputs): a loss's targets are sliced as s32[batch, seq]
    # instead of as the f32[batch, seq, vocab] one-hot XLA would materialise to slice it.
    region_pull_in: bool = True
    # Relative tolerance declared when a region has partial members (sums reassociated).
    region_tolerance: float = 1e-3
    # Half-precision partial sums (a bf16 bias gradient) reduce each chunk in f32 and round
    # once (closer to an f32 reference than stock bf16, which rounds its sums in bf16), at a
    # cost: XLA no longer fuses those reductions with their siblings (gpt_tp8_nvlink, XLA's
    # final module: 8,379.0 -> 8,597.3 us). Off: each chunk rounds to bf16 before the add.
    wide_partials: bool = False
    # A partial column reduce over the split axis and other axes (a norm's weight gradient:
    # a sum over batch and sequence, split along the batch) whose chunks fall under XLA's GPU
    # tree-reduction bound (4,096 rows) while the original does not: each chunk reduces over
    # the other axes only, keeping the split axis, and the chunks' sum is reduced over it
    # once (hlo_passes.decompose.rewrite._kept_axis; f32 reduces, half-precision ones with
    # wide_partials). Otherwise XLA materialises such a chunk's f32 input instead of fusing
    # the reduce with dx. Held-out TP step (8,192 -> 4,096 rows): 7,985.7 -> 7,528.6 us of
    # kernels, 1.203x -> 1.272x (docs/DECISIONS.md D25). Reassociates the same sums.
    partials_keep_axis: bool = True
    # After a while body's region split, rotate the loop around one of the body's
    # collectives (hlo_passes.pipeline_loops.rotate_loop: the last chunk's final collective of
    # iteration i completes during iteration i + 1, against the next layer's first chunk)
    # where the rotated body schedules faster within the body's memory limit
    # (hlo_passes.pipeline_loops.decide_rotation). Bitwise: only the order changes.
    rotate_loops: bool = True
    # All-reduces (reduce-scatters, all-gathers) of an operand that every device of an
    # orthogonal group holds equal (a replicated parameter's gradient under data x tensor
    # parallelism) move 1/h of it and all-gather the rest over that group, where the cost
    # model says it is cheaper (hlo_passes.replicated_reductions.decide: across hosts, not on
    # one NVLink host). Bitwise.
    replicated_reductions: bool = True
    # Split the computation (regions, else contexts; loop rotation after a region split).
    # False: only the collectives of replicated operands above (compile_for_target's rewrite
    # guard tries that program where the whole rewrite loses on XLA's module).
    split: bool = True
    # Loop bodies (computation names of the post-SPMD module) not to rotate:
    # compile_for_target's rotation guard sets it when a rotation loses on XLA's module.
    rotate_skip: tuple[str, ...] = ()
    # The whole program's memory budget in bytes (compile_for_target: XLA's own scheduler
    # limit, Options.deviceless.memory_budget="xla"), or None. A rotated loop body is planned within
    # the larger of its input order's limit and its share of the budget
    # (judge.budget_share), as the "schedule" pass plans it afterwards.
    memory_budget_bytes: int | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.criticality not in ("schedule", "psi"):
            raise ValueError(f"criticality must be 'schedule' or 'psi', got {self.criticality!r}")
        if self.judge_rounds < 0:
            raise ValueError(f"judge_rounds must be >= 0, got {self.judge_rounds}")
        if self.split_copies not in ("zero", "estimate"):
            raise ValueError(f"split_copies must be 'zero' or 'estimate', got {self.split_copies!r}")
        if self.isolate_chunks not in ("regions", "all", "none"):
            raise ValueError(f"isolate_chunks must be 'regions', 'all' or 'none', got {self.isolate_chunks!r}")
        if self.region_degree is not None and self.region_degree < 2:
            raise ValueError(f"region_degree must be >= 2 or None, got {self.region_degree}")
        if self.fused_unmapped not in ("zero", "estimate"):
            raise ValueError(f"fused_unmapped must be 'zero' or 'estimate', got {self.fused_unmapped!r}")
