"""Two-batch overlap, on the device: a rank's step as two micro-batches the model runs side by side
(`jaxdp.model.decoder.MicroBatch`), so that XLA can run one micro-batch's dispatch / combine (or gather / return)
while the other computes.

The host chooses the split row (`jaxdp.parallel.tbo_split`, at a sequence boundary, so neither micro-batch
attends the other's keys); each micro-batch holds a fixed `num_micro_rows` rows of the step (static shapes), the
rows past its own marked as padding: they write no cache entry, reach no expert and are dropped when the rows come
back together.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdp.model.decoder import MicroBatch
from jaxdp.model.mla import AttnBatch
from jaxdp.parallel.places import GatherSpec, MeshComm

NO_SLOT = jnp.iinfo(jnp.int32).max  # a cache slot past any pool: the write is dropped


def micro_batches(batch: AttnBatch, valid_T: jax.Array, split: jax.Array, num_micro_rows: int, absorbed: bool,
                  comm: MeshComm) -> tuple[MicroBatch, MicroBatch]:
    """The step's rows [0, split) and [split, T) as two micro-batches of `num_micro_rows` rows each. A decode step's
    row t is its sequence t, so each micro-batch takes its rows' page tables and lengths along (T == B); a prompt
    step's micro-batches keep every sequence's and select by `seq_T`. Their comms are `comm` at the micro-batch's
    row count, gathering MAX_LEN (no SUM_LEN offsets to agree on per micro-batch)."""
    T, M = valid_T.shape[0], num_micro_rows
    m = jnp.arange(M, dtype=jnp.int32)
    gather = GatherSpec("max_len", comm.gather.dp, comm.gather.tp)
    micro_comm = dataclasses.replace(comm, gather=gather, num_rows=M)
    out = []
    for start, end in ((0, split), (split, T)):
        rows = start + m
        own = rows < end
        rows_M = jnp.where(own, rows, T)

        def take(a, fill, rows_M=rows_M):
            return jnp.take(a, rows_M, axis=0, mode="fill", fill_value=fill)

        valid_M = take(valid_T, False)
        positions, slots = take(batch.positions_T, 0), take(batch.slots_T, NO_SLOT)
        if absorbed:
            seq = jnp.where(valid_M, m, M)
            sub = AttnBatch(positions, seq, slots, take(batch.page_table_BN, 0), take(batch.seq_lens_B, 0))
        else:
            seq = take(batch.seq_T, batch.page_table_BN.shape[0])
            sub = AttnBatch(positions, seq, slots, batch.page_table_BN, batch.seq_lens_B)
        out.append(MicroBatch(rows_M, valid_M, sub, micro_comm))
    return out[0], out[1]
