"""A request's KV cache out of one server's page pool and into another's.

The paged pool (`jaxdp.parallel.step.StepRunner.cache`) holds, per entry (the latent cache of each layer
stack, and with DSA the index keys), an array [dp, layers, pages, page_size, width] sharded over `dp` and
replicated over each attention group's `tp` devices. A request's KV is the tokens at its pages' slots. It
travels token-major, in chunks of `KVFormat.chunk_tokens` tokens ([layers, chunk_tokens, width] per
entry, the last chunk padded): the two servers may differ in page size, dp and tp, and a chunk is the same
on both sides whatever their pages; a fixed chunk means one compiled gather and one compiled scatter per
entry, whatever the prompt's length (no compile while serving), and at most one chunk of padding.

Reading takes the rank's pool shard on one of its devices; writing scatters into the pool shard of every
device of the decode rank's group, in place (the shard's buffer donated), and leaves the other ranks'
shards untouched, so neither side moves more than the request's tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """What a pool holds per token: entry name -> (layers, width, dtype name); and the transfer's chunk."""

    entries: tuple[tuple[str, int, int, str], ...]  # (name, layers, width, dtype), sorted by name
    chunk_tokens: int

    @classmethod
    def of(cls, cache: dict, chunk_tokens: int) -> KVFormat:
        return cls(tuple(sorted((k, v.shape[1], v.shape[4], str(v.dtype)) for k, v in cache.items())), chunk_tokens)

    def to_json(self) -> dict:
        return {"entries": [list(e) for e in self.entries], "chunk_tokens": self.chunk_tokens}

    @classmethod
    def from_json(cls, d: dict) -> KVFormat:
        return cls(tuple(tuple(e) for e in d["entries"]), int(d["chunk_tokens"]))

    def mismatch(self, other: KVFormat) -> str | None:
        """Why a pool of format `other` cannot take this one's KV (None: it can)."""
        if self.entries != other.entries:
            return (f"the prefill server's KV cache ({_describe(self)}) differs from the decode server's "
                    f"({_describe(other)}); serve the same model with the same --kv-cache-dtype on both")
        return None

    def chunks(self, n_tokens: int) -> int:
        return max(1, -(-n_tokens // self.chunk_tokens))

    def specs(self, n_tokens: int, sharding) -> list[dict[str, jax.ShapeDtypeStruct]]:
        """The arrays of a request of n_tokens as they travel (what the receiving side asks for)."""
        one = {name: jax.ShapeDtypeStruct((layers, self.chunk_tokens, width), jnp.dtype(dtype), sharding=sharding)
               for name, layers, width, dtype in self.entries}
        return [dict(one) for _ in range(self.chunks(n_tokens))]

    def nbytes(self, n_tokens: int) -> int:
        per_token = sum(layers * width * jnp.dtype(dtype).itemsize for _, layers, width, dtype in self.entries)
        return per_token * self.chunks(n_tokens) * self.chunk_tokens


def _describe(f: KVFormat) -> str:
    return ", ".join(f"{name} {layers} layers x {width} {dtype}" for name, layers, width, dtype in f.entries)


def _run(page_size: int, fmt: KVFormat) -> int:
    """Tokens moved as one contiguous block: a whole page when a chunk holds whole pages, else one token."""
    return page_size if fmt.chunk_tokens % page_size == 0 else 1


def run_starts(pages: list[int], page_size: int, n_tokens: int, chunk: int, fmt: KVFormat) -> np.ndarray:
    """The pool slot (page * page_size + offset) where each run of a chunk starts (0 past n_tokens: unused)."""
    run = _run(page_size, fmt)
    t = chunk * fmt.chunk_tokens + np.arange(0, fmt.chunk_tokens, run)
    live = t < n_tokens
    t = np.where(live, t, 0)
    page = np.asarray(pages, np.int64)[t // page_size] if len(pages) else np.zeros_like(t)
    return np.where(live, page * page_size + t % page_size, 0).astype(np.int32)


def _live_runs(n_tokens: int, chunk: int, run: int, fmt: KVFormat) -> np.int32:
    """How many of a chunk's runs hold the request's tokens (a last partial page is moved whole: its slots past
    the request's length are the request's own page, unread until written)."""
    return np.int32(-(-min(fmt.chunk_tokens, n_tokens - chunk * fmt.chunk_tokens) // run))


def _rank_shards(x: jax.Array, rank: int) -> list:
    """This process's shards of pool array x that hold rank `rank` (one per device of its group)."""
    return [s for s in x.addressable_shards if (s.index[0].start or 0) <= rank < (s.index[0].stop or x.shape[0])]


@functools.partial(jax.jit, static_argnums=2)
def _gather(shard, starts_R, run: int):
    _, L, P, S, W = shard.shape
    blocks = shard.reshape(L, P * S // run, run, W)[:, starts_R // run]  # whole pages: [L, R, run, W]
    return blocks.reshape(L, -1, W)


# The write goes one run (a page) at a time, in a loop over the chunk's live runs: XLA:CPU lowers a scatter
# into the pool as a pass over the whole pool, 7x slower than a per-token loop on a 1.1 GiB float32 pool (a
# bf16 pool it widens to float32 either way, 2-11 s a chunk: keep bf16 pools to GPUs); the loop touches only
# the request's slots and needs no "drop" for the padding.
@functools.partial(jax.jit, donate_argnums=0, static_argnums=4)
def _scatter(shard, values, starts_R, live, run: int):
    _, L, P, S, W = shard.shape
    values = values.astype(shard.dtype)

    def body(i, flat):
        block = jax.lax.dynamic_slice_in_dim(values, i * run, run, 1)
        return jax.lax.dynamic_update_slice_in_dim(flat, block, starts_R[i], 1)

    return jax.lax.fori_loop(0, live, body, shard.reshape(L, P * S, W)).reshape(shard.shape)


def read_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat,
                    chunks: range | None = None) -> list[dict]:
    """A request's KV at `rank`'s pages, as `fmt.chunks(n_tokens)` chunks on one device of the rank (or only the
    chunks numbered in `chunks`: the KV of a part of the prompt, as it is read)."""
    out = []
    for c in range(fmt.chunks(n_tokens)) if chunks is None else chunks:
        chunk = {}
        for name, x in cache.items():
            shard = _rank_shards(x, rank)[0]
            starts = run_starts(pages, x.shape[3], n_tokens, c, fmt)
            chunk[name] = _gather(shard.data, jax.device_put(starts, shard.device), _run(x.shape[3], fmt))
        out.append(chunk)
    return out


def write_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat,
                     chunks: list[dict], first: int = 0) -> dict:
    """The pool with a request's KV (`read_request_kv`'s chunks, on any device; the first of them the request's
    chunk number `first`) written at `rank`'s pages; the rank's shards are updated in place and every other
    shard is kept as is."""
    new = {}
    for name, x in cache.items():
        run = _run(x.shape[3], fmt)
        mine = {s.device for s in _rank_shards(x, rank)}
        arrays = []
        for s in x.addressable_shards:
            data = s.data
            if s.device in mine:
                for c, chunk in enumerate(chunks, start=first):
                    starts = jax.device_put(run_starts(pages, x.shape[3], n_tokens, c, fmt), s.device)
                    data = _scatter(data, jax.device_put(chunk[name], s.device), starts,
                                    _live_runs(n_tokens, c, run, fmt), run)
            arrays.append(data)
        new[name] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
    return new
