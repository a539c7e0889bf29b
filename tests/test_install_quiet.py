"""A quiet install: with the CUDA plugin kept out of JAX's discovery (concerto_jax.deviceless.cuda_plugin),
a plain JAX program on a CPU machine starts without a traceback, and the deviceless GPU compile
still finds the plugin.

The test builds the environment the set-up makes on a fresh machine without touching the shared
one: a copy of site-packages (symlinks) without the ``jax_plugins`` namespace and the plugin
distributions, plus a private plugin directory (symlinks to the installed wheels' files), and
runs Python with ``-S`` on it.
"""

import glob
import os
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = sysconfig.get_paths()["purelib"]
PLUGIN_FILES = ("jax_plugins", "jax_cuda13_plugin")


def _hidden(name: str) -> bool:
    return name in PLUGIN_FILES or name.startswith(("jax_cuda13_pjrt-", "jax_cuda13_plugin-"))


def _plugin_home() -> str:
    """Where the plugin's files are: site-packages (old installs) or our private directory (the set-up's)."""
    from concerto_jax.deviceless.cuda_plugin import plugin_dir

    for home in (SITE, plugin_dir()):
        if os.path.isdir(os.path.join(home, "jax_plugins", "xla_cuda13")):
            return home
    pytest.skip("the CUDA plugin is not installed here: run `python -m concerto_jax.deviceless.cuda_plugin install`")


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    home = _plugin_home()
    root = tmp_path_factory.mktemp("env")
    site = root / "site"
    site.mkdir()
    for path in glob.glob(os.path.join(SITE, "*")):
        name = os.path.basename(path)
        if not _hidden(name) and not name.endswith(".pth"):
            os.symlink(path, site / name)
    # The private directory as `cuda_plugin install` lays it out: the two packages AND their
    # dist-info (whose entry points JAX's discovery reads once the folder is on sys.path).
    private = root / "cuda-plugin"
    (private / "jax_plugins").mkdir(parents=True)
    os.symlink(os.path.join(home, "jax_plugins", "xla_cuda13"), private / "jax_plugins" / "xla_cuda13")
    os.symlink(os.path.join(home, "jax_cuda13_plugin"), private / "jax_cuda13_plugin")
    for info in glob.glob(os.path.join(home, "jax_cuda13_*.dist-info")):
        os.symlink(info, private / os.path.basename(info))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{site}", CONCERTO_JAX_CUDA_PLUGIN_DIR=str(private))
    return env


def _run(env, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_plain_jax_program_starts_quietly(fresh_env):
    proc = _run(fresh_env, "import jax; print(jax.devices()[0].platform)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cpu"
    for noise in ("Traceback", "cuDNN", "plugin configuration error"):
        assert noise not in proc.stderr, proc.stderr[-2000:]


def test_target_mesh_then_compile_is_quiet(fresh_env):
    # ensure_registered puts the private folder on sys.path; JAX's one plugin discovery must not
    # find the plugin there a second time (it used to print an ALREADY_EXISTS traceback).
    code = (
        "import concerto_jax\n"
        "mesh = concerto_jax.target_mesh('h100_sxm_8', (8,), ('x',))\n"
        "import jax\n"
        "print(len(mesh.devices.flat), jax.devices()[0].platform)\n"
    )
    # JAX_PLATFORMS=cpu as the deviceless compile requires (the noise showed only then).
    proc = _run({**fresh_env, "JAX_PLATFORMS": "cpu"}, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "8 cpu"
    for noise in ("Traceback", "ALREADY_EXISTS", "plugin configuration error"):
        assert noise not in proc.stderr, proc.stderr[-2000:]


def test_deviceless_compile_finds_the_private_plugin(fresh_env):
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "from jax.experimental import topologies\n"
        "from concerto_jax.deviceless.cuda_plugin import ensure_registered, discovered\n"
        "assert not discovered()\n"
        "assert ensure_registered()\n"
        "topo = topologies.get_topology_desc(platform='cuda', topology_name='h100x8', topology='1x1x8',"
        " target_config=open('concerto_jax/gpu_configs/h100_sxm.txtpb').read())\n"
        "mesh = topologies.make_mesh(topo, (8,), ('x',))\n"
        "s = NamedSharding(mesh, P('x'))\n"
        "f = jax.jit(lambda a: jnp.sum(a * 2.0), in_shardings=s)\n"
        "c = f.trace(jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=s)).lower().compile()\n"
        "print('all-reduce' in c.as_text())\n"
    )
    proc = _run(fresh_env, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
