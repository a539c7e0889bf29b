"""The PJRT C API driver (``concerto_jax.deviceless.pjrt_c``): a scheduled module compiled backend-only
keeps the order we give it (needs the CUDA plugin; deviceless)."""

import functools

import pytest

from concerto_jax.deviceless import gpu_plugin_available

needs_plugin = pytest.mark.skipif(not gpu_plugin_available(), reason="CUDA PJRT plugin missing: pip install -e .[gpu]")


def test_proto_field_reads_length_delimited_fields():
    from concerto_jax.deviceless.pjrt_c import _RUN_BACKEND_ONLY, _proto_field

    msg = bytes([0x08, 0x96, 0x01]) + bytes([0x0A, 3]) + b"abc" + bytes([0x12, 1]) + b"z"
    assert _proto_field(msg, 1) == b"abc" and _proto_field(msg, 2) == b"z"
    with pytest.raises(ValueError):
        _proto_field(msg, 3)
    # CompileOptionsProto.executable_build_options (3) { run_backend_only (11): true }
    assert _proto_field(_RUN_BACKEND_ONLY, 3) == bytes([11 << 3, 1])


@functools.cache
def _after_lhs():
    """XLA's after-LHS module of a step with one all-reduce and independent GEMMs (h100_sxm_8)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import concerto_jax
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless.compile import CompileOptions, compile_lowered

    mesh = concerto_jax.target_mesh("h100_sxm_8", (8,), ("x",))

    def step(a, w, b, v):
        r = a @ w                   # contracting dim sharded: all-reduce
        u = jnp.tanh(b @ v) @ v.T   # independent of the all-reduce
        return r * 2.0, u

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = (jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=sh(P(None, "x"))),
            jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=sh(P("x", None))),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=sh(P())),
            jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=sh(P())))
    lowered = jax.jit(step, out_shardings=(sh(P()), sh(P()))).trace(*args).lower()
    return compile_lowered(lowered, get_cluster("h100_sxm_8"), CompileOptions(dump_lhs=True))


def _entry_order(text):
    import hlo_passes

    return [(i.name, i.opcode) for i in hlo_passes.parse_module(text).entry.instructions]


def _move(text, name, before):
    """``text`` with the entry's instruction line ``name`` moved right before ``before``."""
    lines = text.split("\n")
    (k,) = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(f"%{name} =")]
    line = lines.pop(k)
    (j,) = [i for i, ln in enumerate(lines) if ln.lstrip().removeprefix("ROOT ").startswith(f"%{before} =")]
    lines.insert(j, line)
    return "\n".join(lines)


@needs_plugin
def test_backend_only_compile_keeps_a_reordered_schedule():
    import hlo_passes
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless import pjrt_c

    stock = _after_lhs()
    after = stock.after_lhs_text
    assert "is_scheduled=true" in after.split("\n", 1)[0]
    order = _entry_order(after)
    names = [n for n, _ in order]
    entry = hlo_passes.parse_module(after).entry
    # the all-reduce's async pair: all-reduce-start/done, or (jaxlib >= 0.11) the async-start/done
    # of a Triton collective kernel fusion
    (start,) = [i for i in entry.instructions if i.collective_kind == "all-reduce" and i.async_role == "start"]
    (done,) = [i for i in entry.instructions if i.async_role == "done" and i.async_start() is start]
    start, done = start.name, done.name
    # A legal reordering LHS did not choose.
    window = names[names.index(start) + 1:names.index(done)]
    kernels = [n for n in window if dict(order)[n] == "fusion"]
    if len(kernels) >= 2:
        # LHS overlapped the all-reduce with both GEMMs (jaxlib 0.10): the start moves down to
        # just before the last kernel of its window (the window shrinks from two GEMMs to one).
        ours = _move(after, start, kernels[-1])
    else:
        # LHS left nothing in the window (jaxlib >= 0.11, the all-reduce a collective kernel):
        # the GEMMs that do not read the all-reduce move into it, before the done.
        reads = {start}
        for i in entry.instructions:
            if any(o.name in reads for o in i.operands):
                reads.add(i.name)
        free = [n for n in names[names.index(done) + 1:] if dict(order)[n] == "fusion" and n not in reads]
        assert len(free) >= 2, order
        ours = after
        for n in free:
            ours = _move(ours, n, done)
    assert _entry_order(ours) != order, "the test's reordering must differ from XLA's"

    opts = pjrt_c.spmd_compile_options(8)
    final = pjrt_c.compile_hlo(ours, get_cluster("h100_sxm_8"), opts)
    got = [n for n, _ in _entry_order(final)]
    want = [n for n, _ in _entry_order(ours)]
    assert start in got and got == want  # XLA's backend kept our order, instruction for instruction


@needs_plugin
def test_plugin_error_is_raised_with_its_message():
    from concerto_jax.costmodel import get_cluster
    from concerto_jax.deviceless import pjrt_c

    text = _after_lhs().after_lhs_text
    # Compile options for 4 partitions against a module and topology of 8 devices.
    with pytest.raises(pjrt_c.PjrtCError, match=r"PJRT_Compile failed .*\S") as err:
        pjrt_c.compile_hlo(text, get_cluster("h100_sxm_8"), pjrt_c.spmd_compile_options(3))
    assert err.value.message
