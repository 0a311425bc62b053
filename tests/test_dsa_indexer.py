"""The indexer's prompt path in blocks of rows (`Indexer.select_prompt`): blocking bounds what it holds at
once (keys [block, C, E], scores [block, I, C]) and changes no selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.config import PRESETS
from jaxdp.model.indexer import QUERY_BLOCK_FLOATS, Indexer, query_block

CFG = PRESETS["glm-5-tiny"].with_(index_n_heads=4)  # index keys of 64, rope on 32 of them


@pytest.fixture(scope="module")
def rows():
    """7 prompt rows of two sequences (and one padding row, seq B) over a cached context of 40."""
    k = jax.random.split(jax.random.key(1), 3)
    T, B, C = 8, 2, 40
    q_TQ = jax.random.normal(k[0], (T, CFG.q_lora_rank))
    x_TD = jax.random.normal(k[1], (T, CFG.hidden_size))
    keys_BCE = jax.random.normal(k[2], (B, C, CFG.index_head_dim))
    seq_T = jnp.array([0, 0, 0, 1, 1, 1, 1, B])
    pos_T = jnp.array([30, 31, 32, 36, 37, 38, 39, 0])
    return Indexer(CFG, nnx.Rngs(0)), q_TQ, x_TD, pos_T, seq_T, keys_BCE


@pytest.mark.parametrize("block", [1, 3, 4])
def test_blocks_of_rows_select_what_all_rows_at_once_select(rows, block):
    indexer, q_TQ, x_TD, pos_T, seq_T, keys_BCE = rows
    def keys_of(seq_W):  # the rows' own sequences' keys (padding rows: the last sequence's, discarded)
        return keys_BCE[jnp.clip(seq_W, 0, keys_BCE.shape[0] - 1)]

    whole = indexer.select_prompt(q_TQ, x_TD, pos_T, seq_T, keys_of, keys_BCE.shape[1], 6, block=8)
    blocked = jax.jit(lambda *a: indexer.select_prompt(*a, keys_of, keys_BCE.shape[1], 6, block=block))(
        q_TQ, x_TD, pos_T, seq_T)
    np.testing.assert_array_equal(blocked, whole)
    # independent check of one row: its own sequence's keys, causally, top 6 by the indexer's score
    q_TIE, w_TI = indexer.queries(q_TQ, x_TD, pos_T)
    score_C = jnp.einsum("ie,ce->ic", q_TIE[4], keys_BCE[1])
    score_C = (jax.nn.relu(score_C) * w_TI[4][:, None]).sum(0)[: 37 + 1]
    np.testing.assert_array_equal(np.sort(blocked[4]), np.sort(np.argsort(-np.asarray(score_C))[:6]))


def test_query_block_bounds_the_floats_held():
    assert query_block(4096, 202752, 128, 32) == 2  # GLM-5 at its longest context: 2 rows x 202,752 x 160
    assert query_block(64, 1024, 64, 8, budget=64 * 1024 * 72) == 64  # all rows fit: one block
    assert query_block(64, 1024, 64, 8, budget=5 * 1024 * 72) == 4  # a power of two below the bound
    assert query_block(64, 10**7, 128, 32) == 1  # at least one row
    for T, C in [(512, 4096), (100, 65536), (4096, 202752)]:
        assert query_block(T, C, 128, 32) * C * 160 <= max(QUERY_BLOCK_FLOATS, C * 160)


def test_decode_selection_at_glm5_widths_holds_one_block_of_keys():
    """A decode step of 64 sequences at 131,072 tokens with GLM-5's indexer (32 heads of 128): the selection
    gathers each block of rows' own keys through the page table, so XLA's temporaries stay near one block
    (QUERY_BLOCK_FLOATS), where gathering every sequence's keys first would hold 4 GiB of keys (float32) and 1 GiB
    of scores. The pool is float32 here: XLA:CPU would convert a bf16 pool to float32 whole for its dots (a copy
    of the CPU's own, docs/plan.md), which would hide what the step itself holds."""
    from jaxdp.model.mla import gather_context

    cfg = PRESETS["glm-5"]
    B, C, S = 64, 131072, 64
    indexer = Indexer(cfg, nnx.Rngs(0))
    k = cfg.index_topk

    def select(q_TQ, x_TD, pos_T, seq_T, keys_PSE, table_BN):
        def keys_of(seq_W):
            return gather_context(keys_PSE, table_BN[jnp.clip(seq_W, 0, B - 1)])

        return indexer.select_prompt(q_TQ, x_TD, pos_T, seq_T, keys_of, C, k)

    sds = jax.ShapeDtypeStruct
    args = (sds((B, cfg.q_lora_rank), jnp.float32), sds((B, cfg.hidden_size), jnp.float32), sds((B,), jnp.int32),
            sds((B,), jnp.int32), sds((B * C // S, S, cfg.index_head_dim), jnp.float32), sds((B, C // S), jnp.int32))
    mem = jax.jit(select).lower(*args).compile().memory_analysis()
    all_keys = B * C * cfg.index_head_dim * 4
    assert mem.temp_size_in_bytes < all_keys / 2, mem.temp_size_in_bytes / 2**30
    assert mem.temp_size_in_bytes < 8 * QUERY_BLOCK_FLOATS, mem.temp_size_in_bytes / 2**20
