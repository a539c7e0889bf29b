"""Persisted tuning results (JSON), keyed by (collective, size, group) signature.

A tuned config is only valid for the communication pattern it was measured
on (AutoCCL §2.3: "the optimum is not portable" -- the best config of a
64 MB all-reduce is poor for 15 MB). Results are therefore stored per
``Signature`` together with a fingerprint of the search space; a later run
with the same signature and space reuses the config and skips tuning.

References:
  AutoCCL NSDI'25 §2.3 (non-portability of optima), §4.3 (config table).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import Any

from concerto_jax.autoccl.space import Config, SearchSpace

__all__ = ["Signature", "TuningStore"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a tuned config is valid for."""

    collective: str  # e.g. "all-reduce", or "grad-buckets" for a whole bucketed gradient sync
    nbytes: int  # message size (or total bytes of the synchronised pytree)
    group: str  # communicator, e.g. "2proc x 4dev" or "dp=8"

    @property
    def key(self) -> str:
        """Stable string key used in the JSON file."""
        return f"{self.collective}|{self.nbytes}|{self.group}"


class TuningStore:
    """A JSON file mapping ``Signature.key`` to the tuned config and its measurements.

    Writes are atomic (temporary file + rename). A missing or unreadable file
    is an empty store (with a warning for the unreadable case).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("autoccl: tuning store %s unreadable (%s); starting empty", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, signature: Signature, space: SearchSpace) -> dict[str, Any] | None:
        """The stored record for ``signature`` if it was tuned on the same space, else None.

        The record's ``"config"`` entry is returned as a ``Config``.
        """
        rec = self._load().get(signature.key)
        if not isinstance(rec, dict) or rec.get("space") != space.fingerprint():
            return None
        try:
            cfg = Config(rec["config"])
            space.encode(cfg)  # validates every value against the space
        except (KeyError, TypeError, ValueError) as e:
            logger.warning(
                "autoccl: stored record for %s is invalid (%s); ignoring it", signature.key, e
            )
            return None
        return {**rec, "config": cfg}

    def put(self, signature: Signature, space: SearchSpace, config: Config, **fields: Any) -> None:
        """Stores (replaces) the record for ``signature``; extra JSON-serialisable ``fields`` are kept."""
        data = self._load()
        data[signature.key] = {
            "config": dict(config),
            "space": space.fingerprint(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **fields,
        }
        self._write(data)
        logger.info("autoccl: stored %s -> %s in %s", signature.key, dict(config), self.path)

    def put_record(self, signature: Signature, record: dict[str, Any]) -> None:
        """Stores a free-form JSON record (e.g. a whole NCCL plan) under ``signature``."""
        data = self._load()
        data[signature.key] = {"record": record, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._write(data)

    def get_record(self, signature: Signature) -> dict[str, Any] | None:
        """The record stored by ``put_record`` for ``signature``, else None."""
        rec = self._load().get(signature.key)
        return rec.get("record") if isinstance(rec, dict) and isinstance(rec.get("record"), dict) else None

    def _write(self, data: dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autoccl-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=_json_default)
        os.replace(tmp, self.path)

    def keys(self) -> list[str]:
        """Signature keys present in the file."""
        return sorted(self._load())


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")
