"""Decode context parallelism (SGLang's `--dcp-size N`): an attention group's latent pool split token-wise over
each DCP subgroup of N of its tp devices, and attention over the split pool.

The pool. The scheduler's pages keep their size (`page_size` tokens, a multiple of N) and numbering; each device
holds every page with page_size / N slots. Token p of a sequence is stored on the device of DCP rank p mod N (tp
index mod N) of its subgroup (tp index // N), at local index p // N of the sequence's pages in table order, so
every device holds 1/N of every sequence and a device's pool holds 1/N of the tokens the scheduler counts. A step
writes each row's latent only on its owner device (`local_slots`).

Attention (`SplitContext.attend`, for decode and prompt rows alike, each row over its positions + 1 first
tokens): the subgroup's queries are all-gathered (each device attends all N x H/tp heads of its subgroup over its
own tokens), the partial outputs' log-sum-exps all-gathered, each partial output rescaled by exp(lse - total) and
the rescaled outputs reduce-scattered back to each device's own heads: the same result as attention over the
whole sequence (`jaxdp.ops.partial_attention.merge_partials` is the single-device reference).

With N < tp the collectives run within each subgroup (`axis_index_groups`), as the planner counts them
(`jaxdp.planner.dcp`).

KV handed over under prefill/decode disaggregation travels token-major whatever either pool's layout;
`jaxdp.disagg.kv` writes each device's tokens at the slots `local_slots` gives them (and reads a split pool back).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdp.ops.partial_attention import mla_decode_partial
from jaxdp.planner.dcp import DCPError, check_dcp

TP_AXIS = "tp"
DROPPED_SLOT = 2**30  # a cache slot past any pool: the write is dropped


__all__ = ["DCPError", "SplitContext", "check_dcp_pool", "local_lengths", "split_pool_spec"]


def split_pool_spec() -> P:
    """A split pool's arrays [dp, tp, layers, pages, page_size / N, width]: each device holds its own part."""
    return P("dp", TP_AXIS)


def check_dcp_pool(dcp: int, tp: int, page_size: int) -> None:
    """One sentence when `--dcp-size dcp` cannot split the pool of a group of `tp` devices with pages of
    `page_size` tokens (`DCPError`)."""
    check_dcp(dcp, tp)
    if page_size % dcp:
        raise DCPError(f"--page-size {page_size} must be a multiple of --dcp-size {dcp} (each device holds "
                       f"page_size / {dcp} slots of every page); use a page size that {dcp} divides.")


def local_lengths(lens_T: jax.Array, rank, size: int) -> jax.Array:
    """How many of a row's first lens_T positions the device of DCP rank `rank` holds (positions p with
    p mod size == rank)."""
    return jnp.maximum((lens_T - rank + size - 1) // size, 0)


@dataclasses.dataclass(frozen=True)
class SplitContext:
    """What MLA needs to attend over a split pool (the model takes it as its `decode_kernel`: `dcp_size` > 1 sends
    MLA to `local_slots` and `attend`). Used inside the step's shard_map over ("dp", "tp")."""

    dcp_size: int
    tp: int

    def rank(self):
        """This device's DCP rank in its subgroup."""
        return jax.lax.axis_index(TP_AXIS) % self.dcp_size

    def local_slots(self, slots_T: jax.Array, local_page_size: int) -> jax.Array:
        """The scheduler's slots (page * page_size + offset) as this device's (page * page_size / N + offset // N)
        where this device owns the token (offset mod N is its rank), a dropped slot elsewhere."""
        N = self.dcp_size
        page_T, off_T = slots_T // (local_page_size * N), slots_T % (local_page_size * N)
        return jnp.where(off_T % N == self.rank(), page_T * local_page_size + off_T // N, DROPPED_SLOT)

    def groups(self) -> list[list[int]] | None:
        """The DCP subgroups as tp indices (the collectives' axis_index_groups; None: the subgroup is the group)."""
        N = self.dcp_size
        return None if N == self.tp else [list(range(s * N, s * N + N)) for s in range(self.tp // N)]

    def attend(self, q_latent_THL, q_rope_THR, kv_PSK, page_table_TN, lens_T, *, softmax_scale, kv_lora_rank):
        """Each row over the first lens_T tokens of its sequence (page_table_TN: the row's sequence's pages), all
        of them, wherever in the subgroup they are stored: o [T, H/tp, L] for this device's heads (float32)."""
        N, groups = self.dcp_size, self.groups()
        L = q_latent_THL.shape[-1]
        q_THK = jnp.concatenate([q_latent_THL, q_rope_THR.astype(q_latent_THL.dtype)], -1)
        q_THK = jax.lax.all_gather(q_THK, TP_AXIS, axis=1, tiled=True, axis_index_groups=groups)  # [T, N * H, K]
        o_THL, lse_TH = mla_decode_partial(q_THK[..., :L], q_THK[..., L:], kv_PSK, page_table_TN,
                                           local_lengths(lens_T, self.rank(), N), softmax_scale=softmax_scale,
                                           kv_lora_rank=kv_lora_rank)
        lse_NTH = jax.lax.all_gather(lse_TH, TP_AXIS, axis_index_groups=groups)  # [N, T, N * H]
        o_THL = o_THL * jnp.exp(lse_TH - jax.nn.logsumexp(lse_NTH, axis=0))[..., None]
        return jax.lax.psum_scatter(o_THL, TP_AXIS, scatter_dimension=1, tiled=True,
                                    axis_index_groups=groups)  # [T, H, L]
