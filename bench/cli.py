"""Command line of the benchmarks: ``python -m bench.cli baseline [--case NAME] [--quick]`` from the repository root."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _suite_arguments(p: argparse.ArgumentParser, prefix_help: str) -> None:
    """The arguments every suite benchmark takes: which cases, where results go, verbosity."""
    p.add_argument("--case", action="append", help="run only this case (repeatable)")
    p.add_argument("--quick", action="store_true", help="run only the quick subset")
    p.add_argument("--out", default="bench/results", help="output directory")
    p.add_argument("--prefix", default=None, help=prefix_help)
    p.add_argument("-v", "--verbose", action="store_true")


def main(argv=None) -> int:
    """Parse arguments and run the chosen benchmark; returns the exit status."""
    # Every subcommand compiles deviceless or runs on the CPU: JAX on CPU, set before JAX starts.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("baseline", help="stock XLA schedule vs program order vs lower bound, simulated")
    _suite_arguments(b, "result file prefix (default: baseline[_quick])")
    b.add_argument("--pgle", action="store_true", help="also compile with a PGLE profile from our cost model")
    b.add_argument("--windowed-einsum", action="store_true",
                   help="also compile with windowed einsum (collective matmul) on")
    b.add_argument("--trace-case", default=None, help="case exported as Perfetto trace + Gantt PNG")
    v = sub.add_parser("validate-cpu", help="simulated vs measured time of single-device CPU programs")
    v.add_argument("--out", default="bench/results", help="output directory")
    v.add_argument("--repeats", type=int, default=15, help="interleaved timing rounds (medians of process CPU time)")
    v.add_argument("--program", action="append", help="validate only this program (repeatable)")
    v.add_argument("--system-malloc", action="store_true",
                   help="leave glibc's malloc as is (large temporaries are re-mapped and faulted in per run)")
    v.add_argument("--multithreaded", action="store_true",
                   help="keep XLA:CPU's thread pools and every core (noisier; not what the model models)")
    v.add_argument("-v", "--verbose", action="store_true")
    from bench import concerto_vs_xla

    concerto_vs_xla.add_arguments(sub.add_parser(
        "concerto", help="Concerto(S) vs stock XLA on the same fused graph, simulated"))
    fid = sub.add_parser("fidelity", help="XLA's final module of our program vs plan vs stock XLA")
    _suite_arguments(fid, "result file prefix (default: fidelity[_quick])")
    fid.add_argument("--dump-dir", default=None, help="write each case's modules under this directory")
    fid.add_argument("--via", default="backend_only", choices=("backend_only", "pin"),
                     help="compile_for_target's path (default: backend_only)")
    d = sub.add_parser("decompose", help="stock XLA vs Concerto(S) vs Concerto(S+AD), XLA's final module")
    _suite_arguments(d, "output file prefix (default: decompose)")
    d.add_argument("--taskgraph-only", action="store_true",
                   help="only the task-graph columns (one stock compile per case, no final module)")
    d.add_argument("--split-copies", choices=("estimate", "zero"), default="estimate",
                   help="DecomposeOptions.split_copies (cost of the slices/concats a split adds)")
    d.add_argument("--region", type=int, default=2, metavar="N",
                   help="DecomposeOptions.region_degree (default 2): split the best region into "
                        "N micro-batches; 0: per-collective contexts only (region_degree=None)")
    d.add_argument("--no-windowed-einsum", dest="windowed_einsum", action="store_false",
                   help="leave out the column of stock XLA with windowed einsum on (one more XLA "
                        "compile per case)")
    d.add_argument("--thresholds", default=None, metavar="B,B,...",
                   help="Options.deviceless.combine_thresholds in bytes (default: the Options default); "
                        "'none': XLA's combine thresholds only")
    from bench import compile_time

    compile_time.add_arguments(sub.add_parser(
        "compile_time", help="stock XLA vs our first compile vs our compile from the plan cache"))
    dc = sub.add_parser("decompose-calibrate",
                        help="measure the decomposition's chunk overhead and overlap slowdown (CPU)")
    dc.add_argument("--repeats", type=int, default=15)
    dc.add_argument("--out", default="hlo_passes/decompose/calibration.json")
    dc.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "concerto":
        return concerto_vs_xla.run_from_args(args, "python -m bench.cli concerto")
    if args.command == "compile_time":
        return compile_time.run_from_args(args, argv if argv is not None else sys.argv[2:])
    # The deviceless GPU compile needs JAX on CPU; set before JAX starts (the CLI, not the library).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    setup = "XLA:CPU multi-threaded, all cores (--multithreaded)."
    validate_pinned = args.command == "validate-cpu" and not args.multithreaded
    if args.command == "decompose-calibrate" or validate_pinned:
        # One XLA:CPU thread for programs and kernels alike: on a shared 2-core machine multi-threaded
        # timings depend on what the neighbours run; single-threaded ones compose (sum of kernels).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false").strip()
    if validate_pinned:
        # The Eigen flag alone is not enough: XLA:CPU sizes its intra-op pool from the CPU affinity
        # and runs YNNPACK fusions (dots, reductions), partitioned loop fusions and independent thunks
        # on it. On a shared 2-core machine a short kernel's best time then catches both cores free, a
        # long program's does not (the store underestimated transformer_block by ~50 % for that reason).
        # decompose-calibrate is not pinned: its slowdown probe runs two programs at once.
        from bench.cpu_validation import pin_to_one_cpu

        core = pin_to_one_cpu()
        setup = (f"XLA:CPU single-threaded: process pinned to core {core} (one intra-op thread, no partitioned "
                 "fusions) and --xla_cpu_multi_thread_eigen=false.")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from bench import baseline, suite

    if args.command == "fidelity":
        from bench import fidelity

        prefix = args.prefix or ("fidelity_quick" if args.quick or args.case else "fidelity")
        cmd = " ".join(["python -m bench.cli fidelity"] + [f"--case {c}" for c in args.case or ()]
                       + (["--quick"] if args.quick else []) + (["--via", args.via] if args.via != "backend_only" else []))
        rows = fidelity.run(suite.select_cases(args.case, args.quick),
                            fidelity.FidelityOptions(out_dir=args.out, prefix=prefix, dump_dir=args.dump_dir,
                                                     via=args.via), cmd)
        with open(os.path.join(args.out, f"{prefix}.md")) as f:
            sys.stdout.write(f.read())
        return 0 if all(not str(r["status"]).startswith("error") for r in rows) else 1
    if args.command == "decompose-calibrate":
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        from bench import decompose_bench

        sys.stdout.write(json.dumps(decompose_bench.calibrate(args.repeats, args.out), indent=1) + "\n")
        return 0
    if args.command == "decompose":
        from bench import decompose_bench

        prefix = args.prefix or ("decompose_quick" if args.quick or args.case else "decompose")
        rows = decompose_bench.run(suite.select_cases(args.case, args.quick), args.out, prefix,
                                   final_module=not args.taskgraph_only,
                                   split_copies=args.split_copies, region_degree=args.region or None,
                                   combine_thresholds=None if args.thresholds is None else (
                                       () if args.thresholds == "none"
                                       else tuple(int(b) for b in args.thresholds.split(","))),
                                   windowed_einsum=args.windowed_einsum)
        with open(os.path.join(args.out, f"{prefix}.md")) as f:
            sys.stdout.write(f.read())
        return 0 if all(not str(r["status"]).startswith("error") for r in rows) else 1
    if args.command == "validate-cpu":
        cmd = " ".join(["python -m bench.cli validate-cpu", f"--repeats {args.repeats}"]
                       + [f"--program {p}" for p in args.program or ()]
                       + (["--multithreaded"] if args.multithreaded else []))
        if args.system_malloc:
            cmd += " --system-malloc"
            setup += " glibc malloc as is."
        else:
            from bench.cpu_validation import keep_freed_memory

            if keep_freed_memory():
                setup += (" malloc keeps freed memory (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB: temporaries "
                          "are reused, not faulted in per run).")
        baseline.run_cpu_validation(args.out, repeats=args.repeats, programs=args.program, command=cmd,
                                    setup=setup)
        with open(os.path.join(args.out, "baseline_cpu_validation.md")) as f:
            sys.stdout.write(f.read())
        return 0
    cases = suite.select_cases(args.case, args.quick)
    prefix = args.prefix or ("baseline_quick" if args.quick or args.case else "baseline")
    rows = baseline.run_baseline(cases, baseline.BaselineOptions(out_dir=args.out, pgle=args.pgle,
                                                                  windowed_einsum=args.windowed_einsum,
                                                                  trace_case=args.trace_case, prefix=prefix))
    with open(os.path.join(args.out, f"{prefix}.md")) as f:
        sys.stdout.write(f.read())
    return 0 if all(not str(r["status"]).startswith("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
