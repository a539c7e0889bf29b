"""Hardware figures of a target GPU cluster, each named with its source.

A ``GpuSpec`` holds the peak rates of one GPU and a ``LinkSpec`` one kind of
link (NVLink, PCIe, the network between hosts). Where the shipped XLA target
config (``concerto_jax/gpu_configs/*.txtpb``, a ``GpuTargetConfigProto``) carries a
figure -- SM count, clocks, memory bandwidth, tensor-core rates per dtype,
NVLink link count -- ``gpu_spec_from_target_config`` takes it from there and
the datasheet value is kept only as a cross-check in ``sources``.

References:
  NVIDIA H100 Tensor Core GPU datasheet (2023); NVIDIA H100 Tensor Core GPU
  Architecture whitepaper (NVLink 4: 18 links x 50 GB/s bidirectional);
  NVIDIA A100 Tensor Core GPU datasheet (2021); NVIDIA A800 product brief;
  NVIDIA ConnectX-7 datasheet (NDR 400 Gb/s InfiniBand);
  NCCL ``src/graph/tuning.cc`` (per-hop and base latencies per protocol).
"""

from __future__ import annotations

import dataclasses
import re

# XLA PrimitiveType numbers used as keys of ``rate_infos`` in the target config
# (xla/xla_data.proto).
_PRIMITIVE_TYPE = {"s8": 2, "u8": 6, "f16": 10, "f32": 11, "f64": 12, "bf16": 16,
                   "f8e5m2": 19, "f8e4m3fn": 20}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Peak rates of one GPU.

    Attributes:
      name: marketing name.
      matmul_tflops: dense tensor-core TFLOP/s per HLO element type (an FMA
        counts 2 FLOPs); ``f32`` is the TF32 tensor-core rate that XLA uses for
        f32 dots at default precision.
      vector_tflops: non-tensor (CUDA core) TFLOP/s per element type, used for
        f32 dots at HIGHEST precision and for elementwise arithmetic.
      hbm_bytes_per_s: device memory bandwidth.
      memory_bytes: device memory size.
      sm_count: streaming multiprocessors.
      nvlink_bytes_per_s: NVLink bandwidth per direction per GPU (0: none).
      pcie_bytes_per_s: host-interface bandwidth per direction.
      sources: where each figure comes from, one line per figure.
    """

    name: str
    matmul_tflops: tuple[tuple[str, float], ...]
    vector_tflops: tuple[tuple[str, float], ...]
    hbm_bytes_per_s: float
    memory_bytes: int
    sm_count: int
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    sources: tuple[str, ...] = ()

    def matmul_flops_per_s(self, dtype: str) -> float:
        """Tensor-core FLOP/s for a dot whose operands are ``dtype`` (fallback: bf16 rate)."""
        table = dict(self.matmul_tflops)
        return 1e12 * table.get(dtype, table.get("bf16", 0.0))

    def vector_flops_per_s(self, dtype: str) -> float:
        """CUDA-core FLOP/s for elementwise arithmetic on ``dtype`` (fallback: f32 rate)."""
        table = dict(self.vector_tflops)
        return 1e12 * table.get(dtype, table.get("f32", 0.0))


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One kind of link between GPUs, as the collective model sees it.

    Attributes:
      name: ``nvlink``, ``pcie`` or ``net``.
      bytes_per_s: bandwidth per GPU per direction.
      hop_latency_us: NCCL ``hwLat`` per step, per protocol (LL, LL128, Simple)
        and algorithm (``ring``, ``tree``).
      source: where the bandwidth figure comes from.
      nvls_bus_ratio: NVLink SHARP (NCCL's NVLS algorithm) all-reduce bus bandwidth over the
        ring's, where the host's NVSwitch does the reduction (multicast); None: no NVLS.
    """

    name: str
    bytes_per_s: float
    hop_latency_us: tuple[tuple[str, tuple[float, float, float]], ...]
    source: str = ""
    nvls_bus_ratio: float | None = None

    def hop_us(self, algorithm: str) -> tuple[float, float, float]:
        """Per-step latency (LL, LL128, Simple) of ``algorithm`` on this link."""
        return dict(self.hop_latency_us)[algorithm]


# NCCL src/graph/tuning.cc, v2.27.7 (the NCCL jax 0.12's CUDA wheels require):
# hwLat[NVLINK|PCI|NET][Tree|Ring][LL,LL128,Simple].
_NCCL_HWLAT = {
    "nvlink": (("tree", (0.6, 1.25, 4.0)), ("ring", (0.6, 1.9, 3.4))),
    "pcie": (("tree", (1.0, 1.9, 4.0)), ("ring", (1.0, 2.5, 5.7))),
    "net": (("tree", (5.0, 8.5, 14.0)), ("ring", (2.7, 4.0, 14.0))),
}
NCCL_BASE_LATENCY_US = (("tree", (6.8, 14.0, 8.4)), ("ring", (6.6, 14.0, 8.4)))
"""NCCL ``baseLat`` per algorithm and protocol (LL, LL128, Simple), tuning.cc v2.27.7."""
NCCL_NVLS_LATENCY_US = 25.0
"""NCCL ``hwLat[NVLINK][NVLS][Simple]`` (tuning.cc v2.27.7; NVLS has no base latency)."""
NCCL_PROTOCOL_BW_FRACTION = (0.5, 120.0 / 128.0, 1.0)
"""Payload fraction of a line per protocol: LL 4 of 8 bytes, LL128 120 of 128, Simple all."""


def nvlink(bytes_per_s: float, source: str, nvls_bus_ratio: float | None = None) -> LinkSpec:
    """An NVLink link with NCCL's NVLink latencies (``nvls_bus_ratio``: see ``LinkSpec``)."""
    return LinkSpec("nvlink", bytes_per_s, _NCCL_HWLAT["nvlink"], source, nvls_bus_ratio)


def pcie(bytes_per_s: float, source: str) -> LinkSpec:
    """A PCIe path between GPUs of one host with NCCL's PCI latencies."""
    return LinkSpec("pcie", bytes_per_s, _NCCL_HWLAT["pcie"], source)


def network(gbit_per_s: float, source: str) -> LinkSpec:
    """The network between hosts, ``gbit_per_s`` per GPU, with NCCL's NET latencies."""
    return LinkSpec("net", gbit_per_s * 1e9 / 8, _NCCL_HWLAT["net"], source)


def _parse_txtpb(text: str) -> dict:
    """Parse protobuf text format into nested dicts (repeated fields become lists)."""
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|[{}]|[^\s{}:]+:|[^\s{}]+', re.sub(r"#[^\n]*", "", text))
    pos = 0

    def block() -> dict:
        nonlocal pos
        out: dict = {}
        while pos < len(tokens) and tokens[pos] != "}":
            key = tokens[pos].rstrip(":")
            pos += 1
            if tokens[pos] == "{":
                pos += 1
                value = block()
                pos += 1  # '}'
            else:
                raw = tokens[pos]
                pos += 1
                value = raw.strip('"') if raw.startswith('"') else _number(raw)
            out.setdefault(key, []).append(value)
        return out

    return block()


def _number(raw: str):
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            return raw


def _rates(unit: dict, cores: int) -> dict[str, float]:
    """TFLOP/s per dtype from a ``rate_infos`` map (FMA = 2 FLOPs)."""
    by_key = {v: k for k, v in _PRIMITIVE_TYPE.items()}
    out = {}
    for entry in unit.get("rate_infos", []):
        dtype = by_key.get(entry["key"][0])
        if dtype is None:
            continue
        v = entry["value"][0]
        out[dtype] = cores * v["units_per_core"][0] * v["ops_per_clock"][0] * v["clock_rate_ghz"][0] * 2e9 / 1e12
    return out


NVLINK4_PER_LINK_BYTES_PER_S = 25e9
"""NVLink 4 (H100): 50 GB/s bidirectional = 25 GB/s per direction per link (H100 architecture whitepaper)."""


def gpu_spec_from_target_config(text: str, *, fallback: GpuSpec) -> GpuSpec:
    """A ``GpuSpec`` whose figures come from an XLA ``GpuTargetConfigProto`` where present.

    Args:
      text: the ``.txtpb`` text.
      fallback: the datasheet spec, used for figures the config lacks (NVLink
        bandwidth when no ``device_interconnect_info``, PCIe when absent).

    Returns:
      A spec with SM count, memory bandwidth and size, tensor-core and CUDA-core
      rates computed from the config, and ``sources`` saying which is which.
    """
    info = _parse_txtpb(text)["gpu_device_info"][0]
    cores = info["core_count"][0]
    matrix = _rates(info.get("matrix_unit_description", [{}])[0], cores)
    vector = _rates(info.get("scalar_unit_description", [{}])[0], cores)
    fb_matrix, fb_vector = dict(fallback.matmul_tflops), dict(fallback.vector_tflops)
    # Dots in f32 at default precision run on TF32 tensor cores (same rate as the f32 matrix entry).
    merged_matrix = {**fb_matrix, **{k: v for k, v in matrix.items() if k in fb_matrix}}
    merged_vector = {**fb_vector, **{k: v for k, v in vector.items() if k in fb_vector}}
    links = info.get("device_interconnect_info", [{}])[0].get("active_links", [0])[0]
    nvl = links * NVLINK4_PER_LINK_BYTES_PER_S if links and fallback.nvlink_bytes_per_s else fallback.nvlink_bytes_per_s
    pcie_bw = float(info.get("pcie_bandwidth", [0])[0]) or fallback.pcie_bytes_per_s
    sources = (
        f"sm_count={cores}, clocks, tensor/CUDA-core rates per dtype: target config rate_infos "
        f"(cores x units_per_core x ops_per_clock x clock x 2); "
        f"matmul TFLOP/s {', '.join(f'{k}={v:.0f}' for k, v in sorted(merged_matrix.items()))}",
        f"hbm {info['memory_bandwidth'][0] / 1e12:.2f} TB/s: target config memory_bandwidth",
        (f"nvlink {nvl / 1e9:.0f} GB/s/dir: target config active_links={links} x 25 GB/s (NVLink 4)"
         if links and fallback.nvlink_bytes_per_s else f"nvlink {nvl / 1e9:.0f} GB/s/dir: datasheet"),
        f"pcie {pcie_bw / 1e9:.1f} GB/s/dir: " + ("target config pcie_bandwidth" if "pcie_bandwidth" in info else "datasheet"),
        *fallback.sources,
    )
    return dataclasses.replace(
        fallback,
        matmul_tflops=tuple(sorted(merged_matrix.items())),
        vector_tflops=tuple(sorted(merged_vector.items())),
        hbm_bytes_per_s=float(info["memory_bandwidth"][0]),
        memory_bytes=int(info["device_memory_size"][0]),
        sm_count=cores,
        nvlink_bytes_per_s=nvl,
        pcie_bytes_per_s=pcie_bw,
        sources=sources,
    )


# Datasheet specs (dense, no sparsity). Each is the fallback/cross-check of the target config.
H100_SXM = GpuSpec(
    name="NVIDIA H100 SXM5 80GB",
    matmul_tflops=(("bf16", 989.0), ("f16", 989.0), ("f32", 494.0), ("f8e4m3fn", 1979.0), ("f8e5m2", 1979.0)),
    vector_tflops=(("f32", 67.0), ("f64", 34.0), ("bf16", 134.0), ("f16", 134.0)),
    hbm_bytes_per_s=3.35e12, memory_bytes=80 * 2**30, sm_count=132,
    nvlink_bytes_per_s=450e9, pcie_bytes_per_s=64e9,
    sources=("datasheet: NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 989 TFLOP/s dense, TF32 494, "
             "FP32 67, HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional (450/dir), PCIe Gen5 128 GB/s bidir",),
)
H200_SXM = dataclasses.replace(
    H100_SXM, name="NVIDIA H200 SXM 141GB", hbm_bytes_per_s=4.8e12, memory_bytes=141 * 10**9,
    sources=("datasheet: NVIDIA H200 Tensor Core GPU datasheet, SXM: as H100 SXM (BF16 989 TFLOP/s dense, "
             "TF32 494, FP32 67, NVLink 900 GB/s bidirectional) but HBM3e 141 GB at 4.8 TB/s",),
)
H100_PCIE = GpuSpec(
    name="NVIDIA H100 PCIe 80GB",
    matmul_tflops=(("bf16", 756.0), ("f16", 756.0), ("f32", 378.0), ("f8e4m3fn", 1513.0), ("f8e5m2", 1513.0)),
    vector_tflops=(("f32", 51.0), ("f64", 26.0), ("bf16", 102.0), ("f16", 102.0)),
    hbm_bytes_per_s=2.0e12, memory_bytes=80 * 2**30, sm_count=114,
    nvlink_bytes_per_s=0.0, pcie_bytes_per_s=64e9,
    sources=("datasheet: NVIDIA H100 Tensor Core GPU datasheet, PCIe: BF16 756 TFLOP/s dense, TF32 378, "
             "FP32 51, HBM2e 2.0 TB/s, no NVLink bridge assumed -> PCIe Gen5 x16 64 GB/s per direction",),
)
A100_SXM_80 = GpuSpec(
    name="NVIDIA A100 SXM4 80GB",
    matmul_tflops=(("bf16", 312.0), ("f16", 312.0), ("f32", 156.0)),
    vector_tflops=(("f32", 19.5), ("f64", 9.7), ("bf16", 39.0), ("f16", 78.0)),
    hbm_bytes_per_s=2.039e12, memory_bytes=80 * 2**30, sm_count=108,
    nvlink_bytes_per_s=300e9, pcie_bytes_per_s=32e9,
    sources=("datasheet: NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB: BF16 312 TFLOP/s, TF32 156, "
             "FP32 19.5, HBM2e 2,039 GB/s, NVLink 3 600 GB/s bidirectional (300/dir), PCIe Gen4 64 GB/s bidir",),
)
A800_SXM_80 = dataclasses.replace(
    A100_SXM_80, name="NVIDIA A800 SXM4 80GB", nvlink_bytes_per_s=200e9,
    sources=("datasheet: NVIDIA A800 40GB/80GB product brief: as A100 but NVLink 400 GB/s bidirectional "
             "(200/dir); the Concerto paper's cluster",),
)
