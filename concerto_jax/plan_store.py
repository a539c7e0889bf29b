"""The plan cache's store on disk: one directory per key, written atomically, checked on read.

Layout under the root (``Options.cache_dir``)::

    <root>/entries/<kind>/<key[:2]>/<key>/manifest.json   format, kind, key, key parts, meta,
                                                          and each blob's size and SHA-256
    <root>/entries/<kind>/<key[:2]>/<key>/<blob>          the bytes
    <root>/staging/                                       entries being written or removed

A writer builds the whole entry under ``staging`` and renames the directory into place: a
reader sees an entry whole or not at all, and of two writers of one key the first rename
wins, the other discards its copy. A reader checks the format version, the kind, the key and
its parts, and every blob's size and SHA-256; an entry that fails any check is reported with
one ``PlanCacheWarning``, removed (renamed into ``staging``, then deleted) and treated as
absent: never trusted. Least recently used entries (a hit touches the manifest) are evicted
once the store holds more than ``max_bytes``.

This module knows nothing of JAX or of what the blobs mean (``concerto_jax.plan_cache``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Mapping

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bumped whenever the manifest or a blob changes meaning: older entries are then stale."""
ENV_DIR = "CONCERTO_JAX_CACHE_DIR"
"""Overrides the default directory (``Options.cache_dir="auto"``): tests and CI point it at a
temporary directory."""
ENV_MAX_BYTES = "CONCERTO_JAX_CACHE_MAX_BYTES"
"""Overrides ``DEFAULT_MAX_BYTES``."""
DEFAULT_MAX_BYTES = 4 << 30
"""Size past which least recently used entries are evicted."""
STAGING_MAX_AGE_S = 3600.0
"""A staging directory older than this is a crashed writer's: removed at the next eviction."""
MANIFEST = "manifest.json"


class PlanCacheWarning(UserWarning):
    """A cache entry was corrupted or stale: it is ignored (and removed), the step compiles
    as without a cache."""


def default_dir() -> str:
    """``$CONCERTO_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/concerto_jax/plans``, else
    ``~/.cache/concerto_jax/plans`` (read at each call, never at import)."""
    override = os.environ.get(ENV_DIR)
    if override:
        return os.path.expanduser(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "concerto_jax", "plans")


def resolve_dir(cache_dir: str | os.PathLike | None) -> str | None:
    """The directory an ``Options.cache_dir`` names: ``"auto"`` -> ``default_dir()``, None ->
    None (no cache), a path -> that path (``~`` expanded)."""
    if cache_dir is None:
        return None
    if cache_dir == "auto":
        return default_dir()
    return os.path.expanduser(os.fspath(cache_dir))


def key_of(parts: Mapping) -> str:
    """The SHA-256 (hex) of the canonical JSON of ``parts`` (sorted keys)."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


def canonical_json(value) -> str:
    """``value`` as JSON with sorted keys and no spaces (raises TypeError for what JSON lacks)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class Entry:
    """An entry read and checked: its key, the facts written beside the blobs, the blobs."""

    key: str
    meta: dict
    blobs: dict[str, bytes]


class PlanStore:
    """Entries by (kind, key parts) under ``root``; safe under concurrent writers and readers.

    Args:
      root: the cache directory (created on the first write).
      max_bytes: eviction threshold; default ``$CONCERTO_JAX_CACHE_MAX_BYTES`` or
        ``DEFAULT_MAX_BYTES``.
    """

    def __init__(self, root: str, max_bytes: int | None = None):
        self.root = root
        if max_bytes is None:
            max_bytes = int(os.environ.get(ENV_MAX_BYTES) or DEFAULT_MAX_BYTES)
        self.max_bytes = max_bytes

    def path(self, kind: str, key: str) -> str:
        """The directory of the entry ``key`` of ``kind``."""
        return os.path.join(self.root, "entries", kind, key[:2], key)

    # -- read ----------------------------------------------------------------------------------
    def read(self, kind: str, parts: Mapping) -> Entry | None:
        """The entry of ``parts``, checked; None if absent, or after one warning if it fails a
        check (it is then removed).

        The entry's directory is opened once and every file read through it, so the files read
        belong to one entry even while other processes replace or remove it; a read that fails
        because the entry was removed meanwhile is a plain miss.
        """
        key = key_of(parts)
        path = self.path(kind, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        except OSError as e:
            self.reject(kind, key, f"its directory cannot be opened ({e})")
            return None
        try:
            problem, manifest, blobs = _check(fd, kind, key, parts)
            if problem and _unlinked(fd, path):
                return None  # removed or replaced by another process while we read it
        finally:
            os.close(fd)
        if problem:
            self.reject(kind, key, problem)
            return None
        try:
            os.utime(os.path.join(path, MANIFEST))  # least recently used goes first
        except OSError:
            pass
        return Entry(key, dict(manifest.get("meta", {})), blobs)

    def reject(self, kind: str, key: str, why: str) -> None:
        """Report an entry that must not be trusted (one ``PlanCacheWarning``) and remove it."""
        path = self.path(kind, key)
        message = (f"concerto_jax plan cache: ignoring the {kind} entry {path}: {why}; compiling "
                   "as without a cache")
        warnings.warn(message, PlanCacheWarning, stacklevel=3)
        log.warning("%s", message)
        self._remove(path)

    # -- write ---------------------------------------------------------------------------------
    def write(self, kind: str, parts: Mapping, blobs: Mapping[str, bytes],
              meta: Mapping | None = None) -> bool:
        """Write an entry atomically; False if another writer's copy was there first or the
        directory cannot be written (logged, never raised)."""
        key = key_of(parts)
        final = self.path(kind, key)
        if os.path.isdir(final):
            return False
        staging = os.path.join(self.root, "staging", f"{key}.{os.getpid()}.{uuid.uuid4().hex}")
        try:
            os.makedirs(staging)
            facts = {}
            for name, data in blobs.items():
                if not _blob_name_ok(name):
                    raise ValueError(f"bad blob name {name!r}")
                with open(os.path.join(staging, name), "wb") as f:
                    f.write(data)
                facts[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            manifest = {"format": FORMAT_VERSION, "kind": kind, "key": key,
                        "parts": json.loads(canonical_json(parts)), "meta": dict(meta or {}),
                        "blobs": facts, "written": time.time(),
                        "writer": {"host": socket.gethostname(), "pid": os.getpid()}}
            with open(os.path.join(staging, MANIFEST), "w") as f:
                f.write(canonical_json(manifest))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(staging, final)  # atomic; fails if another writer's entry is there
        except (OSError, ValueError, TypeError) as e:
            shutil.rmtree(staging, ignore_errors=True)
            if os.path.isdir(final):
                log.debug("plan cache: %s entry %s was written by another process first", kind, key[:12])
            else:
                log.warning("plan cache: could not write the %s entry %s (%s)", kind, final, e)
            return False
        log.info("plan cache: wrote the %s entry %s", kind, final)
        self.evict()
        return True

    # -- removal and eviction ----------------------------------------------------------------
    def remove(self, kind: str, key: str) -> None:
        """Remove the entry ``key`` of ``kind`` if there is one (a reader then sees a miss)."""
        self._remove(self.path(kind, key))

    def _remove(self, path: str) -> None:
        """Take ``path`` out of the namespace in one rename, then delete it."""
        trash = os.path.join(self.root, "staging", f"removed.{uuid.uuid4().hex}")
        try:
            os.makedirs(os.path.dirname(trash), exist_ok=True)
            os.rename(path, trash)
        except OSError:
            return  # already removed by another process, or not ours to remove
        shutil.rmtree(trash, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, str]]:
        """``(last use, bytes, path)`` of every entry."""
        out = []
        top = os.path.join(self.root, "entries")
        for kind in _listdir(top):
            for shard in _listdir(os.path.join(top, kind)):
                for key in _listdir(os.path.join(top, kind, shard)):
                    path = os.path.join(top, kind, shard, key)
                    try:
                        used = os.stat(os.path.join(path, MANIFEST)).st_mtime
                        size = sum(os.stat(os.path.join(path, n)).st_size for n in _listdir(path))
                    except OSError:
                        continue
                    out.append((used, size, path))
        return out

    def evict(self) -> None:
        """Remove least recently used entries until the store holds at most ``max_bytes``, and
        staging directories older than ``STAGING_MAX_AGE_S``."""
        staging = os.path.join(self.root, "staging")
        now = time.time()
        for name in _listdir(staging):
            path = os.path.join(staging, name)
            try:
                old = now - os.stat(path).st_mtime > STAGING_MAX_AGE_S
            except OSError:
                continue
            if old:
                shutil.rmtree(path, ignore_errors=True)
        entries = sorted(self.entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            log.info("plan cache: evicting %s (%d bytes; the store holds %d of %d)", path, size,
                     total, self.max_bytes)
            self._remove(path)
            total -= size


def _read_at(fd: int, name: str) -> bytes:
    f = os.open(name, os.O_RDONLY, dir_fd=fd)
    with os.fdopen(f, "rb") as fh:
        return fh.read()


def _check(fd: int, kind: str, key: str, parts: Mapping) -> tuple[str, dict, dict[str, bytes]]:
    """``(problem or '', manifest, blobs)`` of the entry whose directory ``fd`` is."""
    try:
        manifest = json.loads(_read_at(fd, MANIFEST))
        problem = _manifest_problem(manifest, kind, key, parts)
    except OSError as e:
        return f"its manifest cannot be read ({e})", {}, {}
    except (ValueError, TypeError, AttributeError) as e:
        return (f"its manifest is not valid JSON of the expected form ({type(e).__name__}: {e})",
                {}, {})
    if problem:
        return problem, manifest, {}
    blobs = {}
    for name, facts in manifest["blobs"].items():
        try:
            data = _read_at(fd, name)
        except OSError as e:
            return f"its blob {name!r} cannot be read ({e})", manifest, {}
        if len(data) != facts["size"] or hashlib.sha256(data).hexdigest() != facts["sha256"]:
            return (f"its blob {name!r} does not match its checksum ({len(data)} bytes, "
                    f"{facts['size']} expected)"), manifest, {}
        blobs[name] = data
    return "", manifest, blobs


def _unlinked(fd: int, path: str) -> bool:
    """Whether the directory ``fd`` is no longer the one at ``path``."""
    try:
        here, now = os.fstat(fd), os.stat(path)
    except OSError:
        return True
    return (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino)


def _manifest_problem(manifest: dict, kind: str, key: str, parts: Mapping) -> str:
    """What is wrong with a manifest read for (kind, key, parts), or ''."""
    if manifest.get("format") != FORMAT_VERSION:
        return (f"it has format version {manifest.get('format')!r}, this version reads "
                f"{FORMAT_VERSION} (stale)")
    if manifest.get("kind") != kind or manifest.get("key") != key:
        return f"its manifest names {manifest.get('kind')!r} entry {str(manifest.get('key'))[:12]}"
    want = json.loads(canonical_json(parts))
    if manifest.get("parts") != want:
        differ = sorted(k for k in set(want) | set(manifest.get("parts") or {})
                        if want.get(k) != (manifest.get("parts") or {}).get(k))
        return f"its key parts differ from this step's ({differ}): stale"
    blobs = manifest.get("blobs")
    if not isinstance(blobs, dict) or not all(
            _blob_name_ok(name) and isinstance(f, dict) and isinstance(f.get("size"), int)
            and isinstance(f.get("sha256"), str) for name, f in blobs.items()):
        return "its manifest lists no valid blobs"
    return ""


def _blob_name_ok(name: object) -> bool:
    return (isinstance(name, str) and bool(name) and "/" not in name and os.sep not in name
            and not name.startswith(".") and name != MANIFEST)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
