"""The XLA absorbed decode reads the pages the step's longest sequence fills, not the whole page table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.model.mla_prompt import attend_latents
from jaxdp.ops.attention import decode_widths, gather_context, mla_decode_xla

B, H, L, R, S, N = 3, 4, 16, 8, 4, 64  # 64 pages of 4 tokens: widths 16, 32, 64 pages
KW = dict(softmax_scale=0.3, kv_lora_rank=L)


def whole_table(q_latent, q_rope, kv, table, lens):
    kv_BCK = gather_context(kv, table)
    valid = jnp.arange(kv_BCK.shape[1])[None, :] < lens[:, None]
    return attend_latents(q_latent, q_rope, kv_BCK, valid, KW["softmax_scale"], L)


def case(lens, poison_from=None):
    rng = np.random.default_rng(sum(lens))
    kv = rng.standard_normal((B * N + 1, S, L + R)).astype(np.float32)
    table = rng.permutation(B * N).reshape(B, N).astype(np.int32)
    if poison_from is not None:  # the pages past the width the step needs hold NaN (one spare page)
        kv[B * N] = np.nan
        table[:, poison_from:] = B * N
    q_latent = jnp.asarray(rng.standard_normal((B, H, L)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((B, H, R)), jnp.float32)
    return q_latent, q_rope, jnp.asarray(kv), jnp.asarray(table), jnp.asarray(lens, jnp.int32)


def test_widths_cover_the_table():
    assert decode_widths(N, S) == [16, 32, 64]
    assert decode_widths(16, 16) == [4, 8, 16]
    assert decode_widths(4, 16) == [4]
    assert decode_widths(64, 64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("lens", [[1, 5, 64], [65, 2, 3], [128, 1, 1], [129, 40, 200], [256, 256, 1]])
def test_same_as_reading_the_whole_table(lens):
    args = case(lens)
    got = jax.jit(lambda *a: mla_decode_xla(*a, **KW))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole_table(*args)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens,width", [([3, 64, 10], 16), ([100, 7, 128], 32)])
def test_pages_past_the_longest_sequence_are_never_read(lens, width):
    """NaN in every page past the width the longest sequence needs: the step's output stays finite (reading
    the whole table, as the decode did, multiplies those NaN by zero weights and returns NaN)."""
    args = case(lens, poison_from=width)
    got = np.asarray(jax.jit(lambda *a: mla_decode_xla(*a, **KW))(*args))
    assert np.isfinite(got).all()
    assert np.isnan(np.asarray(whole_table(*args))).any()  # (so the test can fail)
    clean = case(lens)  # the same rows with those pages finite: the same output
    np.testing.assert_allclose(got, np.asarray(whole_table(*clean)), rtol=1e-5, atol=1e-5)
