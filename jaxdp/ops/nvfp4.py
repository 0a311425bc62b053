"""The NVFP4 format the expert GEMM reads (NVIDIA ModelOpt's: E2M1 codes two per byte, an E4M3 scale per 16
values, an FP32 scale per matrix), as the model and the checkpoint readers take it. Its code lies beside its
kernel, in `kernels_pallas.nvfp4`; the model reaches it through the ops layer only."""

from kernels_pallas.nvfp4 import (
    BLOCK_K,
    dequantize_nvfp4,
    quantize_nvfp4,
    quantize_nvfp4_experts,
    quantize_nvfp4_experts_gate_up,
    quantize_nvfp4_gate_up,
)

__all__ = ["BLOCK_K", "dequantize_nvfp4", "quantize_nvfp4", "quantize_nvfp4_experts",
           "quantize_nvfp4_experts_gate_up", "quantize_nvfp4_gate_up"]
