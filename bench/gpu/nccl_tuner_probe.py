"""The NCCL tuner plugin inside the machine's real NCCL: what NCCL loads, calls and does with it.

    python bench/gpu/nccl_tuner_probe.py --out DIR [--plugin LIB]

Run on a GPU machine (one GPU is enough). It loads the machine's own ``libnccl.so.2`` (the
``nvidia-nccl`` wheel JAX's CUDA plugin uses, else the system's) with ``ctypes``, builds our plugin
with the system compiler (or takes ``--plugin``, e.g. one built on another machine), and in one
child process, with ``NCCL_TUNER_PLUGIN`` set to it and NCCL's INFO log on, creates communicators
over the GPUs it finds in turn with:

  1. a valid table (every all-reduce/all-gather/reduce-scatter: ring, simple, 3 channels);
  2. the table replaced by a second valid one while that communicator is live (2 channels);
  3. a table that fails its checksum, for a new communicator (our fallback: NCCL's defaults);
  4. no table file at all.

Each communicator runs all-reduce, all-gather and reduce-scatter at a few sizes, checks the
results, and is destroyed. The child's NCCL log is kept whole (``nccl.log``); ``summary.json`` and
``summary.md`` say which plugin ABI NCCL took, how often it called ``init``, ``getCollInfo`` and
``destroy`` (the plugin's own trace, ``CONCERTO_NCCL_TUNER_TRACE=1``), what each call asked and
what NCCL then chose (its TUNING log), and whether every collective's result was right.

With one GPU every communicator has one rank. NCCL may then take its one-rank shortcut (a copy)
without asking the tuner: the summary says so when ``getCollInfo`` was never called, rather than
claiming the table steered anything.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger("nccl_tuner_probe")

SIZES = (4 << 10, 1 << 20, 64 << 20)  # bytes per rank's buffer
NCCL_FLOAT32, NCCL_SUM = 7, 0


def find_libnccl() -> str:
    """The NCCL library of the NVIDIA wheels (``nvidia/nccl/lib`` or ``nvidia/cu13/lib``), else the loader's."""
    for base in sys.path:
        if not base.endswith(("site-packages", "dist-packages")):
            continue
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnccl.so*")))
        if hits:
            return hits[0]
    return "libnccl.so.2"


def table_text(channels: int, *, corrupt: bool = False) -> str:
    """A valid table (or one whose checksum does not match) in the plugin's format."""
    from concerto_jax.autoccl import plugin  # lazy: --help and the child's imports stay light

    rows = [plugin.TableRow(collective=c, min_bytes=0, max_bytes=plugin.MAX_BYTES, nranks=None,
                            algorithm="ring", protocol="simple", channels=channels)
            for c in ("all-reduce", "all-gather", "reduce-scatter")]
    text = plugin.render_table(rows)
    if corrupt:  # same layout, one rule changed after the checksum was computed
        text = text.replace(f"simple {channels}\n", f"simple {channels + 5}\n", 1)
    return text


def write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def child(table: str) -> int:
    """Runs in the child process: communicators, collectives, table changes (see module doc)."""
    import cupy as cp  # lazy: the GPU machine's CuPy (device buffers, streams); not a dependency

    nccl = ctypes.CDLL(os.environ["PROBE_LIBNCCL"])
    ver = ctypes.c_int()
    nccl.ncclGetVersion(ctypes.byref(ver))
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    ndev = cp.cuda.runtime.getDeviceCount()
    print(json.dumps({"event": "start", "nccl_version": ver.value, "devices": ndev}), flush=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: NCCL error {rc} ({nccl.ncclGetErrorString(rc).decode()})")

    def comm_round(label: str, before_collectives=None) -> None:
        comms = (ctypes.c_void_p * ndev)()
        devs = (ctypes.c_int * ndev)(*range(ndev))
        t0 = time.perf_counter()
        check(nccl.ncclCommInitAll(comms, ndev, devs), "ncclCommInitAll")
        print(json.dumps({"event": "comm_init", "round": label, "s": round(time.perf_counter() - t0, 3)}),
              flush=True)
        if before_collectives:
            before_collectives()
        ok = True
        for size in SIZES:
            n = size // 4
            for name in ("allreduce", "allgather", "reducescatter"):
                bufs = []
                for d in range(ndev):
                    with cp.cuda.Device(d):
                        x = cp.arange(n, dtype=cp.float32) * (d + 1)
                        out_n = n * ndev if name == "allgather" else (n // ndev if name == "reducescatter" else n)
                        y = cp.zeros(out_n, dtype=cp.float32)
                        bufs.append((x, y, cp.cuda.Stream(non_blocking=True)))
                        # the buffers are written on CuPy's stream, NCCL runs on a non-blocking one
                        cp.cuda.Device(d).synchronize()
                check(nccl.ncclGroupStart(), "ncclGroupStart")
                for d, (x, y, s) in enumerate(bufs):
                    p = (ctypes.c_void_p(x.data.ptr), ctypes.c_void_p(y.data.ptr))
                    if name == "allreduce":
                        rc = nccl.ncclAllReduce(*p, ctypes.c_size_t(n), NCCL_FLOAT32, NCCL_SUM,
                                                ctypes.c_void_p(comms[d]), ctypes.c_void_p(s.ptr))
                    elif name == "allgather":
                        rc = nccl.ncclAllGather(*p, ctypes.c_size_t(n), NCCL_FLOAT32,
                                                ctypes.c_void_p(comms[d]), ctypes.c_void_p(s.ptr))
                    else:
                        rc = nccl.ncclReduceScatter(*p, ctypes.c_size_t(n // ndev), NCCL_FLOAT32, NCCL_SUM,
                                                    ctypes.c_void_p(comms[d]), ctypes.c_void_p(s.ptr))
                    check(rc, name)
                check(nccl.ncclGroupEnd(), "ncclGroupEnd")
                good = True
                for d, (_x, y, s) in enumerate(bufs):
                    with cp.cuda.Device(d):
                        s.synchronize()
                        total = sum(range(1, ndev + 1))
                        ref = cp.arange(n, dtype=cp.float32)
                        if name == "allreduce":
                            want = ref * total
                        elif name == "allgather":
                            want = cp.concatenate([ref * (k + 1) for k in range(ndev)])
                        else:
                            m = n // ndev
                            want = ref[d * m:(d + 1) * m] * total
                        good &= bool(cp.array_equal(y, want))
                ok &= good
                print(json.dumps({"event": "collective", "round": label, "op": name, "bytes": size,
                                  "correct": good}), flush=True)
        for d in range(ndev):
            check(nccl.ncclCommDestroy(ctypes.c_void_p(comms[d])), "ncclCommDestroy")
        print(json.dumps({"event": "comm_destroy", "round": label, "all_correct": ok}), flush=True)

    write(table, table_text(3))
    comm_round("valid_table")
    # the table replaced while the communicator lives: the plugin re-reads it on its next call
    comm_round("table_replaced_live", before_collectives=lambda: write(table, table_text(2)))
    write(table, table_text(4, corrupt=True))
    comm_round("bad_checksum")
    os.remove(table)
    comm_round("no_table")
    return 0


_TRACE = re.compile(r"concerto tuner: getCollInfo (\w+) nBytes=(\d+) numPipeOps=(-?\d+) numAlgo=(\d+) "
                    r"numProto=(\d+) regBuff=(-?\d+) -> rule (-?\d+), ([^,]+), nChannels=(-?\d+)")


def summarize(log_text: str, events: list[dict], nccl_log: str) -> dict:
    lines = nccl_log.splitlines()
    tuner_lines = [re.sub(r"^.*?NCCL (INFO|WARN) ", r"\1 ", ln).strip() for ln in lines
                   if re.search(r"tuner|TUNER|Tuner", ln) and "getCollInfo" not in ln]
    warn = [ln.split("NCCL WARN", 1)[-1].strip() for ln in lines if "NCCL WARN" in ln]
    calls = [m.groups() for m in (_TRACE.search(ln) for ln in lines) if m]
    start = next((e for e in events if e.get("event") == "start"), {})
    return {
        "nccl_version": start.get("nccl_version"),
        "devices": start.get("devices"),
        "plugin_lines": tuner_lines[:40],
        "init_calls": sum("concerto tuner: init" in ln for ln in lines),
        "get_coll_info_calls": len(calls),
        "get_coll_info_examples": [
            dict(zip(("coll", "nBytes", "numPipeOps", "numAlgo", "numProto", "regBuff", "rule", "answer",
                      "nChannels"), c, strict=True)) for c in calls[:12]],
        "warnings": warn[:20],
        "rounds": {e["round"]: e["all_correct"] for e in events if e.get("event") == "comm_destroy"},
        "collectives_run": sum(e.get("event") == "collective" for e in events),
        "all_correct": all(e.get("correct", True) for e in events if e.get("event") == "collective"),
        "child_tail": log_text[-3000:],
    }


def markdown(s: dict) -> str:
    ran = s["child_rc"] == 0 and s["collectives_run"] > 0
    verdict = ("results all correct" if s["all_correct"] else "results NOT all correct") if ran else \
        f"the child process FAILED (rc {s['child_rc']}): see child_tail in summary.json"
    out = ["# The NCCL tuner plugin in the machine's NCCL", "",
           f"NCCL {s['nccl_version']}, {s['devices']} GPU(s); {s['collectives_run']} collectives, {verdict}.", "",
           f"- plugin `init` calls: {s['init_calls']}",
           f"- `getCollInfo` calls: {s['get_coll_info_calls']}"
           + ("  (NCCL never asked the tuner: with one rank per communicator it takes its one-rank "
              "path)" if ran and s["get_coll_info_calls"] == 0 and s["devices"] == 1 else ""),
           f"- rounds (communicator: results correct): {s['rounds']}", "", "## What NCCL and the plugin logged", ""]
    out += [f"    {ln}" for ln in s["plugin_lines"]] or ["    (nothing)"]
    if s["get_coll_info_examples"]:
        out += ["", "## getCollInfo calls (first 12)", "", "| " + " | ".join(s["get_coll_info_examples"][0]) + " |",
                "|" + "---|" * len(s["get_coll_info_examples"][0])]
        out += ["| " + " | ".join(str(v) for v in c.values()) + " |" for c in s["get_coll_info_examples"]]
    if s["warnings"]:
        out += ["", "## NCCL warnings", ""] + [f"    {w}" for w in s["warnings"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for nccl.log, summary.json, summary.md")
    ap.add_argument("--plugin", help="a built libnccl-tuner-concerto.so (default: build it here, else "
                    "take .gpu_prepared/nccl_tuner/'s, built by run_gpu_check.sh prepare)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.makedirs(args.out, exist_ok=True)
    from concerto_jax.autoccl import plugin  # lazy: only the parent builds the plugin

    work = tempfile.mkdtemp(prefix="nccl_probe_")
    lib = args.plugin
    if not lib:
        try:
            lib = plugin.build(work)
        except plugin.PluginBuildError as e:
            lib = os.path.join(".gpu_prepared", "nccl_tuner", plugin.LIBRARY_NAME)
            if not os.path.exists(lib):
                logger.error("no plugin: %s (pass --plugin)", e)
                return 2
            logger.warning("no compiler here (%s): the prepared %s", e, lib)
    table = os.path.join(work, "table.txt")
    nccl_log = os.path.join(args.out, "nccl.log")
    env = dict(os.environ, PROBE_LIBNCCL=find_libnccl(), NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,TUNING,ENV",
               NCCL_DEBUG_FILE=nccl_log, **plugin.plugin_env(lib, table), **{plugin.TRACE_ENV: "1"})
    logger.info("libnccl %s, plugin %s", env["PROBE_LIBNCCL"], lib)
    proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", table], env=env,
                          capture_output=True, text=True, timeout=240)
    events = []
    for ln in proc.stdout.splitlines():
        try:
            events.append(json.loads(ln))
        except json.JSONDecodeError:
            pass
    text = open(nccl_log).read() if os.path.exists(nccl_log) else ""
    s = summarize(proc.stdout + proc.stderr, events, text)
    s["child_rc"] = proc.returncode
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(markdown(s))
    logger.info("nccl_tuner_probe: rc %d, NCCL %s, init %d, getCollInfo %d, correct %s, rounds %s",
                proc.returncode, s["nccl_version"], s["init_calls"], s["get_coll_info_calls"], s["all_correct"],
                s["rounds"])
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
