"""The CUDA PJRT plugin for the deviceless GPU compile, kept out of JAX's plugin discovery.

Why: JAX imports every module of the ``jax_plugins`` namespace (and the
``jax_plugins`` entry points) at start-up and calls its ``initialize()``. The CUDA
plugin then checks the CUDA libraries unless ``JAX_PLATFORMS`` excludes CUDA; on a
CPU-only machine that check fails (``Unable to load cuDNN``; with every CUDA library
installed it fails on ``cuInit: CUDA_ERROR_NO_DEVICE`` instead), so *every* JAX
program in the environment printed a traceback at start-up. Installed with pip into
site-packages, the plugin cannot be hidden from that discovery.

What we do: ``python -m concerto_jax.deviceless.cuda_plugin install`` puts the plugin
wheels (``jax-cuda13-pjrt``, ``jax-cuda13-plugin`` at the jax version) into a private
directory (``pip install --target``), outside ``sys.path``; ``ensure_registered()``
(called by the deviceless compile only) imports it from there and runs its
``initialize()`` with the CUDA-library check skipped for that call only
(``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``, read by the plugin; nothing else sees it).
A GPU user who installed JAX's own CUDA build (``jax[cuda13]``) keeps it: when the
plugin is already discovered, nothing is done.

Directory: ``$CONCERTO_JAX_CUDA_PLUGIN_DIR``, else
``~/.cache/concerto_jax/cuda-plugin-<jax version>``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import subprocess
import sys

import jax

from concerto_jax import jax_compat

log = logging.getLogger(__name__)

PLUGIN_MODULE = "jax_plugins.xla_cuda13"
WHEELS = ("jax-cuda13-pjrt", "jax-cuda13-plugin")


def plugin_dir() -> str:
    """Where ``install`` puts the plugin (see the module docstring)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "concerto_jax",
                           f"cuda-plugin-{jax.__version__}")
    return os.environ.get("CONCERTO_JAX_CUDA_PLUGIN_DIR") or default


def install(target: str | None = None) -> str:
    """``pip install --no-deps --target`` the plugin wheels at the jax version; returns the directory."""
    target = target or plugin_dir()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
           "--target", target] + [f"{w}=={jax.__version__}" for w in WHEELS]
    log.info("installing the CUDA plugin for deviceless compiles: %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    return target


def discovered() -> bool:
    """Whether the plugin is importable without our directory (site-packages install, jax[cuda13])."""
    try:
        return importlib.util.find_spec("jax_plugins") is not None and \
            importlib.util.find_spec(PLUGIN_MODULE) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules entry set to None
        return False


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def ensure_registered() -> bool:
    """Make the ``cuda`` platform available for topologies; returns True if it is.

    Order: already registered or discoverable (nothing to do) -> the private directory
    (imported from there, ``initialize()`` with the library check skipped for that call).
    """
    if discovered():
        if "cuda" not in jax_compat.topology_platforms():
            jax_compat.discover_pjrt_plugins()
        return "cuda" in jax_compat.topology_platforms()
    folder = plugin_dir()
    if not os.path.isdir(os.path.join(folder, *PLUGIN_MODULE.split("."))):
        return False
    if "cuda" in jax_compat.topology_platforms():  # registered from the folder by an earlier call
        return True
    # JAX discovers `jax_plugins.*` once, at its first backend or topology use. Let that run
    # now, before our folder is on sys.path: a discovery after the append would find the plugin
    # again and print an ALREADY_EXISTS traceback from its second initialize().
    jax_compat.discover_pjrt_plugins()
    if folder not in sys.path:
        sys.path.append(folder)  # after site-packages; only this process, after JAX started
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(PLUGIN_MODULE)
    except ImportError as e:
        log.warning("the CUDA plugin in %s does not import: %s", folder, e)
        return False
    with _env("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1"):
        module.initialize()
    log.info("registered the CUDA plugin from %s for deviceless compiles", folder)
    _register_library_calls()
    return "cuda" in jax_compat.topology_platforms()


def _register_library_calls() -> None:
    """Register the plugin's GPU library kernels (cuSOLVER, cuSPARSE, ...) with XLA:CUDA.

    jaxlib registers them when JAX starts, from whichever CUDA plugin it can import then;
    ours joins ``sys.path`` later, so a step that calls one (``jnp.linalg.cholesky`` lowers to
    ``cusolver_potrf_ffi``) failed the deviceless compile with "No FFI handler registered".
    ``jax_compat.register_gpu_library_calls`` makes the registrations again, as JAX makes them.
    A module that fails is logged and skipped: a step that needs it gets XLA's error, as before.
    """
    for name, error in jax_compat.register_gpu_library_calls().items():
        log.warning("GPU library calls of jaxlib.%s not registered for deviceless compiles: %s: %s",
                    name, type(error).__name__, error)


def main(argv=None) -> int:
    """``python -m concerto_jax.deviceless.cuda_plugin install [--target DIR]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["install", "where"])
    ap.add_argument("--target", default=None, help="directory (default: plugin_dir())")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "install":
        print(install(args.target))
    else:
        print(args.target or plugin_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
