"""Measured GPU kernel timelines as a Perfetto trace: ``python -m bench.gpu.trace PROFILE.tar.gz OUT.json``.

Reads the ``.xplane.pb`` profiles a ``gpu_check`` run brought back (``profile.tar.gz``: one
profile per suite case and program, three timed steps each) and writes one Chrome-trace JSON
that https://ui.perfetto.dev opens: a process per case and program (``gpt_dp2_tp8_2hosts.stock``,
``... .ours``), a track per GPU stream, a slice per kernel named by its HLO instruction, each
program's time starting at 0 so stock and ours line up. Everything in it was measured.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import tarfile
import tempfile
import warnings

log = logging.getLogger("concerto_jax.gpu_trace")


def trace_events(profile_path: str, pid: int) -> list[dict]:
    """Chrome-trace events of the GPU kernels in one ``.xplane.pb`` (times from its first kernel)."""
    from concerto_jax import jax_compat

    data = jax_compat.profile_data_from_file(profile_path)
    out, t0 = [], None
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                t0 = ev.start_ns if t0 is None else min(t0, ev.start_ns)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for tid, line in enumerate(plane.lines):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": line.name}})
            for ev in line.events:
                with warnings.catch_warnings():  # jaxlib's event_stats type, not ours
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(ev.stats)
                out.append({"ph": "X", "pid": pid, "tid": tid, "name": str(stats.get("hlo_op") or ev.name),
                            "ts": (ev.start_ns - t0) / 1e3, "dur": ev.duration_ns / 1e3,
                            "args": {"kernel": ev.name}})
    return out


def convert(archive: str, out_path: str) -> int:
    """Write ``out_path`` from the profiles in ``archive``; returns the number of kernel slices."""
    events: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="concerto_trace_") as d:
        with tarfile.open(archive) as tar:
            tar.extractall(d, filter="data")
        for pid, path in enumerate(sorted(glob.glob(os.path.join(d, "profile", "*", "**", "*.xplane.pb"),
                                                recursive=True))):
            program = os.path.relpath(path, os.path.join(d, "profile")).split(os.sep)[0]
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": program}})
            events += trace_events(path, pid)
    with open(out_path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
    slices = sum(e["ph"] == "X" for e in events)
    log.info("%d kernel slices -> %s", slices, out_path)
    return slices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", help="a gpu_check run's profile.tar.gz")
    ap.add_argument("out", help="the Chrome-trace JSON to write (open it in ui.perfetto.dev)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return 0 if convert(args.archive, args.out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
