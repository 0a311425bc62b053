"""One-byte operands of 2 to 4 GiB, handed to a kernel as 16-bit words: around Pallas' 32-bit offsets.

Pallas' Triton lowering (jax 0.10 and 0.11) indexes an operand of at most 2**32 bytes with 32-bit offsets,
counted in elements and added to its pointer as signed numbers. A one-byte operand (FP8 weights, NVFP4's packed
codes and block scales) of more than 2**31 elements gets negative offsets past its middle, and the kernel reads
outside its buffer: CUDA_ERROR_ILLEGAL_ADDRESS, seen on an H200 with GLM-5's NVFP4 gate_up stack of 256 experts
(3 GiB), and in reach of real layouts (DeepSeek-V3's FP8 w_q_b stack, 61 layers, is 2.3 GB on every device under
dp=8; its NVFP4 gate_up scales under dp=8 are 3.4 GB). Operands of more than 2**32 bytes get 64-bit offsets and
are fine, as are wider elements (at most 2**31 of them fit in 2**32 bytes).

Such an operand travels as uint16 pairs of its bytes along its last axis (`as_words`, a bitcast: no copy), so
its element offsets stay below 2**31; the kernel reads, for each byte it wants, the word that holds it and takes
its low or high half (`load`). The same DRAM bytes move; only the operands that need it take this path.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LIMIT = 2**31  # elements a 32-bit signed offset reaches


def needs_words(shape: tuple[int, ...], dtype) -> bool:
    """Whether an operand of this shape and dtype gets 32-bit offsets that overflow (see the module's text)."""
    return jnp.dtype(dtype).itemsize == 1 and LIMIT < math.prod(shape) <= 2**32


def as_words(x: jax.Array) -> jax.Array:
    """[..., N] of a one-byte dtype -> uint16 [..., N/2], word j holding bytes 2j (low half) and 2j+1 (high)."""
    if x.shape[-1] % 2:
        raise ValueError(f"an operand {x.shape} of {x.dtype} over 2 GiB needs an even last axis to be read as "
                         f"16-bit words (Pallas' 32-bit offsets cannot reach past 2 GiB of one-byte elements)")
    pairs = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint16)


def operand(x: jax.Array, words: bool | None) -> tuple[jax.Array, bool]:
    """An operand as a kernel takes it, and whether as words: `words` None decides by `needs_words`."""
    words = needs_words(x.shape, x.dtype) if words is None else words
    return (as_words(x) if words else x), words


def load(ref, index: tuple, dtype, words: bool) -> jax.Array:
    """ref[index] as `dtype` (one byte wide), where the last entry of `index` is an int32 array of byte columns;
    for a ref of words (`as_words`), each byte is taken from the word that holds it."""
    if not words:
        return ref[index]
    *lead, col = index
    word = ref[(*lead, col // 2)]
    byte = jnp.where(col % 2 == 0, word & 0xFF, word >> 8).astype(jnp.uint8)
    return byte if jnp.dtype(dtype) == jnp.uint8 else jax.lax.bitcast_convert_type(byte, dtype)
