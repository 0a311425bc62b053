"""NVFP4 weights as NVIDIA ModelOpt writes them (pure jnp; no kernels here).

Layout of one quantized Linear weight `w_NK` (torch Linear's [out=N, in=K]):
- `weight` uint8 [N, K//2]: E2M1 codes, two per byte, the EVEN column in the LOW nibble;
- `weight_scale` float8_e4m3fn [N, K//16]: one scale per 16 consecutive values along K;
- `weight_scale_2` float32 scalar: the per-tensor scale, amax(|w|) / (6 * 448).

A value dequantizes as `e2m1(code) * float(weight_scale[n, k // 16]) * weight_scale_2`.
An E2M1 code is sign (bit 3) and a 3-bit magnitude index into 0, .5, 1, 1.5, 2, 3, 4, 6.

Error bound. Let s = float(weight_scale[n, b]) * weight_scale_2 be a block's effective scale and
x = w / s the scaled value. The block scale is amax_block / 6 / weight_scale_2 rounded to E4M3 (3 mantissa
bits, relative error <= 2**-4 while it is a normal number), so |x| <= 6 / (1 - 2**-4) = 6.4; |x| > 6
saturates to 6 (error <= 0.4). Below 6, rounding to nearest on the E2M1 grid errs by at most half a gap:
0.25 on [0, 2], 0.5 on [2, 4], 1 on [4, 6]. Hence
    |w - dequant(w)| <= s  for every element,   and  <= s / 4  where |w| <= 2 s,
and s <= amax_block / 6 * (1 + 2**-4), so every error is at most ~0.18 * amax_block. This needs the block
scale to be a normal E4M3 number, i.e. amax_block >= 2**-6 / 448 * amax (~3.5e-5 * amax). Smaller blocks
get a subnormal or zero scale (a zero one dequantizes to zeros, as in ModelOpt); their error is at most
amax_block, itself below ~3.5e-5 * amax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK_K = 16  # values per E4M3 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitude index 0..7 -> value; the sign bit (8) negates. Index i is the nibble's value in the LUT.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between neighbouring magnitudes; a tie rounds to the even index (ModelOpt's cast_fp4).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@jax.jit
def e2m1_encode(x: jax.Array) -> jax.Array:
    """Rounds float values (already scaled into [-6, 6]) to E2M1 codes (uint8, 0..15), ties to even."""
    x = x.astype(jnp.float32)
    mag = jnp.minimum(jnp.abs(x), E2M1_MAX)
    bounds = jnp.asarray(_E2M1_BOUNDS, jnp.float32)
    lower = jnp.searchsorted(bounds, mag, side="left")
    upper = jnp.searchsorted(bounds, mag, side="right")
    tie = lower != upper  # mag sits exactly on a midpoint between index `lower` and `lower + 1`
    index = jnp.where(tie & (lower % 2 == 1), upper, lower).astype(jnp.uint8)
    sign = (jnp.signbit(x) & (index > 0)).astype(jnp.uint8)  # -0 encodes as +0
    return index | (sign << 3)


@jax.jit
def e2m1_decode(codes: jax.Array) -> jax.Array:
    """E2M1 codes (any integer dtype, 0..15) -> float32 by table lookup; the obviously-right version."""
    return jnp.asarray(E2M1_VALUES, jnp.float32)[codes.astype(jnp.int32)]


def e2m1_decode_arith(codes: jax.Array) -> jax.Array:
    """E2M1 codes -> float32 with selects only (no table), so it runs in registers inside a kernel."""
    codes = codes.astype(jnp.int32)
    exp = (codes >> 1) & 3
    half_mantissa = (codes & 1).astype(jnp.float32) * 0.5
    pow2 = jnp.where(exp == 3, 4.0, jnp.where(exp == 2, 2.0, 1.0))
    mag = jnp.where(exp == 0, half_mantissa, (1.0 + half_mantissa) * pow2)
    return jnp.where((codes & 8) != 0, -mag, mag)


@jax.jit
def pack_e2m1(values_NK: jax.Array) -> jax.Array:
    """Float values on the E2M1 grid (others are rounded) [..., K] -> uint8 [..., K//2], even col low."""
    if values_NK.shape[-1] % 2:
        raise ValueError(f"K must be even to pack two E2M1 values per byte; got {values_NK.shape[-1]}.")
    codes = e2m1_encode(values_NK)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """uint8 [..., K//2] -> E2M1 codes uint8 [..., K] (even column from the low nibble)."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@jax.jit
def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """uint8 [..., K//2] -> float32 [..., K]."""
    return e2m1_decode(unpack_codes(packed))


def nvfp4_global_scale(*weights: jax.Array) -> jax.Array:
    """weight_scale_2 = amax / (6 * 448) over all given tensors (one shared scale for gate and up)."""
    amax = jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32))) for w in weights]))
    scale = amax / (E2M1_MAX * E4M3_MAX)
    return jnp.where(scale > 0, scale, 1.0).astype(jnp.float32)


@jax.jit
def quantize_nvfp4(
    w_NK: jax.Array, global_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w [N, K] -> (packed uint8 [N, K//2], block_scale e4m3 [N, K//16], weight_scale_2 f32 scalar).

    `global_scale` overrides weight_scale_2 (pass a shared one for fused gate/up); it must be at least
    amax(|w|) / 2688 or block scales saturate at 448 (the values then clip to +-6 * 448 * scale).
    """
    n, k = w_NK.shape
    if k % BLOCK_K:
        raise ValueError(f"K={k} must be a multiple of {BLOCK_K} for NVFP4 block scales.")
    w_NBV = w_NK.astype(jnp.float32).reshape(n, k // BLOCK_K, BLOCK_K)
    scale_2 = nvfp4_global_scale(w_NK) if global_scale is None else jnp.asarray(global_scale, jnp.float32)
    block_amax_NB = jnp.max(jnp.abs(w_NBV), axis=-1)
    block_scale_NB = block_amax_NB / (E2M1_MAX * scale_2)
    block_scale_NB = jnp.where(block_scale_NB == 0, 1.0, jnp.minimum(block_scale_NB, E4M3_MAX))
    block_scale_NB = block_scale_NB.astype(jnp.float8_e4m3fn)
    # The codes are chosen against the stored (rounded) scale. XLA:GPU may drop the f32 -> e4m3 -> f32 round trip
    # (xla_allow_excess_precision, on by default) and scale by the unrounded value: seen on an H200, a 4.84 in
    # block units became a 6 (the test's error bound). The barrier keeps the rounding.
    effective_NB = jax.lax.optimization_barrier(block_scale_NB).astype(jnp.float32) * scale_2
    safe_NB = jnp.where(effective_NB == 0, 1.0, effective_NB)  # an underflowed block dequantizes to 0
    scaled_NK = (w_NBV / safe_NB[..., None]).reshape(n, k)
    return pack_e2m1(scaled_NK), block_scale_NB, scale_2


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_nvfp4(
    packed_NK2: jax.Array, block_scale_NK16: jax.Array, weight_scale_2: jax.Array, dtype=jnp.float32
) -> jax.Array:
    """The inverse of quantize_nvfp4 (up to rounding): [..., N, K//2] -> [..., N, K] in `dtype`.

    Leading dims are allowed (experts [E, N, K//2] with weight_scale_2 [E]).
    """
    values = unpack_e2m1(packed_NK2)
    scales = jnp.repeat(block_scale_NK16.astype(jnp.float32), BLOCK_K, axis=-1)
    scale_2 = jnp.asarray(weight_scale_2, jnp.float32).reshape(
        jnp.shape(weight_scale_2) + (1,) * 2
    )
    return (values * scales * scale_2).astype(dtype)


@jax.jit
def quantize_nvfp4_gate_up(
    w_gate_NK: jax.Array, w_up_NK: jax.Array
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """Quantizes gate and up projections with ONE shared weight_scale_2 (as ModelOpt exports them, so
    the fused [2I, H] weight has a single per-tensor scale). Returns (gate triple, up triple)."""
    shared = nvfp4_global_scale(w_gate_NK, w_up_NK)
    return quantize_nvfp4(w_gate_NK, shared), quantize_nvfp4(w_up_NK, shared)


@jax.jit
def quantize_nvfp4_experts_gate_up(
    w_gate_EIH: jax.Array, w_up_EIH: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Experts' gate [E, I, H] and up [E, I, H] -> the fused gate/up operands of nvfp4_grouped_matmul:
    packed uint8 [E, 2I, H//2], block scales e4m3 [E, 2I, H//16], weight_scale_2 f32 [E] (shared
    between an expert's gate and up)."""

    def one(w_gate_IH, w_up_IH):
        (pg, sg, s2), (pu, su, _) = quantize_nvfp4_gate_up(w_gate_IH, w_up_IH)
        return jnp.concatenate([pg, pu], axis=0), jnp.concatenate([sg, su], axis=0), s2

    return jax.vmap(one)(w_gate_EIH, w_up_EIH)


@jax.jit
def quantize_nvfp4_experts(w_ENK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Experts' weights [E, N, K] (e.g. down [E, H, I]) -> ([E, N, K//2], [E, N, K//16], [E])."""
    return jax.vmap(quantize_nvfp4)(w_ENK)
