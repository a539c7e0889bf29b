"""The NCCL tuner plugin is built at install time (setup.py's build hook) and preferred on use."""

import ctypes

from concerto_jax.autoccl import plugin


def test_plugin_built_at_install_and_loadable():
    lib = plugin.installed_library()
    assert lib is not None, "pip install should have compiled the NCCL tuner plugin (setup.py)"
    assert plugin.ensure_built() == lib
    handle = ctypes.CDLL(lib)
    assert hasattr(handle, "ncclTunerPlugin_v3"), "the v3 tuner symbol must be exported"
    assert hasattr(handle, "ncclTunerPlugin_v4"), "the v4 tuner symbol must be exported"
