"""Decode context parallelism's attention (`jaxdp.parallel.dcp`): the log-sum-exp merge of partial attention
equals attention over the whole context, on one device (the pure-jnp reference) and across a DCP subgroup of the
mesh's tp devices (queries gathered, lse gathered, outputs reduce-scattered), with the pool split token p -> device
p mod N; and the cache writes land on the owner device only."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdp.layout import Layout
from jaxdp.ops.attention import attend_latents
from jaxdp.ops.partial_attention import merge_partials, mla_decode_partial
from jaxdp.parallel.dcp import DCPError, SplitContext, check_dcp_pool, local_lengths

L, R, SCALE = 16, 8, 0.3


def full_attention(q_BHL, q_BHR, kv_BCK, lens_B):
    valid = jnp.arange(kv_BCK.shape[1])[None, :] < lens_B[:, None]
    return attend_latents(q_BHL, q_BHR, kv_BCK, valid, SCALE, L)


def split_pool(kv_BCK, N, S_local):
    """Sequence b's token p on part p mod N at local index p // N; each sequence its own pages in every part:
    [N, B * pages, S_local, K] and the page table [B, pages]."""
    B, C, K = kv_BCK.shape
    parts = np.asarray(kv_BCK).reshape(B, C // N, N, K).transpose(2, 0, 1, 3)  # [N, B, C / N, K]
    pages = C // N // S_local
    table = np.arange(B * pages).reshape(B, pages)
    return jnp.asarray(parts.reshape(N, B * pages, S_local, K)), jnp.asarray(table)


def data(B=3, H=4, C=32, seed=0, lens=(1, 13, 32)):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (B, H, L)), jax.random.normal(k[1], (B, H, R)),
            jax.random.normal(k[2], (B, C, L + R)), jnp.array(lens[:B], jnp.int32))


@pytest.mark.parametrize("N,C,lens", [(2, 32, (1, 13, 32)), (4, 32, (1, 13, 32)),
                                      (2, 256, (1, 13, 32)), (2, 256, (1, 100, 256))])
def test_merge_of_parts_is_whole_attention(N, C, lens):
    """(C 256: a table of 64 pages of 2, read as its first 32 pages or whole, as the rows' lengths need)"""
    q_l, q_r, kv, lens = data(C=C, lens=lens)
    want = full_attention(q_l, q_r, kv, lens)
    pools, table = split_pool(kv, N, 2)

    @jax.jit
    def parts_and_merge(q_l, q_r, pools, lens):
        o, lse = jax.vmap(lambda pool, d: mla_decode_partial(q_l, q_r, pool, table, local_lengths(lens, d, N),
                                                             softmax_scale=SCALE, kv_lora_rank=L))(pools, jnp.arange(N))
        return o, merge_partials(o, lse)

    o, got = parts_and_merge(q_l, q_r, pools, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # (a part alone is not the whole: the merge does the work)
    assert not np.allclose(np.asarray(o[0]), np.asarray(want), atol=1e-3)


@pytest.mark.parametrize("N", [4, 2])
def test_subgroup_attention_on_the_mesh(N):
    """dp=2, tp=4: each tp device holds H/tp heads; attention over the split pool gives each device its heads'
    whole-context output (both dp ranks, different data)."""
    lay = Layout(dp=2, tp=4)
    mesh = lay.make_mesh(jax.devices()[:8])
    H = 8
    qs = [data(H=H, seed=s) for s in (1, 2)]
    want = np.stack([np.asarray(full_attention(q_l, q_r, kv, lens)) for q_l, q_r, kv, lens in qs])  # [dp, B, H, L]
    pools = [split_pool(kv, N, 2) for _, _, kv, _ in qs]
    # device (r, t) holds part t mod N of rank r's pool
    pool = jnp.stack([jnp.stack([pools[r][0][t % N] for t in range(4)]) for r in range(2)])
    q_l, q_r, lens = (jnp.stack([q[i] for q in qs]) for i in (0, 1, 3))
    table = pools[0][1]
    split = SplitContext(N, 4)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("dp", None, "tp"), P("dp", None, "tp"),
                                                            P("dp", "tp"), P("dp")),
                       out_specs=P("dp", None, "tp"), check_vma=False)
    def run(q_l, q_r, pool, lens):
        return split.attend(q_l[0], q_r[0], pool[0, 0], table, lens[0], softmax_scale=SCALE, kv_lora_rank=L)[None]

    step = jax.jit(run).lower(q_l, q_r, pool, lens).compile()
    np.testing.assert_allclose(np.asarray(step(q_l, q_r, pool, lens)), want, rtol=1e-5, atol=1e-5)
    # the query and lse gathers and the reduce-scatter run within each subgroup of N devices
    groups = re.findall(r"(all-gather|reduce-scatter)\(.*?replica_groups=\{(\{[\d,{}]*\})\}", step.as_text())
    assert sorted(op for op, _ in groups) == ["all-gather", "all-gather", "reduce-scatter"]
    assert all(len(g.split(",")) == N for _, gs in groups for g in re.findall(r"\{([\d,]+)\}", gs))


def test_cache_writes_land_on_the_owner():
    mesh = Layout(dp=1, tp=4).make_mesh(jax.devices()[:4])
    split, S_local = SplitContext(4, 4), 2
    slots = jnp.arange(20, dtype=jnp.int32)  # pages 0-2 of 8 tokens, logical

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P("tp"), check_vma=False)
    def run(slots):
        return split.local_slots(slots, S_local)[None]

    got = np.asarray(jax.jit(run)(slots))
    for d in range(4):
        p = np.arange(20)
        mine = p % 4 == d
        np.testing.assert_array_equal(got[d][mine], (p // 8 * 2 + p % 8 // 4)[mine])  # = p // 4, pages in order
        assert (got[d][~mine] >= 2**30).all()


@pytest.mark.parametrize("dcp,tp,page,words", [(2, 1, 16, "tp=1"), (3, 4, 16, "divide"), (4, 4, 6, "multiple")])
def test_bad_sizes_refused_in_one_sentence(dcp, tp, page, words):
    with pytest.raises(DCPError, match=words) as e:
        check_dcp_pool(dcp, tp, page)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)
