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


def slots(pages: list[int], page_size: int, n_tokens: int, chunk: int, chunk_tokens: int,
          out_of_range: int) -> np.ndarray:
    """The pool slots (page * page_size + offset) of a chunk's tokens; tokens past n_tokens get out_of_range."""
    t = chunk * chunk_tokens + np.arange(chunk_tokens)
    live = t < n_tokens
    t = np.where(live, t, 0)
    page = np.asarray(pages, np.int64)[t // page_size] if len(pages) else np.zeros_like(t)
    return np.where(live, page * page_size + t % page_size, out_of_range).astype(np.int32)


def _rank_shards(x: jax.Array, rank: int) -> list:
    """This process's shards of pool array x that hold rank `rank` (one per device of its group)."""
    return [s for s in x.addressable_shards if (s.index[0].start or 0) <= rank < (s.index[0].stop or x.shape[0])]


@jax.jit
def _gather(shard, slots_T):
    _, L, P, S, W = shard.shape
    return shard.reshape(L, P * S, W)[:, slots_T]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(shard, values, slots_T):
    _, L, P, S, W = shard.shape
    return shard.reshape(L, P * S, W).at[:, slots_T].set(values.astype(shard.dtype), mode="drop").reshape(shard.shape)


def read_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat) -> list[dict]:
    """A request's KV at `rank`'s pages, as `fmt.chunks(n_tokens)` chunks on one device of the rank."""
    out = []
    for c in range(fmt.chunks(n_tokens)):
        chunk = {}
        for name, x in cache.items():
            shard = _rank_shards(x, rank)[0]
            page_size = x.shape[3]
            idx = slots(pages, page_size, n_tokens, c, fmt.chunk_tokens, 0)  # padding reads slot 0: never used
            chunk[name] = _gather(shard.data, jax.device_put(idx, shard.device))
        out.append(chunk)
    return out


def write_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat,
                     chunks: list[dict]) -> dict:
    """The pool with a request's KV (`read_request_kv`'s chunks, on any device) written at `rank`'s pages;
    the rank's shards are updated in place and every other shard is kept as is."""
    new = {}
    for name, x in cache.items():
        page_size, num_pages = x.shape[3], x.shape[2]
        mine = {s.device for s in _rank_shards(x, rank)}
        arrays = []
        for s in x.addressable_shards:
            data = s.data
            if s.device in mine:
                for c, chunk in enumerate(chunks):
                    idx = slots(pages, page_size, n_tokens, c, fmt.chunk_tokens, num_pages * page_size)
                    data = _scatter(data, jax.device_put(chunk[name], s.device), jax.device_put(idx, s.device))
            arrays.append(data)
        new[name] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
    return new
