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

A split pool (`--dcp-size N`, `jaxdp.parallel.dcp`: [dp, tp, layers, pages, page_size / N, width], token p of a
sequence on the device of DCP rank p mod N of each subgroup, at local index p // N of its pages in table order)
travels in the same token-major chunks, so either side may be split or not, whatever the other's layout. A
device's part of a sequence is itself a sequence (local token q = p // N of the tokens p it owns) in pages of
page_size / N slots: writing picks each device's tokens out of the chunk on the device the chunk arrived on
(`_pick`: 1/N of it), moves that part to its device and writes it as an unsplit pool of that page size would be
written; reading gathers each DCP rank's part on its own device and interleaves the parts on one device
(`_interleave`).
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
        """The format of a pool ([dp, layers, pages, page_size, width], or split: [dp, tp, layers, ...])."""
        return cls(tuple(sorted((k, v.shape[-4], v.shape[-1], str(v.dtype)) for k, v in cache.items())),
                   chunk_tokens)

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


@dataclasses.dataclass(frozen=True)
class _Part:
    """DCP rank `rank`'s part of a chunk of a split pool (N = `dcp`, pages of `page_size` tokens): its tokens p
    (those with p mod N == rank) are the chunk's entries `src` (M = ceil(chunk_tokens / N) of them, 0 past the
    request's), their slots in the device's pool `slots` (page * page_size / N + offset // N), `live` of them the
    request's, moved in runs of `run` slots (a local page when a chunk holds whole pages, else one)."""

    src: np.ndarray
    slots: np.ndarray
    live: int
    run: int

    @classmethod
    def of(cls, pages: list[int], page_size: int, dcp: int, rank: int, n_tokens: int, chunk: int,
           fmt: KVFormat) -> _Part:
        C = fmt.chunk_tokens
        start = chunk * C
        first = start + (rank - start) % dcp  # the chunk's first token of this rank
        p = first + dcp * np.arange(-(-C // dcp))
        live_M = p < min(n_tokens, start + C)
        p = np.where(live_M, p, first if first < n_tokens else 0)
        page = np.asarray(pages, np.int64)[p // page_size] if len(pages) else np.zeros_like(p)
        local = page_size // dcp
        slots = page * local + p % page_size // dcp
        src = np.clip(p - start, 0, C - 1)
        return cls(src.astype(np.int32), slots.astype(np.int32), int(live_M.sum()),
                   local if C % page_size == 0 else 1)

    def starts(self) -> np.ndarray:
        return self.slots[:: self.run]

    def live_runs(self) -> np.int32:
        return np.int32(-(-self.live // self.run))


def _rank_shards(x: jax.Array, rank: int) -> list:
    """This process's shards of pool array x that hold rank `rank` (one per device of its group)."""
    return [s for s in x.addressable_shards if (s.index[0].start or 0) <= rank < (s.index[0].stop or x.shape[0])]


def _dcp_rank(shard, dcp: int) -> int:
    """The DCP rank of a split pool's shard (its tp index mod N)."""
    return (shard.index[1].start or 0) % dcp


@functools.partial(jax.jit, static_argnums=2)
def _gather(shard, starts_R, run: int):
    L, P, S, W = shard.shape[-4:]
    blocks = shard.reshape(L, P * S // run, run, W)[:, starts_R // run]  # whole pages: [L, R, run, W]
    return blocks.reshape(L, -1, W)


@jax.jit
def _pick(values_LCW, src_M):
    """A DCP rank's entries of a chunk [L, M, W] (on the device the chunk arrived on: 1/N of it moves on)."""
    return values_LCW[:, src_M]


@functools.partial(jax.jit, static_argnums=1)
def _interleave(parts, n_chunk: int):
    """The N parts of a chunk of a split pool (part d: the chunk's tokens c with (chunk start + c) mod N == d, in
    order; the chunk's start a multiple of N or not: `parts` rotated so that part 0 holds its first token)."""
    L, M, W = parts[0].shape
    return jnp.stack(parts, axis=2).reshape(L, M * len(parts), W)[:, :n_chunk]


# The write goes one run (a page) at a time, in a loop over the chunk's live runs: XLA:CPU lowers a scatter
# into the pool as a pass over the whole pool, 7x slower than a per-token loop on a 1.1 GiB float32 pool (a
# bf16 pool it widens to float32 either way, 2-11 s a chunk: keep bf16 pools to GPUs); the loop touches only
# the request's slots and needs no "drop" for the padding.
@functools.partial(jax.jit, donate_argnums=0, static_argnums=4)
def _scatter(shard, values, starts_R, live, run: int):
    L, P, S, W = shard.shape[-4:]
    values = values.astype(shard.dtype)

    def body(i, flat):
        block = jax.lax.dynamic_slice_in_dim(values, i * run, run, 1)
        return jax.lax.dynamic_update_slice_in_dim(flat, block, starts_R[i], 1)

    return jax.lax.fori_loop(0, live, body, shard.reshape(L, P * S, W)).reshape(shard.shape)


def read_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat,
                    chunks: range | None = None, dcp: int = 1) -> list[dict]:
    """A request's KV at `rank`'s pages, as `fmt.chunks(n_tokens)` chunks on one device of the rank (or only the
    chunks numbered in `chunks`: the KV of a part of the prompt, as it is read). `dcp`: the pool's --dcp-size
    (> 1: a split pool, each DCP rank's part gathered on its device and the parts interleaved on DCP rank 0's)."""
    out = []
    for c in range(fmt.chunks(n_tokens)) if chunks is None else chunks:
        chunk = {}
        for name, x in cache.items():
            if dcp == 1:
                shard = _rank_shards(x, rank)[0]
                starts = run_starts(pages, x.shape[3], n_tokens, c, fmt)
                chunk[name] = _gather(shard.data, jax.device_put(starts, shard.device), _run(x.shape[3], fmt))
                continue
            page_size = x.shape[-2] * dcp
            by_rank = {_dcp_rank(s, dcp): s for s in reversed(_rank_shards(x, rank))}  # (the first subgroup's)
            home = by_rank[0].device
            parts = []
            for d in range(dcp):
                part, s = _Part.of(pages, page_size, dcp, d, n_tokens, c, fmt), by_rank[d]
                got = _gather(s.data, jax.device_put(part.slots, s.device), 1)
                parts.append(jax.device_put(got, home))
            r = (c * fmt.chunk_tokens) % dcp  # (the DCP rank of the chunk's first token)
            chunk[name] = _interleave(parts[r:] + parts[:r], fmt.chunk_tokens)
        out.append(chunk)
    return out


def write_request_kv(cache: dict, rank: int, pages: list[int], n_tokens: int, fmt: KVFormat,
                     chunks: list[dict], first: int = 0, dcp: int = 1) -> dict:
    """The pool with a request's KV (`read_request_kv`'s chunks, on any device; the first of them the request's
    chunk number `first`) written at `rank`'s pages; the rank's shards are updated in place and every other
    shard is kept as is. `dcp`: the pool's --dcp-size (> 1: a split pool, each device given its own tokens)."""
    new = {}
    for name, x in cache.items():
        mine = {s.device for s in _rank_shards(x, rank)}
        parts: dict[tuple[int, int], tuple[_Part, jax.Array]] = {}  # (chunk, DCP rank): its tokens, picked once
        arrays = []
        for s in x.addressable_shards:
            data = s.data
            if s.device in mine:
                for c, chunk in enumerate(chunks, start=first):
                    if dcp == 1:
                        run = _run(x.shape[3], fmt)
                        starts = jax.device_put(run_starts(pages, x.shape[3], n_tokens, c, fmt), s.device)
                        data = _scatter(data, jax.device_put(chunk[name], s.device), starts,
                                        _live_runs(n_tokens, c, run, fmt), run)
                        continue
                    d = _dcp_rank(s, dcp)
                    if (c, d) not in parts:
                        part = _Part.of(pages, x.shape[-2] * dcp, dcp, d, n_tokens, c, fmt)
                        values = chunk[name]
                        parts[c, d] = part, _pick(values, jax.device_put(part.src, next(iter(values.devices()))))
                    part, values = parts[c, d]
                    data = _scatter(data, jax.device_put(values, s.device), jax.device_put(part.starts(), s.device),
                                    part.live_runs(), part.run)
            arrays.append(data)
        new[name] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
    return new
