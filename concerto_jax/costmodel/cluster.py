"""Target clusters: GPUs, hosts and links, as frozen dataclasses.

Device ``d`` of a cluster lives on host ``d // gpus_per_host`` (devices 0-7 on
host 0, 8-15 on host 1 for the 2 x 8 clusters), which is how XLA numbers the
devices of a ``"1xHxG"`` deviceless topology.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from importlib import resources

from concerto_jax.costmodel import specs


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A target GPU cluster.

    Attributes:
      name: registry key, e.g. ``h100_sxm_8``.
      gpu: datasheet spec of one GPU (the target config refines it, see ``gpu_spec``).
      num_hosts: hosts.
      gpus_per_host: GPUs per host.
      intra_link: link between GPUs of one host (NVLink or PCIe).
      inter_link: network between hosts (None for one host).
      target_config: file name under ``concerto_jax/gpu_configs/`` (XLA GpuTargetConfigProto).
      topology_name: name given to ``jax.experimental.topologies.get_topology_desc``.
      description: one line for reports.
    """

    name: str
    gpu: specs.GpuSpec
    num_hosts: int
    gpus_per_host: int
    intra_link: specs.LinkSpec
    inter_link: specs.LinkSpec | None
    target_config: str
    topology_name: str
    description: str = ""

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.gpus_per_host

    @property
    def topology(self) -> str:
        """The ``"slices x hosts x devices"`` string XLA's deviceless topology takes."""
        return f"1x{self.num_hosts}x{self.gpus_per_host}"

    def host_of(self, device: int) -> int:
        """Host index of global device id ``device``."""
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} not in cluster {self.name!r} of {self.num_devices} devices")
        return device // self.gpus_per_host

    def hosts_of(self, group: Sequence[int]) -> set[int]:
        """Hosts spanned by a replica group."""
        return {self.host_of(d) for d in group}

    def target_config_text(self) -> str:
        """The shipped target config text (XLA ``GpuTargetConfigProto``)."""
        return _read_gpu_config(self.target_config)

    @functools.cached_property
    def gpu_spec(self) -> specs.GpuSpec:
        """GPU figures from the target config where present, the datasheet otherwise."""
        return specs.gpu_spec_from_target_config(self.target_config_text(), fallback=self.gpu)


@functools.cache
def _read_gpu_config(file_name: str) -> str:
    return resources.files("concerto_jax").joinpath("gpu_configs", file_name).read_text()


_NDR_400 = "NVIDIA ConnectX-7 datasheet: NDR InfiniBand 400 Gb/s per port, one port per GPU (DGX H100)"
_H100_NVL = "H100 SXM NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction (H100 datasheet)"
_A100_NVL = "A100 SXM NVLink 3: 600 GB/s bidirectional per GPU = 300 GB/s per direction (A100 datasheet)"
_H100_NVLS = 480 / 370
"""NVLS over ring all-reduce bus bandwidth on 8x H100 SXM (NVSwitch with multicast): nccl-tests
measurements of about 480 GB/s with NVLS against 360-370 GB/s with the ring (NVIDIA/nccl-tests
issues 212 and 309, NVIDIA/nccl issue 2140). HGX 4-GPU boards have no NVSwitch, A100 no NVLS."""
_PCIE5 = "PCIe Gen5 x16: 64 GB/s per direction (H100 PCIe datasheet: 128 GB/s bidirectional); no NVLink bridge"

CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster("h100_sxm_8", specs.H100_SXM, 1, 8, specs.nvlink(450e9, _H100_NVL, _H100_NVLS), None,
                "h100_sxm.txtpb", "h100x8", "8x H100 SXM, NVLink 4, one host"),
        Cluster("h100_sxm_2x8", specs.H100_SXM, 2, 8, specs.nvlink(450e9, _H100_NVL, _H100_NVLS),
                specs.network(400.0, _NDR_400), "h100_sxm.txtpb", "h100x16",
                "2 hosts x 8 H100 SXM, NVLink in a host, 400 Gb/s NDR IB per GPU between hosts"),
        Cluster("h100_sxm_2x4", specs.H100_SXM, 2, 4, specs.nvlink(450e9, _H100_NVL),
                specs.network(400.0, _NDR_400), "h100_sxm.txtpb", "h100x8_2hosts",
                "2 hosts x 4 H100 SXM (HGX 4-GPU boards), NVLink in a host, 400 Gb/s NDR IB per GPU "
                "between hosts (8 devices: the size of the CPU-emulated test meshes)"),
        Cluster("h200_sxm_8", specs.H200_SXM, 1, 8, specs.nvlink(450e9, _H100_NVL, _H100_NVLS), None,
                "h200.txtpb", "h200x8", "8x H200 SXM, NVLink 4, one host (kernel rates measured: "
                "costmodel.calibration)"),
        Cluster("h100_pcie_8", specs.H100_PCIE, 1, 8, specs.pcie(64e9, _PCIE5), None,
                "h100_pcie.txtpb", "h100pcie_x8", "8x H100 PCIe, no NVLink (PCIe Gen5)"),
        Cluster("a100_80_8", specs.A100_SXM_80, 1, 8, specs.nvlink(300e9, _A100_NVL), None,
                "a100_sxm_80.txtpb", "a100x8", "8x A100 SXM 80GB, NVLink 3, one host"),
        Cluster("a800_4x8", specs.A800_SXM_80, 4, 8,
                specs.nvlink(200e9, "A800 NVLink 400 GB/s bidirectional = 200/dir (A800 product brief)"),
                specs.network(800.0, "Concerto paper (ASPLOS'25) cluster: 800 Gb/s between nodes"),
                "a100_sxm_80.txtpb", "a800x32", "4 hosts x 8 A800 (the paper's cluster; A100 target config)"),
    )
}
"""Registry of target clusters by name."""


def get_cluster(name: str) -> Cluster:
    """The registered cluster ``name``; raises ``ValueError`` listing the known names."""
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; known: {sorted(CLUSTERS)}") from None
