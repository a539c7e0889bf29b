"""bench.sensitivity's judges: each variant changes what it says it changes."""

import os

from bench.sensitivity import judge_both, variants
from concerto_jax.costmodel import get_cluster
from concerto_jax.costmodel.envelope import ADVERSE, CALIBRATED_H200, ENVELOPE
from concerto_jax.judge import judge_module

_FINAL = os.path.join(os.path.dirname(__file__), "data", "hlo", "gpu_transformer_block.final.hlo")


def test_every_variant_judges_a_module_against_itself_as_equal():
    text = open(_FINAL).read()
    gains = judge_both(text, text, "h100_sxm_8")
    assert list(gains) == list(variants()) and set(gains.values()) == {1.0}
    # the library's set is the one source: the plausible models, the adverse corner, the H200's
    # measured rates
    assert list(variants()) == [v.name for v in (*ENVELOPE, ADVERSE, CALIBRATED_H200)]


def test_variants_move_the_figures_they_name():
    text = open(_FINAL).read()
    cluster = get_cluster("h100_sxm_8")
    judged = {k: judge_module(text, v.cost_model(cluster)) for k, v in variants().items()}
    nominal = judged["nominal"]
    assert nominal.comm_us > 0 and nominal.compute_us > 0
    # slower links: more communication time, compute unchanged; faster: less
    assert judged["link_0.6"].comm_us > nominal.comm_us > judged["link_1.0"].comm_us
    assert judged["link_0.6"].compute_us == nominal.compute_us
    # launch overhead and tensor-core efficiency move compute only (this block's small GEMMs
    # are bound by memory, not by the tensor cores: the efficiency cannot speed them up)
    assert judged["launch_4us"].compute_us > nominal.compute_us
    assert judged["gemm_0.6"].compute_us >= nominal.compute_us >= judged["gemm_0.9"].compute_us
    # no overlap slowdown: never slower; a bigger one: never faster
    assert judged["slowdown_1.0"].us <= nominal.us <= judged["slowdown_1.3"].us
    assert judged["launch_4us"].comm_us == nominal.comm_us
