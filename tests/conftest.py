"""Test configuration: eight emulated CPU devices, set before any JAX backend starts, and a
plan cache that never reaches the user's: a temporary directory for the session (fixtures of
wider scope, worker processes), a fresh one for each test (no test sees another's plans)."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_SESSION_CACHE = tempfile.mkdtemp(prefix="concerto_plan_cache_")
os.environ["CONCERTO_JAX_CACHE_DIR"] = _SESSION_CACHE
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(autouse=True)
def _plan_cache_per_test(tmp_path_factory, monkeypatch):
    """Each test's plan cache is a directory of its own (Options.cache_dir="auto")."""
    monkeypatch.setenv("CONCERTO_JAX_CACHE_DIR", str(tmp_path_factory.mktemp("plan_cache")))
