"""Parameters a kernel reads where they lie in the layer stack.

The layer scan (`jaxdp.model.decoder._run_stack`) hands each layer its slice of every stacked parameter
`[layers, ...]`. A Pallas (Triton) kernel takes whole buffers, so XLA:GPU copies such a slice out of the
stack before the kernel reads it: a write and a second read of that layer's weights each step. For the
parameters a layer's kernels read, the scan hands instead the whole stack and the layer index, an `InStack`,
and the kernel indexes the layer itself.

Which parameters: those a module names in `params_read_in_place()` (a method of the module, which knows its
backend and its kernels: the MoE's under `--moe-runner-backend pallas`, `jaxdp.model.moe`) and the Linear
weights of the layers, read through `jaxdp.model.fp8.weight` (`jaxdp.model.fp8.in_place`: multiplied by the
projection GEMM of `jaxdp.ops.gemm`, by its backend). Read as `param[...]`, an `InStack`
(`jaxdp.ops.stacked`) is its layer, so every other reader is unchanged.
"""

from __future__ import annotations

from flax import nnx

from jaxdp.model.fp8 import in_place as fp8_in_place
from jaxdp.ops.stacked import InStack

__all__ = ["InStack", "params_read_in_place", "read_in_place"]  # (InStack: the ops' operand, `jaxdp.ops.stacked`)


def params_read_in_place(module: nnx.Module) -> set[str]:
    """Names of `module`'s own parameters that its kernels read from the whole layer stack."""
    names = set(fp8_in_place(module))
    declared = getattr(module, "params_read_in_place", None)
    if callable(declared):
        names |= set(declared())
    return names


def read_in_place(stack: nnx.Module):
    """An nnx filter `(path, variable) -> bool` for the state of a layer stack: the parameters whose owner
    module reads them in place."""
    cache: dict[tuple, set[str]] = {}

    def owner_names(path: tuple) -> set[str]:
        if path not in cache:
            owner = stack
            for part in path:
                owner = getattr(owner, part) if not isinstance(part, int) else owner[part]
            cache[path] = params_read_in_place(owner) if isinstance(owner, nnx.Module) else set()
        return cache[path]

    def pred(path, _value) -> bool:
        return bool(path) and path[-1] in owner_names(tuple(path[:-1]))

    return pred
