"""The planner's hardware constants, each with its source, in one place.

A GPU is its dense matmul peak (bf16/fp16, no sparsity), the NVLink bandwidth per GPU in one
direction inside a node, and the network bandwidth per GPU between nodes (one NIC per GPU). A
ring collective whose group has k members in a node uses those k NICs (`ring_bandwidth`: DP and
ZeRO's collectives); point-to-point sends and all-to-alls go through each GPU's own NIC. The
step-time model (pricing.py) assumes every matmul runs at `ACHIEVED_EFFICIENCY` of the peak,
whatever its shape: one number for every GPU, model size and micro-batch, which is the model's
main simplification (the bf16 runs it is checked against reach from a third to 58% of their
peak end to end, `python -m parallel3d.planner --published`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.memory_model import GB

# Fraction of the matmul peak the kernels achieve. Megatron-LM's A100 runs (2021) and its H100
# runs (2024) reach 41-52% of the peak end to end, bubbles and communication included; half for
# the matmuls alone is the round number this model was built with, not fitted to them (the
# published-run test fails outside 0.48-0.54).
ACHIEVED_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0      # H100 SXM bf16 dense
    efficiency: float = ACHIEVED_EFFICIENCY  # achievable fraction of peak in the matmuls
    nvlink_gbps: float = 450.0      # per GPU, one direction, inside a node
    network_gbps: float = 50.0      # per GPU between nodes (400 Gb/s NIC per GPU)
    latency_us: float = 5.0         # α of one network hop
    gpus_per_node: int = 8
    pod_gpus: int = 3072            # GPUs under one aggregation layer (Llama 3's cluster) ...
    oversubscription: float = 7.0   # ... and the bandwidth division beyond it (1:7)

    def bandwidth(self, span: int, nics: int = 1) -> float:
        """Bytes/s per GPU of a collective whose ranks span `span` consecutive GPUs: NVLink
        inside a node; across nodes `nics` NICs per member's traffic (at most NVLink's rate),
        divided by the oversubscription beyond a pod."""
        if span <= self.gpus_per_node:
            return self.nvlink_gbps * GB
        fabric = 1.0 if span <= self.pod_gpus else self.oversubscription
        return min(self.nvlink_gbps, nics * self.network_gbps) * GB / fabric

    def ring_bandwidth(self, n: int, stride: int) -> float:
        """Bytes/s per GPU of a ring collective (all-reduce, all-gather, reduce-scatter) over n
        ranks `stride` GPUs apart (a DP group over dp·cp strides t: mesh order tp, cp, dp, pp). A node holds
        k = min(n, gpus_per_node / stride) of them, each with its own NIC, and NCCL runs a ring
        per NIC (channels), each carrying 1/k of the data through one NIC per node: k NICs'
        bandwidth per member, at t < 8 (8/t members per node) up to 8× one NIC's."""
        members = max(1, min(n, self.gpus_per_node // stride))
        return self.bandwidth(n * stride, members)


# A GPU and the cluster around it. The pod and oversubscription defaults are Llama 3's cluster
# (3,072 GPUs under an aggregation layer, 1:7 above it); NVIDIA's DGX SuperPODs (Selene, EOS) are
# non-blocking fat trees.
GPUS: dict[str, Hardware] = {
    # NVIDIA A100 SXM datasheet: 312 TFLOP/s bf16/fp16 dense, NVLink 600 GB/s (both directions);
    # DGX A100 (Megatron-LM's Selene): eight 200 Gb/s HDR InfiniBand NICs per 8 GPUs = 25 GB/s.
    "A100": Hardware(peak_tflops=312.0, nvlink_gbps=300.0, network_gbps=25.0, oversubscription=1.0),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, NVLink 900 GB/s; a 400 Gb/s NIC per GPU
    # (Llama 3's RoCE cluster, 400 Gb/s between GPUs, with its 1:7 aggregation layer).
    "H100": Hardware(),
    # The same GPU in a DGX H100 SuperPOD (Megatron-Core's runs on EOS): NDR 400 Gb/s per GPU,
    # non-blocking.
    "H100-superpod": Hardware(oversubscription=1.0),
    # torchtitan's Grand Teton H100s: 96 GB HBM2e at the default 500 W; its benchmark notes say
    # their peak lies between the H100 NVL's 835 and the SXM's 989 TFLOP/s, exact value unknown:
    # the lower bound it gives. 400 Gb/s per GPU between hosts.
    "H100-500W": Hardware(peak_tflops=835.0),
    # H800 SXM: the H100's compute (989 TFLOP/s bf16) with NVLink cut to 400 GB/s; DeepSeek-V3's
    # nodes have a 400 Gb/s InfiniBand NIC per GPU (its report: ~160 GB/s NVLink and ~50 GB/s IB
    # achieved).
    "H800": Hardware(nvlink_gbps=200.0, oversubscription=1.0),
}


def gpu(name: str, **overrides) -> Hardware:
    """A GPU of `GPUS`, with fields replaced (e.g. gpus_per_node)."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}")
    return replace(GPUS[name], **overrides)
