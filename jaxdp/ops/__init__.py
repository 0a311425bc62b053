"""The op layer: each hot operation of the model's step as one function with its backends (XLA, the reference;
the Pallas-Triton kernels of `kernels_pallas`; jaxdp's native CPU kernels), chosen in one place
(`jaxdp.ops.registry`: the table of ops, backends, platforms and defaults, and the flags that choose).

- `jaxdp.ops.gemm`: the projection GEMM (bf16 / block-FP8 Linear weights read in place) and the LM head;
- `jaxdp.ops.experts`: the grouped expert GEMM (bf16, block-FP8, NVFP4 experts), `jaxdp.ops.grouped` its blocked form;
- `jaxdp.ops.attention`: MLA's absorbed decode over the paged latent cache, dense and sparse;
- `jaxdp.ops.stacked`: the operands read where they lie in a layer stack; `jaxdp.ops.nvfp4`: the NVFP4 format;
- `jaxdp.ops.platform`: the platform's default dtype and the CPU allocator's setting.
The model (`jaxdp.model`) calls these and never imports `kernels_pallas` or `jaxdp.native` itself.
"""
