"""The JAX compatibility layer: the supported range, the fallback on an unchecked JAX, and the
reload of our executable behind the step's serialization header (JAX's C++ dispatch kept)."""

import warnings

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import concerto_jax
import hlo_passes
from concerto_jax import executor, jax_compat
from concerto_jax.capture import capture
from tests._helpers import ALWAYS_RECOMPILE_UNCHECKED, assert_tree_bitwise
from tests.test_optimize import _mesh, _mlp_step


@pytest.mark.parametrize(("version", "parsed"), [
    ("0.12.0.1", (0, 12, 0, 1)), ("0.11.2", (0, 11, 2)), ("0.13.0rc1", (0, 13, 0)),
    ("0.12.1.dev20261101", (0, 12, 1)), ("1.0", (1, 0))])
def test_versions_parse_to_comparable_tuples(version, parsed):
    assert jax_compat.parse_version(version) == parsed


def test_the_installed_jax_is_in_the_checked_range():
    jax_compat.check_supported()
    assert jax_compat.MIN_VERSION <= jax_compat.parse_version(jax.__version__) < jax_compat.NEXT_UNCHECKED


@pytest.mark.parametrize("versions", [("0.13.0", "0.13.0"), ("0.10.2", "0.10.2"), ("0.12.0.1", "0.13.1")])
def test_an_unchecked_jax_is_refused_with_what_to_do(monkeypatch, versions):
    monkeypatch.setattr(jax_compat, "jax_versions", lambda: versions)
    monkeypatch.delenv(jax_compat.ALLOW_ENV, raising=False)
    with pytest.raises(jax_compat.UnsupportedJaxVersion, match=r"checked with jax/jaxlib >= 0\.11\.2, < 0\.13"):
        jax_compat.check_supported()
    monkeypatch.setenv(jax_compat.ALLOW_ENV, "1")
    jax_compat.check_supported()  # the user's explicit choice lets it through


def test_optimize_on_an_unchecked_jax_runs_the_original_with_one_warning(monkeypatch):
    monkeypatch.setattr(jax_compat, "jax_versions", lambda: ("0.13.0", "0.13.0"))
    monkeypatch.delenv(jax_compat.ALLOW_ENV, raising=False)
    step, make_args = _mlp_step(_mesh())
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = opt(*make_args())
        got = opt(*make_args())
    fallbacks = [w for w in caught if issubclass(w.category, concerto_jax.ConcertoFallbackWarning)]
    assert len(fallbacks) == 1 and "jax 0.13.0" in str(fallbacks[0].message)
    assert opt.report().fallback_reason is not None and opt.report().executable == "original"
    assert_tree_bitwise(got, step(*make_args()))
    strict = concerto_jax.optimize(step, concerto_jax.Options(passes=("schedule",), fallback=False))
    with pytest.raises(jax_compat.UnsupportedJaxVersion):
        strict(*make_args())


def test_compile_for_target_on_an_unchecked_jax_refuses_before_any_compile(monkeypatch):
    from concerto_jax.deviceless import program
    monkeypatch.setattr(jax_compat, "jax_versions", lambda: ("0.13.0", "0.13.0"))
    monkeypatch.delenv(jax_compat.ALLOW_ENV, raising=False)
    compiled = []
    monkeypatch.setattr(program, "compile_lowered", lambda *a, **k: compiled.append(a))
    step, make_args = _mlp_step(_mesh())
    with pytest.raises(jax_compat.UnsupportedJaxVersion, match="jax 0.13.0"):
        concerto_jax.compile_for_target(step, *make_args())
    assert compiled == []


def test_ifrt_header_length_rejects_what_is_not_a_serialized_executable():
    with pytest.raises(ValueError, match="no varint-delimited IFRT header"):
        jax_compat.ifrt_header_length(b"\xff\xff")
    with pytest.raises(ValueError, match="header of 200 bytes"):
        jax_compat.ifrt_header_length(bytes([200, 1]) + b"x" * 10)
    assert jax_compat.ifrt_header_length(bytes([3]) + b"abc" + b"payload") == 4


def _recompiled(step, args, opt_passes=("schedule",)):
    opt = concerto_jax.optimize(step, concerto_jax.Options(passes=opt_passes,
                                                           optimize=ALWAYS_RECOMPILE_UNCHECKED))
    opt(*args)
    return opt


def test_our_executable_runs_behind_the_steps_header_through_jax_dispatch(monkeypatch):
    """The swapped step is served by JAX's C++ dispatch: ``Compiled.call`` (the Python path)
    runs for the first call only, as for plain jit, and every output reads back bitwise."""
    from jax._src import stages

    calls = []
    real = stages.Compiled.call
    monkeypatch.setattr(stages.Compiled, "call", staticmethod(
        lambda *a, **k: calls.append(1) or real(*a, **k)))
    step, make_args = _mlp_step(_mesh())
    opt = _recompiled(step, make_args())
    assert opt.report().executable == "recompiled"
    calls.clear()
    params, x = make_args()
    ref_params, _ = make_args()
    for _ in range(3):
        params, value = opt(params, x)
        ref_params, ref_value = step(ref_params, x)
        assert_tree_bitwise((params, value), (ref_params, ref_value))
    assert len(calls) <= 1, f"the Python dispatch path ran {len(calls)} times in 3 calls"


def test_without_serialization_outputs_are_assembled_per_call(monkeypatch, caplog):
    """A client that cannot serialize: every output is assembled from its per-device buffers
    (one warning in the log), the results are still bitwise those of the step."""
    def unsupported(executable):
        raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: serialization")

    monkeypatch.setattr(jax_compat, "pjrt_payload", unsupported)
    monkeypatch.setattr(executor, "_NO_FAST_PATH", set())
    step, make_args = _mlp_step(_mesh())
    with caplog.at_level("WARNING", logger="concerto_jax.executor"):
        opt = _recompiled(step, make_args())
    assert sum("assembled per call" in r.message for r in caplog.records) == 1
    params, x = make_args()
    ref_params, _ = make_args()
    for _ in range(2):
        params, value = opt(params, x)
        ref_params, ref_value = step(ref_params, x)
        assert_tree_bitwise((params, value), (ref_params, ref_value))


def test_a_module_whose_signature_changed_is_refused_before_loading():
    step, make_args = _mlp_step(_mesh())
    text = capture(step, make_args()).hlo_text
    executor.check_signature(text, hlo_passes.module_to_text(hlo_passes.parse_module(text)))
    parsed = hlo_passes.parse_module(text)
    param = parsed.entry.parameters[0]
    param.shape = hlo_passes.Shape.array(param.shape.dtype, tuple(d + 1 for d in param.shape.dims),
                                         param.shape.layout)
    with pytest.raises(executor.ExecutorError, match="entry parameters differ"):
        executor.check_signature(text, hlo_passes.module_to_text(parsed))


def test_collective_pipeliner_flags_are_the_ones_this_xla_accepts():
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless import gpu_plugin_available
    from concerto_jax.deviceless.compile import CompileOptions, compile_lowered, lower_for_target

    if not gpu_plugin_available():
        pytest.skip("CUDA PJRT plugin missing: pip install -e .[gpu]")
    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("x",))

    @jax.jit
    def scanned(w, x):
        y, _ = jax.lax.scan(lambda c, wi: (jax.numpy.tanh(c @ wi), None), x, w)
        return y.sum()

    args = (jax.ShapeDtypeStruct((4, 256, 256), "float32", sharding=NamedSharding(mesh, P(None, "x"))),
            jax.ShapeDtypeStruct((32, 256), "float32", sharding=NamedSharding(mesh, P())))
    lowered = lower_for_target(scanned.trace(*args))
    h100 = get_cluster("h100_sxm_8")
    for on in (True, False):
        compile_lowered(lowered, h100, CompileOptions(extra=jax_compat.collective_pipeliner_options(on)))
    with pytest.raises(Exception, match="xla_gpu_enable_pipelined_all_gather"):  # the old boolean form
        compile_lowered(lowered, h100, CompileOptions(extra=(("xla_gpu_enable_pipelined_all_gather", True),)))


def test_one_program_traced_from_two_call_sites_differs_only_in_source_locations():
    """JAX records where a step was traced; processes (or a plan-cache key) that trace it from
    different code paths must still agree that it is the same program."""
    from hlo_passes.ir import without_source_locations

    step, make_args = _mlp_step(_mesh())
    args = make_args()

    def via_helper():
        return capture(step, args).hlo_text

    direct = capture(step, args).hlo_text
    jax.clear_caches()  # trace again, from the helper
    nested = via_helper()
    assert direct != nested, "the two traces should record different call stacks"
    assert without_source_locations(direct) == without_source_locations(nested)
    assert "stack_frame_id" not in without_source_locations(direct)
    assert "StackFrames" not in without_source_locations(direct)
