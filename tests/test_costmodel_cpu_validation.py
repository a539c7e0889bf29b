"""The CPU validation harness (``bench.cpu_validation.validate_program``, ``bench.cli validate-cpu``).

No timing figure is asserted: the machine is shared. What is checked: the pipeline
runs on a small program, the store's prediction is the simulator's sum of the
store's kernel times, errors and means are the stated formulas, every kernel of
the program is found in XLA:CPU's profile, and pinning really makes XLA:CPU
single-threaded (no partitioned loop fusion).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from bench.cpu_validation import KernelRow, ValidationRow, mean_abs_error_pct
from concerto_jax.costmodel.specs import GpuSpec

# Fixed spec: the analytical prediction is then a pure function of the module (no probe, no timing).
SPEC = GpuSpec(name="test CPU", matmul_tflops=(("f32", 0.05),), vector_tflops=(("f32", 0.05),),
               hbm_bytes_per_s=20e9, memory_bytes=0, sm_count=0, nvlink_bytes_per_s=0.0, pcie_bytes_per_s=0.0)


def test_errors_and_mean_are_the_stated_formulas():
    r = ValidationRow("p", measured_us=200.0, from_store_us=150.0, analytic_us=260.0, kernels=2, failed=0,
                      measured_wall_us=400.0, from_store_wall_us=500.0)
    assert r.store_error_pct == pytest.approx(-25.0)
    assert r.analytic_error_pct == pytest.approx(30.0)
    assert r.store_wall_error_pct == pytest.approx(25.0)
    assert mean_abs_error_pct([-25.0, 30.0, 5.0]) == pytest.approx(20.0)


def test_validate_program_on_a_small_chain():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from bench.cpu_validation import validate_program

    r = np.random.default_rng(0)
    x, w1, w2 = (r.standard_normal(s).astype(np.float32) for s in ((64, 128), (128, 128), (128, 32)))

    def chain(x, w1, w2):  # dependent kernels only: the simulated time is their sum
        return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum(axis=1)

    row = validate_program("chain", chain, [x, w1, w2], cpu_spec=SPEC, repeats=3, profile_repeats=3)
    assert row.kernels >= 2 and row.failed == 0
    assert len(row.kernel_rows) >= 2
    assert row.measured_us > 0 and row.from_store_us > 0 and row.analytic_us > 0
    # One stream, no collectives, a chain: the store's prediction is the sum of its kernels' times.
    assert row.from_store_us == pytest.approx(sum(k.store_us for k in row.kernel_rows), rel=1e-6)
    assert row.analytic_us == pytest.approx(sum(k.analytic_us for k in row.kernel_rows), rel=1e-6)
    assert row.store_error_pct == pytest.approx(100 * (row.from_store_us - row.measured_us) / row.measured_us)
    # Every kernel of the executable shows up in XLA:CPU's profile of the program.
    assert all(isinstance(k, KernelRow) and k.in_program_us is not None and k.in_program_us > 0
               for k in row.kernel_rows)
    assert row.in_program_sum_us == pytest.approx(sum(k.in_program_us for k in row.kernel_rows))
    assert row.temp_bytes >= 0 and row.page_faults >= 0
    assert jax.devices("cpu")


def test_dispatch_twin_has_the_programs_output_tree():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from bench.cpu_validation import dispatch_twin

    def fn(state, batch):
        return {"a": state["a"] + batch, "b": (state["b"] * 2, jnp.int32(1))}

    state = {"a": np.ones((4, 4), np.float32), "b": np.ones((3,), np.float32)}
    batch = np.ones((4, 4), np.float32)
    out = dispatch_twin(fn, [state, batch])(state, batch)
    assert jax.tree.structure(out) == jax.tree.structure(jax.eval_shape(fn, state, batch))
    assert all(np.shape(leaf) == () for leaf in jax.tree.leaves(out))


def test_unknown_validation_program_is_refused():
    from bench.baseline import VALIDATION_PROGRAMS, _validation_programs

    assert "gpt_block_train_step" in VALIDATION_PROGRAMS and "evoformer_block_train_step" in VALIDATION_PROGRAMS
    with pytest.raises(ValueError, match="unknown validation program"):
        _validation_programs(["no_such_program"])


def test_markdown_mean_matches_rows():
    from bench.baseline import _validation_markdown

    rows = [ValidationRow("a", 100.0, 110.0, 50.0, 1, 0, 100.0, 100.0, 100.0,
                          (KernelRow("k", 100.0, 110.0, 50.0),), 0, 0),
            ValidationRow("b", 100.0, 80.0, 130.0, 1, 0, 100.0, 100.0, 100.0,
                          (KernelRow("k", 100.0, 80.0, 130.0),), 0, 0)]
    md = _validation_markdown(rows, "cmd", "setup", ((0, 0, 0), (0, 0, 0)), 1.0, top=1)
    assert "per-kernel store 15.0 %, analytic 40.0 %" in md
    assert "| a | 100 | 110 | +10.0 | 50 | -50.0 |" in md


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to see XLA:CPU partition a fusion")
def test_pinned_process_compiles_unpartitioned_fusions():
    script = textwrap.dedent("""
        import os, sys
        pin = sys.argv[1] == "pin"
        if pin:
            from bench.cpu_validation import pin_to_one_cpu
            pin_to_one_cpu()
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, jax.numpy as jnp
        x = jnp.ones((512, 512))
        text = jax.jit(lambda a: jnp.tanh(a) * 2.0 + a).lower(x).compile().as_text()
        print(text.count('outer_dimension_partitions":["'))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    counts = {}
    for mode in ("free", "pin"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        counts[mode] = int(out.stdout.split()[-1])
    # The Eigen flag alone leaves the loop fusion split across the intra-op pool; pinning does not.
    assert counts["free"] >= 1
    assert counts["pin"] == 0


def _entry_kernels(fn, *shapes):
    """(opcode, OpInfo) of every kernel of XLA:CPU's optimized module for ``jit(fn)`` on f32 zeros."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from concerto_jax.costmodel import op_info
    from concerto_jax.costmodel.compute import FREE_OPCODES
    from hlo_passes.ir.parser import parse_module

    args = [jnp.zeros(s, jnp.float32) for s in shapes]
    module = parse_module(jax.jit(fn).lower(*args).compile().as_text())
    return [op_info(i) for i in module.entry.instructions if i.opcode not in FREE_OPCODES]


@pytest.mark.parametrize("fn, shapes, expected", [
    (lambda x, y: x @ y, ((64, 64), (64, 64)), "dot_ynn"),  # YNNPACK takes a canonical dot
    (lambda x, y: x.T @ y, ((64, 64), (64, 64)), "dot_plain"),  # ...not a transposed lhs (ynn_support.cc)
    (lambda x: x.sum(axis=1), ((64, 256),), "reduce"),
    (lambda x: x.T * 1.5, ((256, 16),), "transpose"),  # inner dim moved, 64 B read stride
    (lambda x: x.T * 1.5, ((1024, 1024),), "transpose_far"),  # 4 KiB read stride
    (lambda x: jax_tanh(x) * 2.0 + x, ((64, 256),), "stream"),
])
def test_kernel_class_of_small_compiled_kernels(fn, shapes, expected):
    from bench.cpu_validation import KERNEL_CLASSES, cpu_kernel_class

    kernels = _entry_kernels(fn, *shapes)
    assert len(kernels) == 1, [k.name for k in kernels]
    assert expected in KERNEL_CLASSES
    assert cpu_kernel_class(kernels[0]) == expected


def jax_tanh(x):
    import jax.numpy as jnp

    return jnp.tanh(x)


def test_rates_from_probe_times_are_the_stated_formulas():
    from bench.cpu_validation import CpuSpecProbes

    probes = CpuSpecProbes({}, n=512, stream_elements=1 << 20)
    e = 1 << 20
    us = {"trivial": 10.0, "gemm": 2010.0, "dot_plain": 4010.0, "dot_plain_small": 110.0, "axpy": 310.0,
          "poly": 510.0, "exp": 410.0, "row_sum": 210.0, "transpose": 1010.0, "transpose_far": 4010.0}
    r = probes.rates_from(us)
    assert r.dot_ynn_flops == pytest.approx(2 * 512**3 / 2000e-6)
    assert r.dot_plain_flops == pytest.approx(2 * 512**3 / 4000e-6)
    assert r.dot_plain_small_flops == pytest.approx(2 * 64 * 64 * 2048 / 100e-6)
    assert r.stream_bytes == pytest.approx(8 * e / 300e-6)
    assert r.reduce_bytes == pytest.approx(4 * e / 200e-6)
    assert r.transpose_bytes == pytest.approx(8 * e / 1000e-6)
    assert r.transpose_far_bytes == pytest.approx(8 * e / 4000e-6)
    assert r.vector_flops == pytest.approx(32 * e / 500e-6)
    assert r.transcendental_s == pytest.approx(100e-6 / e)  # exp less axpy, per element
    # Longer probe time, lower rate: the two transposes come out in the order of their times.
    assert r.transpose_far_bytes < r.transpose_bytes


def test_probes_give_positive_rates_and_each_class_uses_its_own():
    pytest.importorskip("jax")
    import math

    from bench.cpu_validation import cpu_kernel_time_us, measure_cpu_rates

    rates = measure_cpu_rates(n=128, stream_elements=1 << 14, repeats=2)
    for f in ("dot_ynn_flops", "dot_plain_flops", "dot_plain_small_flops", "stream_bytes", "reduce_bytes",
              "transpose_bytes", "transpose_far_bytes", "vector_flops"):
        v = getattr(rates, f)
        assert v > 0 and math.isfinite(v), f
    assert rates.transcendental_s >= 0 and "GFLOP/s" in rates.source
    # The model divides each class's work by that class's rate: same bytes, time ratio = rate ratio.
    near, = _entry_kernels(lambda x: x.T * 1.5, (256, 16))
    t = cpu_kernel_time_us(near, rates) - rates.overhead_us
    assert t == pytest.approx(1e6 * (2 * 256 * 16 * 4) / rates.transpose_bytes, rel=1e-9)


def test_plain_dot_rate_lies_between_its_two_probes():
    from bench.cpu_validation import CpuRates, cpu_kernel_time_us
    from concerto_jax.costmodel.compute import ArrayInfo, OpInfo

    rates = CpuRates(100e9, 80e9, 20e9, 20e9, 5e9, 50e9, 0.0, dot_plain_small_flops=20e9, overhead_us=0.0)

    def dot(m, n, k):
        return OpInfo("d", "dot", (ArrayInfo("f32", (m, n)),), ((ArrayInfo("f32", (k, m)),), (ArrayInfo("f32", (n, k)),)),
                      {"lhs_contracting_dims": "{0}", "rhs_contracting_dims": "{1}"})

    def rate(m, n, k):
        return 2.0 * m * n * k / (cpu_kernel_time_us(dot(m, n, k), rates) * 1e-6)

    assert rate(64, 64, 2048) == pytest.approx(20e9)
    assert rate(512, 512, 512) == pytest.approx(80e9)
    assert rate(8, 8, 1 << 16) == pytest.approx(20e9)  # clamped below the small probe's output size
    assert 20e9 < rate(128, 128, 2048) < rate(256, 256, 2048) < 80e9
