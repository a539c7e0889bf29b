"""Hardware specs from target configs and the alpha-beta collective model."""

import pytest

from concerto_jax.costmodel import (
    CLUSTERS,
    CollectiveOptions,
    bus_factor,
    collective_cost,
    get_cluster,
)


def test_specs_from_target_config_match_datasheets():
    h100 = get_cluster("h100_sxm_8").gpu_spec
    assert h100.matmul_flops_per_s("bf16") == pytest.approx(989e12, rel=0.01)
    assert h100.vector_flops_per_s("f32") == pytest.approx(67e12, rel=0.01)
    assert h100.hbm_bytes_per_s == pytest.approx(3.35e12, rel=0.01)
    assert h100.nvlink_bytes_per_s == pytest.approx(450e9)
    pcie = get_cluster("h100_pcie_8").gpu_spec
    assert pcie.matmul_flops_per_s("bf16") == pytest.approx(756e12, rel=0.01)
    assert pcie.nvlink_bytes_per_s == 0
    a100 = get_cluster("a100_80_8").gpu_spec
    assert a100.matmul_flops_per_s("bf16") == pytest.approx(312e12, rel=0.01)
    assert a100.vector_flops_per_s("f32") == pytest.approx(19.5e12, rel=0.01)
    for c in CLUSTERS.values():
        assert c.gpu_spec.sources and c.intra_link.source


def test_bus_factors():
    assert bus_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all-gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce-scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("all-to-all", 2) == pytest.approx(1 / 2)
    assert bus_factor("collective-permute", 2) == 1
    with pytest.raises(ValueError):
        bus_factor("all-sum", 2)


def test_ring_all_reduce_is_alpha_beta():
    c = get_cluster("h100_sxm_8")
    opts = CollectiveOptions(algorithm="ring", protocols=("Simple",), link_efficiency=1.0)
    nbytes = 450e6
    cost = collective_cost("all-reduce", nbytes, range(8), c, opts)
    # base 8.4 + 14 steps * 3.4 us + 2*7/8 * 450e6 B / 450e9 B/s = 1750 us.
    assert cost.time_us == pytest.approx(8.4 + 14 * 3.4 + 1750.0)


def test_nvls_all_reduce_where_the_switch_reduces():
    h100 = get_cluster("h100_sxm_8")
    big = 16 << 20
    nvls = collective_cost("all-reduce", big, range(8), h100)
    # 25 us + 2*7/8 * 16 MiB / (450 GB/s * 0.8 * 480/370): NCCL's NVLS price (tuning.cc v2.27.7)
    assert nvls.algorithm == "nvls" and nvls.protocol == "Simple"
    assert nvls.time_us == pytest.approx(25.0 + 1e6 * 1.75 * big / (450e9 * 0.8 * 480 / 370))
    ring = collective_cost("all-reduce", big, range(8), h100, CollectiveOptions(nvls=False))
    assert ring.algorithm in ("ring", "tree") and ring.time_us > 1.3 * nvls.time_us
    # small messages stay on the ring's LL protocol: NVLS's 25 us latency loses there
    assert collective_cost("all-reduce", 64 << 10, range(8), h100).algorithm == "ring"
    # no NVLS: without an NVSwitch that reduces (A100, PCIe, HGX 4-GPU boards), across hosts,
    # for other collectives, or where the algorithm is forced
    for name, group in (("a100_80_8", range(8)), ("h100_pcie_8", range(8)), ("h100_sxm_2x4", range(4)),
                        ("h100_sxm_2x8", [0, 8])):
        assert collective_cost("all-reduce", big, group, get_cluster(name)).algorithm != "nvls", name
    assert collective_cost("all-gather", big, range(8), h100).algorithm == "ring"
    assert collective_cost("all-reduce", big, range(8), h100, CollectiveOptions(algorithm="ring")).algorithm == "ring"


def test_latency_dominates_small_messages_and_bandwidth_large():
    c = get_cluster("h100_sxm_8")
    small = collective_cost("all-reduce", 1024, range(8), c)
    large = collective_cost("all-reduce", 1 << 30, range(8), c)
    assert small.protocol == "LL" and small.time_us < 20
    assert large.protocol == "Simple" and large.time_us > 1e3


def test_placement_network_vs_nvlink():
    c = get_cluster("h100_sxm_2x8")
    in_host = collective_cost("all-reduce", 64e6, [0, 1], c).time_us
    across = collective_cost("all-reduce", 64e6, [0, 8], c).time_us
    assert across > 5 * in_host  # one 50 GB/s NIC vs 450 GB/s NVLink
    nvl = collective_cost("all-gather", 64e6, range(8), get_cluster("h100_sxm_8")).time_us
    pcie = collective_cost("all-gather", 64e6, range(8), get_cluster("h100_pcie_8")).time_us
    assert pcie > 5 * nvl


def test_single_device_group_is_free():
    assert collective_cost("all-reduce", 1e6, [3], get_cluster("h100_sxm_8")).time_us == 0


def test_all_reduce_kernel_strategy_and_cost():
    """XLA:GPU's Triton all-reduce kernel (jaxlib >= 0.11): one-shot while it reads at most
    2 MiB (every rank reads all peers' buffers), two-shot above (a reduce-scatter and an
    all-gather through symmetric memory); across hosts there is no kernel (NCCL)."""
    from concerto_jax.costmodel.collectives import (
        all_reduce_kernel_cost,
        all_reduce_kernel_strategy,
    )

    c = get_cluster("h100_sxm_8")
    assert all_reduce_kernel_strategy(256 << 10, 8) == "one_shot"
    assert all_reduce_kernel_strategy((256 << 10) + 1, 8) == "two_shot"
    bw = 450e9 * CollectiveOptions().link_efficiency
    hop = c.intra_link.hop_us("ring")[0]
    one = all_reduce_kernel_cost(256 << 10, range(8), c, launch_us=2.0)
    assert one.protocol == "one_shot" and one.time_us == pytest.approx(2.0 + hop + 1e6 * 7 * (256 << 10) / bw)
    two = all_reduce_kernel_cost(1 << 20, range(8), c, launch_us=2.0)
    assert two.protocol == "two_shot"
    assert two.time_us == pytest.approx(2.0 + 2 * hop + 1e6 * 2 * 7 / 8 * (1 << 20) / bw)
    # XLA's recorded strategy wins over the rule
    assert all_reduce_kernel_cost(1 << 20, range(8), c, "one_shot").protocol == "one_shot"
    # cheaper than NCCL's ring/tree for the sizes XLA gives it (fewer latency steps)
    for nbytes in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        assert all_reduce_kernel_cost(nbytes, range(8), c, launch_us=2.0).time_us < \
            collective_cost("all-reduce", nbytes, range(8), c).time_us
    two_hosts = get_cluster("h100_sxm_2x8")
    assert all_reduce_kernel_cost(1 << 20, range(16), two_hosts) == \
        collective_cost("all-reduce", 1 << 20, range(16), two_hosts)
    with pytest.raises(ValueError, match="strategy"):
        all_reduce_kernel_cost(1 << 20, range(8), c, "three_shot")
