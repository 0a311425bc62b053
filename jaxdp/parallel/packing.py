"""A step's per-rank host arrays as one [dp, W] int32 array, unpacked inside the compiled step: one host-to-device
transfer a step instead of one per array (each `device_put` costs the host a fixed ~0.05-0.15 ms, and a step has
8 to 21 such arrays). Every input is 32 bits a value (bool stored as 0/1, float32 and uint32 bitcast)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxdp.batch import StepArray

Layout = tuple[tuple[str, tuple[int, ...], type, int], ...]  # (name, shape after the rank axis, dtype, first word)


def packed_layout(specs: tuple[StepArray, ...], sizes: Callable[[StepArray], dict[str, int]]) -> Layout:
    """Where each of `specs` lies in the packed array; `sizes(spec)`: the sizes of its shape letters."""
    out, at = [], 0
    for a in specs:
        dims = a.shape(1, sizes(a))[1:]
        out.append((a.name, dims, a.dtype, at))
        at += int(np.prod(dims))
    return tuple(out)


def width(layout: Layout) -> int:
    """Words a rank of the packed array holds."""
    _, dims, _, at = layout[-1]
    return at + int(np.prod(dims))


def pack(arrays: dict[str, np.ndarray], layout: Layout) -> np.ndarray:
    """The host arrays named in `layout` (each [dp, ...]) as one [dp, W] int32 array."""
    parts = []
    for name, _, dtype, _ in layout:
        a = arrays[name]
        a = a.astype(np.int32) if dtype == np.bool_ else np.ascontiguousarray(a, dtype).view(np.int32)
        parts.append(a.reshape(len(a), -1))
    return np.concatenate(parts, axis=1)


def unpack(packed_RW, layout: Layout) -> dict[str, jax.Array]:
    """The packed array back into the step's inputs, each [dp, ...] in its own dtype (on the device)."""
    dp, out = packed_RW.shape[0], {}
    for name, dims, dtype, at in layout:
        words = packed_RW[:, at: at + int(np.prod(dims))].reshape(dp, *dims)
        out[name] = words != 0 if dtype == np.bool_ else (
            words if dtype == np.int32 else jax.lax.bitcast_convert_type(words, dtype))
    return out
