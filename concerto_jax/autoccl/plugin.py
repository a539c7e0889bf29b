"""NCCL tuner plugin: build the C library, write its rule table from tuned configs.

NCCL (>= 2.22) loads the library named by ``NCCL_TUNER_PLUGIN`` and, for
every collective, lets its ``getCollInfo`` edit the (algorithm x protocol)
cost table and the channel count. Our plugin (``nccl_tuner/concerto_tuner.c``,
written against our own declaration of the v3 API in
``nccl_tuner/concerto_tuner_api.h``) answers from a text table whose path is
in ``CONCERTO_NCCL_TUNER_TABLE``: one rule per line,
``<collective> <min_bytes> <max_bytes> <algorithm> <protocol> <channels>``;
the first matching rule sets its cell to 0.0 (NCCL picks the cheapest cell)
and ``nChannels``. A bad or missing table logs a warning through NCCL's
logger and leaves NCCL's defaults.

This is how per-collective tuned choices reach NCCL, where the environment
(``knobs.nccl_env``) can only set one value for the whole process.

References:
  AutoCCL NSDI'25 §5 (implementation inside NCCL's per-collective decision).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "LIBRARY_NAME",
    "SOURCE_DIR",
    "TABLE_ENV",
    "PluginBuildError",
    "TableRow",
    "build",
    "build_harness",
    "ensure_built",
    "plugin_env",
    "rows_from_configs",
    "write_table",
]

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "nccl_tuner")
LIBRARY_NAME = (
    "libnccl-tuner-concerto.so"  # NCCL_TUNER_PLUGIN=concerto also finds it on LD_LIBRARY_PATH
)
TABLE_ENV = "CONCERTO_NCCL_TUNER_TABLE"
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
_ALGOS = {"ring": "ring", "tree": "tree"}
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


def build(out_dir: str | os.PathLike[str]) -> str:
    """Compiles the plugin with the system compiler (``cc -shared -fPIC``).

    Args:
      out_dir: directory for the library (created if needed).

    Returns:
      Path of ``libnccl-tuner-concerto.so``.

    Raises:
      PluginBuildError: no compiler, or compilation failed.
    """
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(os.fspath(out_dir), LIBRARY_NAME)
    srcs = [os.path.join(SOURCE_DIR, s) for s in _SOURCES]
    _run([_compiler(), "-shared", "-fPIC", "-O2", "-Wall", "-I", SOURCE_DIR, "-o", out, *srcs])
    logger.info("autoccl: built NCCL tuner plugin %s", out)
    return out


def build_harness(out_dir: str | os.PathLike[str]) -> str:
    """Compiles the small dlopen harness (``nccl_tuner/harness.c``) used by tests; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(os.fspath(out_dir), "concerto_tuner_harness")
    _run(
        [
            _compiler(),
            "-O2",
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
    """One rule of the plugin's table."""

    collective: str  # "all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce" or "*"
    min_bytes: int  # inclusive lower bound of the message size
    max_bytes: int  # inclusive upper bound
    algorithm: str  # "Ring" or "Tree"
    protocol: str  # "LL", "LL128" or "Simple"
    channels: int = 0  # > 0 sets nChannels; 0 keeps NCCL's choice

    def render(self) -> str:
        """The table line; raises ValueError on an unknown name or bad range."""
        try:
            coll = _COLLECTIVES[self.collective]
            algo, proto = _ALGOS[self.algorithm.lower()], _PROTOS[self.protocol.lower()]
        except KeyError as e:
            raise ValueError(
                f"TableRow {self}: unknown {e}; collectives {sorted(_COLLECTIVES)}, algorithms Ring/Tree, "
                "protocols LL/LL128/Simple."
            ) from None
        if not 0 <= self.min_bytes <= self.max_bytes <= MAX_BYTES or self.channels < 0:
            raise ValueError(
                f"TableRow {self}: need 0 <= min_bytes <= max_bytes < 2**64 and channels >= 0."
            )
        return f"{coll} {self.min_bytes} {self.max_bytes} {algo} {proto} {self.channels}"


def write_table(rows: Iterable[TableRow], path: str | os.PathLike[str]) -> str:
    """Writes the rules (first match wins, so order matters) and returns the path."""
    lines = [
        "# concerto_jax NCCL tuner table: collective min_bytes max_bytes algorithm protocol channels"
    ]
    lines += [r.render() for r in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return os.fspath(path)


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
                    coll, lo, hi, cfg["algorithm"], cfg["protocol"], int(cfg.get("nchannels", 0))
                )
            )
            lo = hi + 1
    return rows


def plugin_env(library: str, table: str) -> dict[str, str]:
    """Environment that makes NCCL load the plugin with this table."""
    return {"NCCL_TUNER_PLUGIN": os.path.abspath(library), TABLE_ENV: os.path.abspath(table)}
