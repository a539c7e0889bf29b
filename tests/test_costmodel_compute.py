"""Compute cost rules, profile-store overrides and signatures, and the CPU measurement path."""

import pytest

from concerto_jax.costmodel import (
    ArrayInfo,
    ComputeOptions,
    CostModel,
    OpInfo,
    ProfileStore,
    compute_time_us,
    get_cluster,
    signature,
    work_of,
)

GPU = get_cluster("h100_sxm_8").gpu_spec
IDEAL = ComputeOptions(matmul_efficiency=1.0, memory_efficiency=1.0, launch_overhead_us=0.0)


def A(dtype, *dims):
    return (ArrayInfo(dtype, dims),)


def _dot(m, k, n, dtype="bf16", name="d"):
    return OpInfo(name, "dot", A(dtype, m, n), (A(dtype, m, k), A(dtype, k, n)),
                  {"lhs_contracting_dims": "{1}", "rhs_contracting_dims": "{0}"})


def test_free_ops_cost_nothing():
    for opcode in ("parameter", "constant", "get-tuple-element", "bitcast", "tuple"):
        assert compute_time_us(OpInfo("x", opcode, A("f32", 1024)), GPU) == 0


def test_dot_is_compute_bound_and_uses_dtype_peak():
    op = _dot(8192, 8192, 8192)
    us = compute_time_us(op, GPU, IDEAL)
    assert us == pytest.approx(1e6 * 2 * 8192**3 / GPU.matmul_flops_per_s("bf16"))
    f32 = compute_time_us(_dot(8192, 8192, 8192, "f32"), GPU, IDEAL)
    assert f32 == pytest.approx(2 * us, rel=0.01)  # TF32 is half the bf16 rate
    slow = compute_time_us(op, GPU, ComputeOptions(matmul_efficiency=0.5, launch_overhead_us=3.0))
    assert slow == pytest.approx(2 * us + 3.0)


def test_elementwise_is_memory_bound():
    op = OpInfo("e", "add", A("f32", 1 << 20), (A("f32", 1 << 20), A("f32", 1 << 20)))
    assert compute_time_us(op, GPU, IDEAL) == pytest.approx(1e6 * 3 * 4 * (1 << 20) / GPU.hbm_bytes_per_s)


def test_fusion_walks_body_and_counts_boundary_bytes():
    p0 = OpInfo("p0", "parameter", A("bf16", 4096, 4096), parameter_number=0)
    p1 = OpInfo("p1", "parameter", A("bf16", 4096, 4096), parameter_number=1)
    d = OpInfo("d", "dot", A("bf16", 4096, 4096), (A("bf16", 4096, 4096),) * 2,
               {"lhs_contracting_dims": "{1}"}, operand_ids=(0, 1))
    t = OpInfo("t", "tanh", A("bf16", 4096, 4096), (A("bf16", 4096, 4096),), operand_ids=(2,))
    fusion = OpInfo("f", "fusion", A("bf16", 4096, 4096), (A("bf16", 4096, 4096),) * 2,
                    {"kind": "kCustom"}, {"calls": (p0, p1, d, t)})
    w = work_of(fusion)
    assert dict(w.matmul_flops)["bf16"] == 2 * 4096**3
    assert w.bytes == 3 * 4096 * 4096 * 2
    assert w.vector_flops == 4 * 4096 * 4096


def test_slice_only_parameter_reads_the_slice():
    p = OpInfo("p", "parameter", A("f32", 1024, 1024), parameter_number=0)
    s = OpInfo("s", "slice", A("f32", 1, 1024), (A("f32", 1024, 1024),), {"slice": "{[0:1], [0:1024]}"},
               operand_ids=(0,))
    f = OpInfo("f", "fusion", A("f32", 1, 1024), (A("f32", 1024, 1024),), {}, {"calls": (p, s)})
    assert work_of(f).bytes == 2 * 1024 * 4


def test_signature_ignores_names_and_metadata():
    a = _dot(64, 64, 64, name="a")
    b = OpInfo("b", "dot", a.result, a.operands, {**a.attrs, "metadata": "{op_name=\"x\"}"})
    assert signature(a) == signature(b)
    assert signature(a) != signature(_dot(64, 128, 64))


def test_store_overrides_model(tmp_path):
    store = ProfileStore("test")
    op = _dot(64, 64, 64)
    store.record(op, 10.0)
    store.record(op, 20.0)
    path = tmp_path / "s.json"
    store.save(path)
    loaded = ProfileStore.load(path)
    assert loaded.lookup(op) == pytest.approx(15.0)
    model = CostModel(get_cluster("h100_sxm_8"), store=loaded)
    assert model.compute_us(op) == pytest.approx(15.0)
    assert model.compute_us(_dot(64, 32, 64)) != pytest.approx(15.0)
    assert model.hits == 1 and model.misses == 1


def test_cpu_profile_of_a_small_program():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from bench.cpu_validation import profile_module_on_cpu
    from hlo_passes.ir.parser import parse_module

    x = np.ones((128, 128), np.float32)
    compiled = jax.jit(lambda a, b: jnp.tanh(a @ b) + 1.0).lower(x, x).compile()
    prof = profile_module_on_cpu(parse_module(compiled.as_text()), repeats=3)
    assert prof.measured >= 1 and not prof.failed
    assert all(e.us >= 0 for e in prof.store.entries.values())


def test_cudnn_convolution_flops_forward_and_backward():
    x, w, y = A("bf16", 4, 56, 56, 64), A("bf16", 128, 3, 3, 64), A("bf16", 4, 56, 56, 128)
    scratch = (ArrayInfo("u8", (0,)),)
    flops = 2 * 4 * 56 * 56 * 128 * 3 * 3 * 64
    attrs = {"dim_labels": "b01f_o01i->b01f", "window": "{size=3x3 pad=1_1x1_1}"}
    fwd = OpInfo("f", "custom-call", y + scratch, (x, w), {**attrs, "custom_call_target": "__cudnn$convForward"})
    bwi = OpInfo("i", "custom-call", x + scratch, (y, w),
                 {**attrs, "custom_call_target": "__cudnn$convBackwardInput"})
    bwf = OpInfo("w", "custom-call", w + scratch, (x, y),
                 {**attrs, "custom_call_target": "__cudnn$convBackwardFilter"})
    for op in (fwd, bwi, bwf):
        assert dict(work_of(op).matmul_flops)["bf16"] == flops
