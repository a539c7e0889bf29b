"""NCCL tuner plugin: build the C library, write its live rule table from tuned configs.

NCCL (>= 2.22) loads the library named by ``NCCL_TUNER_PLUGIN`` and, for
every collective, lets its ``getCollInfo`` edit the (algorithm x protocol)
cost table and the channel count. Our plugin (``nccl_tuner/concerto_tuner.c``,
written against our own declaration of the v3/v4 API in
``nccl_tuner/concerto_tuner_api.h``; both symbols are exported) answers from a
text table whose path is in ``CONCERTO_NCCL_TUNER_TABLE``::

    concerto-tuner-table 3
    <collective> <min_bytes> <max_bytes> <nranks|*> <k/p|*> <algorithm|*> <protocol|*> <channels>
    ...
    end <number of rules> crc32=<zlib.crc32 of every byte before this line, 8 hex digits>

The first matching rule sets its cell to 0.0 (NCCL picks the cheapest cell)
and ``nChannels``. Keys: collective type x byte range (a size class) x
communicator size x occurrence (the k-th call mod p of that size class, for
same-size collectives of one step).

The table is *live*: the plugin stats the file on every ``getCollInfo`` (or
every ``CONCERTO_NCCL_TUNER_POLL_US`` microseconds) and, when it changed,
parses and validates the whole file before swapping one pointer, so a
collective always sees one whole table. The rule count and the checksum make
a table self-validating: a half-written file, or one mixing two versions (an
in-place writer), is rejected. ``write_table`` writes a temporary file and
renames it over the path, so the next step's collectives use the new rules
without restarting NCCL. A bad or missing table logs a warning through
NCCL's logger and keeps the last good table (or NCCL's defaults if none).

This is how per-collective tuned choices reach NCCL, where the environment
(``knobs.nccl_env``) can only set one value for the whole process, once.

References:
  AutoCCL NSDI'25 §5 (implementation inside NCCL's per-collective decision).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "LIBRARY_NAME",
    "SOURCE_DIR",
    "POLL_ENV",
    "RACY_ENV",
    "TABLE_ENV",
    "TRACE_ENV",
    "PluginBuildError",
    "TableRow",
    "build",
    "build_harness",
    "ensure_built",
    "plugin_env",
    "render_table",
    "rows_from_configs",
    "size_class",
    "size_class_range",
    "write_table",
]

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "nccl_tuner")
LIBRARY_NAME = (
    "libnccl-tuner-concerto.so"  # NCCL_TUNER_PLUGIN=concerto also finds it on LD_LIBRARY_PATH
)
TABLE_ENV = "CONCERTO_NCCL_TUNER_TABLE"
POLL_ENV = "CONCERTO_NCCL_TUNER_POLL_US"  # min microseconds between two checks of the file
# microseconds during which a just-modified file is read again although its identity (inode,
# size, mtime, ctime) is unchanged (default 25 ms; raise on file systems with coarse timestamps)
RACY_ENV = "CONCERTO_NCCL_TUNER_RACY_US"
# set (not "0"): one INFO line through NCCL's logger per getCollInfo call: what NCCL asked (collective,
# bytes, pipelined ops, table size, registered buffer) and what the table answered
TRACE_ENV = "CONCERTO_NCCL_TUNER_TRACE"
TABLE_HEADER = "concerto-tuner-table 3"
_SOURCES = ("concerto_tuner.c",)
_HEADERS = ("concerto_tuner_api.h",)
_COLLECTIVES = {
    "all-reduce": "allreduce",
    "all-gather": "allgather",
    "reduce-scatter": "reducescatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "*": "*",
}
_ALGOS = {a: a for a in ("ring", "tree", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")}
_PROTOS = {"ll": "ll", "ll128": "ll128", "simple": "simple"}
MAX_BYTES = 2**64 - 1


class PluginBuildError(RuntimeError):
    """The C compiler is missing or failed; the message carries its output."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise PluginBuildError(
            "no C compiler found (tried $CC, cc, gcc, clang); install one or set CC."
        )
    return cc


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise PluginBuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


_SANITIZE = {
    "address": ("-fsanitize=address,undefined", "-g", "-fno-omit-frame-pointer"),
    "thread": ("-fsanitize=thread", "-g", "-O1"),
}


def _sanitize_flags(sanitize: bool | str) -> tuple[str, ...]:
    if not sanitize:
        return ()
    kind = "address" if sanitize is True else sanitize
    if kind not in _SANITIZE:
        raise ValueError(f"sanitize={sanitize!r}: use False, True/'address' or 'thread'.")
    return _SANITIZE[kind]


def build(out_dir: str | os.PathLike[str], sanitize: bool | str = False) -> str:
    """Compiles the plugin with the system compiler (``cc -shared -fPIC``).

    Args:
      out_dir: directory for the library (created if needed).
      sanitize: tests only: ``True`` or ``"address"`` builds with AddressSanitizer + UBSan,
        ``"thread"`` with ThreadSanitizer; pair with ``build_harness`` given the same value.

    Returns:
      Path of ``libnccl-tuner-concerto.so``.

    Raises:
      PluginBuildError: no compiler, or compilation failed.
    """
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(os.fspath(out_dir), LIBRARY_NAME)
    srcs = [os.path.join(SOURCE_DIR, s) for s in _SOURCES]
    flags = _sanitize_flags(sanitize)
    _run([_compiler(), "-shared", "-fPIC", "-O2", "-Wall", "-pthread", *flags, "-I", SOURCE_DIR, "-o", out, *srcs])
    logger.info("autoccl: built NCCL tuner plugin %s", out)
    return out


def build_harness(out_dir: str | os.PathLike[str], sanitize: bool | str = False) -> str:
    """Compiles the dlopen harness (``nccl_tuner/harness.c``) used by tests; returns its path.

    ``sanitize`` as for ``build`` (the harness and the plugin must use the same sanitizer).
    """
    flags = _sanitize_flags(sanitize)
    os.makedirs(out_dir, exist_ok=True)
    suffix = {True: "_asan", "address": "_asan", "thread": "_tsan"}.get(sanitize, "") if flags else ""
    out = os.path.join(os.fspath(out_dir), "concerto_tuner_harness" + suffix)
    _run(
        [
            _compiler(),
            "-O2",
            "-pthread",
            *flags,
            "-I",
            SOURCE_DIR,
            "-o",
            out,
            os.path.join(SOURCE_DIR, "harness.c"),
            "-ldl",
        ]
    )
    return out


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def installed_library() -> str | None:
    """The library built at install time (``setup.py``'s build hook), if it is up to date."""
    lib = os.path.join(SOURCE_DIR, LIBRARY_NAME)
    if not os.path.exists(lib):
        return None
    newest_source = max(os.path.getmtime(os.path.join(SOURCE_DIR, n)) for n in (*_SOURCES, *_HEADERS))
    return lib if os.path.getmtime(lib) >= newest_source else None


def ensure_built(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Returns a built plugin: the one built at install time if up to date, else one compiled
    once into a cache keyed by the source hash.

    Args:
      cache_dir: defaults to ``$XDG_CACHE_HOME/concerto_jax/nccl_tuner`` (or ``~/.cache/...``).
    """
    if cache_dir is None and (lib := installed_library()) is not None:
        return lib
    base = cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "concerto_jax",
        "nccl_tuner",
    )
    target = os.path.join(os.fspath(base), _source_hash())
    lib = os.path.join(target, LIBRARY_NAME)
    if not os.path.exists(lib):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".build-")
        build(tmp)
        try:
            os.rename(tmp, target)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return lib


@dataclasses.dataclass(frozen=True)
class TableRow:
    """One rule of the plugin's table (first matching rule wins)."""

    collective: str  # "all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce" or "*"
    min_bytes: int  # inclusive lower bound of the message size NCCL reports (nBytes)
    max_bytes: int  # inclusive upper bound
    algorithm: str | None  # "Ring", "Tree", ... or None to keep NCCL's (then protocol is None too)
    protocol: str | None  # "LL", "LL128", "Simple" or None to keep NCCL's
    channels: int = 0  # > 0 sets nChannels; 0 keeps NCCL's choice
    nranks: int | None = None  # communicator size the rule is for; None = any
    occurrence: tuple[int, int] | None = None  # (k, p): only the k-th call mod p of this size class

    def render(self) -> str:
        """The table line; raises ValueError on an unknown name or bad range."""
        try:
            coll = _COLLECTIVES[self.collective]
            algo = "*" if self.algorithm is None else _ALGOS[self.algorithm.lower()]
            proto = "*" if self.protocol is None else _PROTOS[self.protocol.lower()]
        except KeyError as e:
            raise ValueError(
                f"TableRow {self}: unknown {e}; collectives {sorted(_COLLECTIVES)}, algorithms "
                f"{sorted(_ALGOS)}, protocols LL/LL128/Simple (or None for NCCL's choice)."
            ) from None
        if (algo == "*") != (proto == "*"):
            raise ValueError(
                f"TableRow {self}: set algorithm and protocol together or neither (NCCL's tuner API)."
            )
        if not 0 <= self.min_bytes <= self.max_bytes <= MAX_BYTES or self.channels < 0:
            raise ValueError(
                f"TableRow {self}: need 0 <= min_bytes <= max_bytes < 2**64 and channels >= 0."
            )
        if self.nranks is not None and self.nranks < 1:
            raise ValueError(f"TableRow {self}: nranks must be >= 1 or None.")
        occ = "*"
        if self.occurrence is not None:
            k, p = self.occurrence
            if not 0 <= k < p:
                raise ValueError(f"TableRow {self}: occurrence (k, p) needs 0 <= k < p.")
            occ = f"{k}/{p}"
        nranks = "*" if self.nranks is None else str(self.nranks)
        return (
            f"{coll} {self.min_bytes} {self.max_bytes} {nranks} {occ} {algo} {proto} {self.channels}"
        )


def render_table(rows: Iterable[TableRow]) -> str:
    """The whole table text: header, one line per rule, ``end <count> crc32=<checksum>``.

    The checksum is ``zlib.crc32`` of the UTF-8 bytes of everything before the end line; the
    plugin recomputes it, so it rejects a file that is partly rewritten or mixes two versions.
    """
    body = [r.render() for r in rows]
    head = "\n".join(
        [
            TABLE_HEADER,
            "# collective min_bytes max_bytes nranks occurrence algorithm protocol channels",
            *body,
        ]
    ) + "\n"
    return head + f"end {len(body)} crc32={zlib.crc32(head.encode()):08x}\n"


def write_table(rows: Iterable[TableRow], path: str | os.PathLike[str]) -> str:
    """Writes the rules atomically (temporary file + ``os.replace``) and returns the path.

    A plugin that is running picks the new table up at its next ``getCollInfo``;
    it never sees a half-written file (and would reject one: the ``end`` line and its checksum).
    """
    text = render_table(rows)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".concerto-table-")
    try:
        with os.fdopen(fd, "wb") as f:  # bytes: the checksum covers exactly what is written
            f.write(text.encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def size_class(nbytes: int) -> int:
    """``floor(log2(nbytes))`` (0 for 0 and 1): the plugin's size class, for occurrence counting."""
    return max(int(nbytes), 1).bit_length() - 1


def size_class_range(nbytes: int) -> tuple[int, int]:
    """Byte range ``[2**c, 2**(c+1) - 1]`` of the size class of ``nbytes`` (from 0 for class 0)."""
    c = size_class(nbytes)
    return (0 if c == 0 else 1 << c), (1 << (c + 1)) - 1


def rows_from_configs(tuned: Mapping[tuple[str, int], Mapping[str, Any]]) -> list[TableRow]:
    """Table rows from tuned configs keyed by (collective, message bytes).

    Each tuned size covers the range up to halfway (geometrically) to the next
    tuned size of the same collective; the smallest starts at 0 and the
    largest extends to 2**64-1.

    Args:
      tuned: ``{(collective, nbytes): config}`` where a config has
        ``algorithm``, ``protocol`` and optionally ``nchannels``.
    """
    rows: list[TableRow] = []
    by_coll: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for (coll, nbytes), cfg in tuned.items():
        by_coll.setdefault(coll, []).append((int(nbytes), cfg))
    for coll, items in sorted(by_coll.items()):
        items.sort(key=lambda x: x[0])
        lo = 0
        for i, (nbytes, cfg) in enumerate(items):
            hi = MAX_BYTES if i + 1 == len(items) else int((nbytes * items[i + 1][0]) ** 0.5)
            rows.append(
                TableRow(
                    coll,
                    lo,
                    hi,
                    cfg.get("algorithm"),
                    cfg.get("protocol"),
                    int(cfg.get("nchannels", 0)),
                )
            )
            lo = hi + 1
    return rows


def plugin_env(library: str, table: str) -> dict[str, str]:
    """Environment that makes NCCL load the plugin with this table."""
    return {"NCCL_TUNER_PLUGIN": os.path.abspath(library), TABLE_ENV: os.path.abspath(table)}
