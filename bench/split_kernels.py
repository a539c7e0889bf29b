"""Where the kernels and bytes a split adds come from: XLA's final modules of stock and ours, by kernel class.

    python -m bench.split_kernels [--case NAME ...] [--heldout LAYOUT:LAYERS ...] [--no-guard]
                                  [--out bench/results] [--prefix split_kernels] [--modules DIR]

Each case (a suite case, ``bench.suite``; or a held-out step, ``bench.heldout_target``) goes
through ``concerto_jax.compile_for_target`` with ``passes=("decompose", "schedule")``; the
kernels of stock XLA's final module and of ours are classified (``kernel_class``) and counted
per step (loop bodies times their trip counts, collectives not counted: the kernels and bytes of
``bench.robust_columns``). ``--no-guard`` keeps the rewrite where the final-module guard would
drop it (``guard_rewrites=False``), to see what the split costs there. Writes
``<prefix>.csv`` (case, class, kernels and MB of stock and ours), ``<prefix>_gains.csv`` and
``<prefix>.md`` (per case: the simulated gains and ``copies_back_to_back``, then the classes); with ``--modules DIR``, the
two final modules of each case under ``DIR/<case>/``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import time

log = logging.getLogger("bench.split_kernels")

COLUMNS = ("case", "class", "stock_kernels", "ours_kernels", "added_kernels", "stock_mb", "ours_mb",
           "added_mb")
GAIN_COLUMNS = ("case", "cluster", "guard", "stock_us", "ours_us", "nominal_gain", "calibrated_gain",
                "stock_kernels", "ours_kernels", "added_kernels", "added_mb", "copied_kernels",
                "copies_back_to_back", "decomposed", "wall_s")

_SHAPE_OPS = frozenset({"parameter", "constant", "iota", "bitcast", "reshape", "broadcast",
                        "get-tuple-element", "tuple", "copy", "transpose", "slice", "dynamic-slice",
                        "concatenate", "pad", "reverse", "bitcast-convert"})


def _body_opcodes(inst) -> collections.Counter:
    """Opcodes inside ``inst``'s called computations (nested fusions included)."""
    out: collections.Counter = collections.Counter()
    for comp in inst.called_computations:
        for i in comp.instructions:
            out[i.opcode] += 1
            if i.opcode == "fusion":
                out.update(_body_opcodes(i))
    return out


def kernel_class(inst) -> str:
    """The class of one kernel of XLA's final module: ``gemm`` (a cuBLAS call or a fusion with a
    dot), ``convolution``, ``reduction``, ``scatter``, ``dynamic-update-slice``,
    ``concatenate`` / ``slice`` / ``transpose or copy`` (fusions that only move data),
    ``add of two arrays`` (a fusion of adds and converts alone: a partial sum's combination),
    ``elementwise (+slice/+transpose/+concatenate)``, or the opcode itself."""
    if inst.opcode == "custom-call":
        target = str(inst.attrs.get("custom_call_target", "")).lower()
        if "gemm" in target or "matmul" in target:
            return "gemm"
        return "convolution" if "conv" in target else f"custom-call {target.strip(chr(34))}"
    if inst.opcode != "fusion":
        return inst.opcode
    ops = _body_opcodes(inst)
    if ops.get("dot") or ops.get("custom-call"):
        return "gemm"
    if ops.get("convolution"):
        return "convolution"
    for opcode, label in (("reduce", "reduction"), ("scatter", "scatter"),
                          ("dynamic-update-slice", "dynamic-update-slice")):
        if ops.get(opcode):
            return label
    compute = {k for k in ops if k not in _SHAPE_OPS}
    if not compute:
        for opcode, label in (("concatenate", "concatenate"), ("transpose", "transpose or copy"),
                              ("copy", "transpose or copy"), ("slice", "slice"),
                              ("dynamic-slice", "slice")):
            if ops.get(opcode):
                return label
        return "layout only"
    if compute <= {"add", "convert"} and ops.get("add") and ops.get("parameter", 0) >= 2:
        return "add of two arrays"
    for opcode, label in (("concatenate", "elementwise+concatenate"), ("transpose", "elementwise+transpose"),
                          ("slice", "elementwise+slice"), ("dynamic-slice", "elementwise+slice")):
        if ops.get(opcode):
            return label
    return "elementwise"


def breakdown(text: str) -> dict[str, list]:
    """``class -> [kernels per step, HBM bytes per step]`` of a scheduled module (the kernels
    ``bench.robust_columns.kernels_and_bytes`` counts)."""
    from bench.robust_columns import kernels_and_bytes_by

    return kernels_and_bytes_by(text, kernel_class)


def _entry_kernels(text: str) -> list:
    """The entry computation's kernels in the module's order, as their source operation
    (``op_name`` metadata, else the name), with None for each collective started."""
    import re

    from concerto_jax.costmodel.compute import kernel_count
    from concerto_jax.hlo_taskgraph import ALIAS_OPCODES, op_info
    from hlo_passes.ir.parser import parse_module

    seq: list = []
    for inst in parse_module(text).entry.instructions:
        if inst.async_role == "start" or (inst.collective_kind is not None and inst.async_role is None):
            seq.append(None)
            continue
        if (inst.opcode in ALIAS_OPCODES or inst.opcode in ("while", "call", "conditional")
                or inst.collective_kind is not None or not kernel_count(op_info(inst))):
            continue
        found = re.search(r'op_name="([^"]*)"', str(inst.attrs.get("metadata", "")))
        seq.append(found.group(1) if found else inst.name)
    return seq


def copies_back_to_back(stock_text: str, ours_text: str) -> tuple[int, int]:
    """``(copies, adjacent)``: the source operations of the entry computation with one kernel in
    stock's module and two in ours (the split's two copies of a kernel), and how many of those
    pairs run one right after the other in ours' order with no collective started between them:
    where one kernel for both chunks would have delayed no collective."""
    stock, ours = _entry_kernels(stock_text), _entry_kernels(ours_text)
    in_stock = collections.Counter(k for k in stock if k is not None)
    in_ours = collections.Counter(k for k in ours if k is not None)
    copies = {k for k, n in in_ours.items() if n == 2 and in_stock.get(k) == 1}
    adjacent = sum(1 for a, b in zip(ours, ours[1:], strict=False) if a is not None and a == b and a in copies)
    return len(copies), adjacent


def class_rows(case: str, stock_text: str, ours_text: str) -> list[dict]:
    """One row per kernel class of the two modules, most added kernels first, then a total."""
    s, o = breakdown(stock_text), breakdown(ours_text)
    rows = []
    for k in set(s) | set(o):
        (sk, sb), (ok, ob) = s.get(k, (0, 0.0)), o.get(k, (0, 0.0))
        rows.append({"case": case, "class": k, "stock_kernels": sk, "ours_kernels": ok, "added_kernels": ok - sk,
                     "stock_mb": round(sb / 1e6, 1), "ours_mb": round(ob / 1e6, 1),
                     "added_mb": round((ob - sb) / 1e6, 1)})
    rows.sort(key=lambda r: (-r["added_kernels"], -abs(r["added_mb"]), r["class"]))
    total = {"case": case, "class": "total"}
    for c in COLUMNS[2:]:
        total[c] = round(sum(r[c] for r in rows), 1) if c.endswith("_mb") else sum(r[c] for r in rows)
    return rows + [total]


def compile_case(spec: str, guard: bool = True):
    """``(TargetResult, cluster)`` of one case: a suite case name, or ``heldout:LAYOUT:LAYERS``."""
    import concerto_jax

    if spec.startswith("heldout:"):
        from bench import heldout_target

        _, layout, layers = spec.split(":")
        step, params, opt_state, data, cluster = heldout_target.build(layout, int(layers))
        args = (params, opt_state, data)
        opts = concerto_jax.Options(passes=("decompose", "schedule"), target=cluster)
    else:
        from bench.decompose_bench import _case_step
        from bench.suite import get_case

        case = get_case(spec)
        c, _ = _case_step(case)
        step, args, cluster = c.step, (c.abstract_state, c.abstract_batch), case.cluster
        opts = concerto_jax.Options(passes=("decompose", "schedule"), target=cluster,
                                    compiler_options=dict(case.xla_options))
    res = concerto_jax.compile_for_target(step, *args, target=cluster, options=opts, guard_rewrites=guard)
    return res, cluster


def run_case(spec: str, guard: bool, modules: str | None = None) -> tuple[dict, list[dict]]:
    from bench import robust_columns

    t0 = time.perf_counter()
    res, cluster = compile_case(spec, guard)
    name = spec.replace(":", "_")
    if modules:
        folder = os.path.join(modules, name)
        os.makedirs(folder, exist_ok=True)
        for label, text in (("stock", res.stock_final_text), ("ours", res.final_text)):
            with open(os.path.join(folder, f"{label}.hlo"), "w") as f:
                f.write(text)
    cols = robust_columns.columns(res.stock_final_text, res.final_text, cluster)
    dec = next((p for p in res.passes if p.name == "decompose"), None)
    gains = {"case": name, "cluster": cluster,
             "guard": robust_columns.split_guard(res) if guard else "off (guard_rewrites=False)",
             "stock_us": round(res.stock_step_us, 1), "ours_us": round(res.final_step_us, 1),
             **{k: cols[k] for k in ("nominal_gain", "calibrated_gain", "stock_kernels", "ours_kernels",
                                     "added_kernels", "added_mb")},
             **dict(zip(("copied_kernels", "copies_back_to_back"),
                        copies_back_to_back(res.stock_final_text, res.final_text), strict=True)),
             "decomposed": "; ".join(f"{d.get('computation')} ax{d.get('axis')} N={d.get('n')} {d.get('sides')}"
                                     for d in (dec.stats.get("decomposed", []) if dec else [])) or "none",
             "wall_s": round(time.perf_counter() - t0, 1)}
    return gains, class_rows(name, res.stock_final_text, res.final_text)


def main(argv=None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ap = argparse.ArgumentParser(prog="python -m bench.split_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="a suite case (repeatable)")
    ap.add_argument("--heldout", action="append", default=[], metavar="LAYOUT:LAYERS",
                    help="a held-out step, e.g. tp:1 (repeatable)")
    ap.add_argument("--no-guard", dest="guard", action="store_false",
                    help="keep the rewrite where the final-module guard would drop it")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prefix", default="split_kernels")
    ap.add_argument("--modules", default=None, help="write each case's two final modules under this directory")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    specs = list(args.case) + [f"heldout:{h}" for h in args.heldout] or ["gpt_tp8_nvlink"]
    os.makedirs(args.out, exist_ok=True)
    from concerto_jax import jax_compat
    from concerto_jax.gpu_check.check import markdown_table, write_csv

    gains, rows = [], []
    for spec in specs:
        log.info("case %s", spec)
        g, r = run_case(spec, args.guard, args.modules)
        gains.append(g)
        rows += r
    write_csv(os.path.join(args.out, f"{args.prefix}.csv"), rows, COLUMNS)
    write_csv(os.path.join(args.out, f"{args.prefix}_gains.csv"), gains, GAIN_COLUMNS)
    command = "python -m bench.split_kernels " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["# Kernels and bytes a split adds, by class (simulated)\n",
             f"`{command}`; jax {jax_compat.jax_versions()[0]}. XLA's final modules (deviceless); kernels and "
             "HBM bytes per step as `bench.robust_columns` counts them; gains: stock / ours under the "
             "nominal model and under the H200's measured kernel rates (`calibrated_gain`).\n",
             markdown_table(gains, GAIN_COLUMNS), ""]
    for g in gains:
        lines += [f"## {g['case']}\n", markdown_table([r for r in rows if r["case"] == g["case"]], COLUMNS[1:]), ""]
    md = os.path.join(args.out, f"{args.prefix}.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    log.info("wrote %s", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
