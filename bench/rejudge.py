"""Saved pairs of programs (stock XLA's, ours) judged again under every cost model, side by side.

    python -m bench.rejudge DIR [--out bench/results/NAME]

``DIR`` holds, per case, ``<case>.json`` (its ``cluster``, a ``costmodel.CLUSTERS`` name) and
the two modules ``<case>.stock.hlo.gz`` and ``<case>.ours.hlo.gz``: what
``python -m concerto_jax.gpu_check --prepare DIR`` writes for the suite cases (stock = XLA's
scheduled module of the step; ours = the module our route hands to XLA's backend). Nothing is
compiled or planned: each pair is simulated under the nominal model, the plausible models and
the adverse corner (``costmodel.envelope``), and the kernel rates measured on an H200
(``costmodel.calibration``): the columns of ``bench.robust_columns``. Writes ``rejudge.csv``
and ``rejudge.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import statistics
import sys
import time

from bench import robust_columns
from concerto_jax.gpu_check.check import markdown_table, write_csv

log = logging.getLogger("bench.rejudge")

COLUMNS = ("case", "cluster", "jax", *robust_columns.COLUMNS)


def rows(directory: str) -> list[dict]:
    out = []
    for meta_file in sorted(f for f in os.listdir(directory) if f.endswith(".json")):
        case = meta_file[:-5]
        paths = [os.path.join(directory, f"{case}.{p}.hlo.gz") for p in ("stock", "ours")]
        if not all(os.path.exists(p) for p in paths):
            continue
        with open(os.path.join(directory, meta_file)) as f:
            meta = json.load(f)
        texts = []
        for p in paths:
            with gzip.open(p, "rt") as f:
                texts.append(f.read())
        t0 = time.perf_counter()
        row = {"case": case, "cluster": meta["cluster"], "jax": meta.get("jax", ""),
               **robust_columns.columns(texts[0], texts[1], meta["cluster"])}
        log.info("%s: %s (%.1f s)", case, row, time.perf_counter() - t0)
        out.append(row)
    return out


def write(table: list[dict], out: str, command: str) -> None:
    os.makedirs(out, exist_ok=True)
    write_csv(os.path.join(out, "rejudge.csv"), table, COLUMNS)
    shown = ("case", "cluster", "nominal_gain", "worst_gain", "worst_variant", "adverse_gain", "calibrated_gain",
             "added_kernels")
    lines = ["# Stock vs ours, the same modules judged again (simulated)\n", f"Command: `{command}`\n",
             " ".join((__doc__ or "").split("\n\n")[1].split()) + "\n", robust_columns.legend() + "\n",
             markdown_table(table, shown)]
    for c in ("nominal_gain", "worst_gain", "adverse_gain", "calibrated_gain"):
        g = [r[c] for r in table if isinstance(r.get(c), float)]
        if g:
            lines.append(f"- {c}: geomean {statistics.geometric_mean(g):.4f} over {len(g)} cases, lowest {min(g):.4f}")
    with open(os.path.join(out, "rejudge.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rejudge", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a folder of <case>.json, <case>.stock.hlo.gz, <case>.ours.hlo.gz")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    table = rows(args.dir)
    if not table:
        log.error("no case in %s (expected <case>.json, <case>.stock.hlo.gz, <case>.ours.hlo.gz)", args.dir)
        return 1
    write(table, args.out, "python -m bench.rejudge " + " ".join(argv if argv is not None else sys.argv[1:]))
    with open(os.path.join(args.out, "rejudge.md")) as f:
        sys.stdout.write(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
