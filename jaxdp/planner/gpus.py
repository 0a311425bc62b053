"""GPU presets for the planner: memory, HBM bandwidth, dense bf16 FLOP/s and the GPU-to-GPU link.

Figures are vendors' datasheet values for the SXM / HGX parts (dense, i.e. without 2:4 sparsity); the
link is the unidirectional bandwidth one GPU has to its peers (NVLink 4: 450 GB/s, NVLink 5: 900 GB/s;
the L4 has no NVLink and talks over PCIe 4.0 x16, ~32 GB/s). Memory is what a framework sees (GiB):
the article reports 269 GiB for a B300, which is what is used here; the others are the nominal sizes.
A custom GPU: "name:mem_gib:hbm_tbs:bf16_tflops[:link_gbs]", e.g. "mygpu:96:4.0:700:450".
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


class GPUError(ValueError):
    """A GPU name or spec the planner cannot use; the message says what to write instead."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # device memory a framework sees
    hbm_tbs: float  # HBM bandwidth, TB/s (10^12 bytes per second)
    bf16_tflops: float  # dense bf16 tensor-core FLOP/s, in 10^12
    link_gbs: float  # GPU-to-GPU bandwidth per direction, GB/s (10^9 bytes per second)
    source: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbs * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbs * 1e9


PRESETS: dict[str, GPU] = {
    "H100": GPU("H100", 80, 3.35, 989, 450, "H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s "
                "bf16 dense, NVLink 4 900 GB/s bidirectional"),
    "H200": GPU("H200", 141, 4.8, 989, 450, "H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, same tensor "
                "cores as H100, NVLink 4"),
    "B200": GPU("B200", 180, 8.0, 2250, 900, "HGX B200: ~180 GB HBM3e per GPU, 8 TB/s, 2.25 PFLOP/s bf16 "
                "dense, NVLink 5 1.8 TB/s bidirectional"),
    "B300": GPU("B300", 269, 8.0, 2250, 900, "HGX B300 (Blackwell Ultra): 288 GB HBM3e of which the "
                "article's servers report 269 GiB, 8 TB/s, bf16 dense assumed equal to B200, NVLink 5"),
    "L4": GPU("L4", 24, 0.3, 121, 32, "L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s bf16 dense; "
              "no NVLink, PCIe 4.0 x16"),
}


def get_gpu(spec: str) -> GPU:
    """A preset name (case-insensitive) or "name:mem_gib:hbm_tbs:bf16_tflops[:link_gbs]"."""
    text = spec.strip()
    preset = PRESETS.get(text.upper())
    if preset is not None:
        return preset
    parts = text.split(":")
    if len(parts) not in (4, 5) or not parts[0]:
        raise GPUError(f"unknown GPU {spec!r}; use one of {', '.join(PRESETS)} or "
                       "name:mem_gib:hbm_tbs:bf16_tflops[:link_gbs], e.g. mygpu:96:4.0:700:450.")
    try:
        numbers = [float(p) for p in parts[1:]]
    except ValueError:
        raise GPUError(f"GPU spec {spec!r} has a field that is not a number; write e.g. "
                       "mygpu:96:4.0:700:450.") from None
    if any(n <= 0 for n in numbers):
        raise GPUError(f"GPU spec {spec!r} has a field that is not positive; every figure must be > 0.")
    link = numbers[3] if len(numbers) == 4 else 450.0
    note = "custom" if len(numbers) == 4 else "custom, link 450 GB/s assumed"
    return GPU(parts[0], numbers[0], numbers[1], numbers[2], link, note)


def with_overrides(gpu: GPU, memory_gib: float | None = None, hbm_tbs: float | None = None,
                   bf16_tflops: float | None = None, link_gbs: float | None = None) -> GPU:
    """The preset with any figure replaced (flags such as --gpu-memory, --hbm-tbs)."""
    changes = {k: v for k, v in dict(memory_gib=memory_gib, hbm_tbs=hbm_tbs, bf16_tflops=bf16_tflops,
                                     link_gbs=link_gbs).items() if v is not None}
    for k, v in changes.items():
        if v <= 0:
            raise GPUError(f"{k}={v} must be positive.")
    if not changes:
        return gpu
    return dataclasses.replace(gpu, source=gpu.source + f"; overridden: {changes}", **changes)


_UNITS = {"": GiB, "gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}


def parse_memory(text: str) -> float:
    """'269GiB', '80GB', '141', '96 GiB' -> GiB (a bare number is GiB)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abgimt")
    unit = t[len(num):]
    if unit not in _UNITS:
        raise GPUError(f"memory {text!r} has an unknown unit; write e.g. 269GiB or 80GB.")
    try:
        value = float(num)
    except ValueError:
        raise GPUError(f"memory {text!r} is not a number with a unit; write e.g. 269GiB.") from None
    if value <= 0:
        raise GPUError(f"memory {text!r} must be positive.")
    return value * _UNITS[unit] / GiB
