"""Deviceless GPU compile for target clusters (skipped without the CUDA plugin) and PGLE profiles."""

import sys

import pytest

from concerto_jax.deviceless import (
    CLUSTERS,
    CompileOptions,
    GpuPluginMissingError,
    compile_fn,
    gpu_plugin_available,
    profile_text,
    require_gpu_plugin,
    target_mesh,
    write_profile,
)

needs_plugin = pytest.mark.skipif(not gpu_plugin_available(),
                                  reason="CUDA PJRT plugin missing: pip install -e .[gpu]")


def test_clusters_registry():
    assert {"h100_sxm_8", "h100_sxm_2x8", "h100_pcie_8", "a100_80_8"} <= set(CLUSTERS)
    two = CLUSTERS["h100_sxm_2x8"]
    assert two.topology == "1x2x8" and two.num_devices == 16
    assert two.host_of(7) == 0 and two.host_of(8) == 1
    assert "gpu_device_info" in CLUSTERS["a100_80_8"].target_config_text()


def test_missing_plugin_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda13", None)
    # Earlier tests may have registered the plugin from its private directory: simulate absence.
    monkeypatch.setattr("concerto_jax.deviceless.cuda_plugin.ensure_registered", lambda: False)
    with pytest.raises(GpuPluginMissingError, match=r"pip install -e \.\[gpu\]"):
        require_gpu_plugin()


def test_pgle_profile_text(tmp_path):
    text = profile_text({"fusion.1": 12.5, 'we"ird': 1})
    assert 'costs { name: "fusion.1" cost_us: 12.5000 }' in text
    assert r'name: "we\"ird"' in text
    assert open(write_profile(tmp_path / "p.pbtxt", {"a": 1.0})).read().startswith("costs")


def _mlp_case(cluster):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = target_mesh(cluster, (2, 4), ("dp", "tp"))

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

    args = [jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)]
    shardings = [NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None)),
                 NamedSharding(mesh, P("dp", None))]
    return jax.grad(loss, argnums=(0, 1)), args, shardings


@needs_plugin
def test_stock_compile_with_lhs_dumps():
    cluster = CLUSTERS["h100_sxm_8"]
    fn, args, sh = _mlp_case(cluster)
    tc = compile_fn(fn, args, cluster, in_shardings=sh)
    assert "is_scheduled=true" in tc.final_text and "all-reduce-start" in tc.final_text
    assert tc.before_lhs_text is not None and "all-reduce-start" in tc.before_lhs_text
    assert tc.after_lhs_text is not None


@needs_plugin
def test_pgle_and_windowed_einsum_variants(tmp_path):
    cluster = CLUSTERS["a100_80_8"]
    fn, args, sh = _mlp_case(cluster)
    stock = compile_fn(fn, args, cluster, in_shardings=sh, options=CompileOptions(dump_lhs=False))
    profile = write_profile(tmp_path / "p.pbtxt", {"all-reduce-start": 500.0})
    pgle = compile_fn(fn, args, cluster, in_shardings=sh,
                              options=CompileOptions(pgle_profile=profile, dump_lhs=False))
    assert pgle.options["xla_gpu_pgle_profile_file_or_directory_path"] == profile
    assert "is_scheduled=true" in pgle.final_text
    we = compile_fn(fn, args, cluster, in_shardings=sh,
                            options=CompileOptions(windowed_einsum_mib=0, dump_lhs=False))
    assert we.options["xla_gpu_threshold_for_windowed_einsum_mib"] == 0
    assert "is_scheduled=true" in we.final_text and stock.before_lhs_text is None


@needs_plugin
def test_a_replicated_module_with_layout_changing_copies_compiles():
    """The SPMD partitioner writes a sharding constraint as a ``copy`` that may change the layout
    (an MoE step's dispatched tokens: ``bf16[1,16,160,2048]{2,0,3,1} copy(...{3,2,1,0})``). The
    deviceless compile of a replicated module goes through StableHLO, which has no ``copy``: each
    copy becomes a reshape to the same dimensions (the same values), layout-changing ones too
    (they failed: "CHLO => [StableHLO+Shape] => StableHLO failed")."""
    import concerto_jax
    from concerto_jax.deviceless.compile import compile_replicated_for_target

    text = """HloModule copies, replica_count=1

ENTRY main {
  p = f32[4,8,16]{2,1,0} parameter(0)
  t = f32[4,8,16]{2,1,0} negate(p)
  same = f32[4,8,16]{2,1,0} copy(t)
  relaid = f32[4,8,16]{1,0,2} copy(t)
  ROOT s = f32[4,8,16]{2,1,0} add(same, relaid)
}
"""
    device = concerto_jax.target_mesh("h100_sxm_8", (8,), ("d",)).devices.flat[0]
    final, _, _ = compile_replicated_for_target(text, [device])
    assert "ENTRY" in final


@needs_plugin
def test_own_compile_options_change_no_kernel():
    """``compile_for_target``'s own compiles turn XLA's generic-fusion autotuner off
    (``jax_compat.deviceless_own_compile_options``: on a deviceless target it only writes the
    default emitter config, at about half of XLA's compile time). The final module must be the
    stock compile's but for that annotation; if a JAX release makes the autotuner choose
    anything on a deviceless target, this fails and the option must go."""
    from concerto_jax import jax_compat
    from concerto_jax.deviceless.compile import own_compile_options
    from tests._helpers import without_default_emitter_configs

    if not jax_compat.deviceless_own_compile_options():
        pytest.skip("this JAX keeps XLA's fusion autotuner in deviceless compiles "
                    "(jax_compat.FUSION_AUTOTUNER_OFF_FROM)")
    cluster = CLUSTERS["h100_sxm_8"]
    fn, args, sh = _mlp_case(cluster)
    stock = compile_fn(fn, args, cluster, in_shardings=sh, options=CompileOptions(dump_lhs=False))
    own = compile_fn(fn, args, cluster, in_shardings=sh,
                     options=CompileOptions(dump_lhs=False, extra=tuple(own_compile_options().items())))
    assert "native_emitter_backend_config" in stock.final_text  # what the option saves: the pass ran
    assert "native_emitter_backend_config" not in own.final_text
    assert without_default_emitter_configs(own.final_text) == without_default_emitter_configs(stock.final_text)
    assert own_compile_options({"xla_gpu_experimental_enable_fusion_autotuner": True}) == {
        "xla_gpu_experimental_enable_fusion_autotuner": True}  # the user's setting wins


@needs_plugin
def test_a_shared_kernel_cache_changes_no_module(tmp_path):
    """``compile_for_target``'s compiles of one call share XLA's kernel cache (D40): a compile
    that finds its kernels there writes the same final module as one that compiles them."""
    from concerto_jax.deviceless.compile import own_compile_options

    cluster = CLUSTERS["h100_sxm_8"]
    fn, args, sh = _mlp_case(cluster)
    plain = compile_fn(fn, args, cluster, in_shardings=sh,
                       options=CompileOptions(dump_lhs=False, extra=tuple(own_compile_options().items())))
    cache = tmp_path / "kernels.pb"
    cached = CompileOptions(dump_lhs=False, extra=tuple(own_compile_options(kernel_cache=str(cache)).items()))
    fill = compile_fn(fn, args, cluster, in_shardings=sh, options=cached)
    assert cache.stat().st_size > 0  # XLA wrote its kernels there
    hit = compile_fn(fn, args, cluster, in_shardings=sh, options=cached)
    assert fill.final_text == plain.final_text
    assert hit.final_text == plain.final_text
