"""The tensors of a safetensors checkpoint directory, read as slices in their stored dtype.

A directory holds one `*.safetensors` file, several, or a sharded set with `model.safetensors.index.json`.
Only the JSON headers are parsed up front (names, dtypes, shapes, byte offsets); a tensor's bytes are
read on demand with plain file reads of the rows asked for, so nothing is memory-mapped (mapped pages
would count in the process's resident memory) and no tensor is converted to float32. numpy has no
float8 and no bfloat16: those come from `ml_dtypes`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
READAHEAD = 256 << 20  # after each read the kernel is asked to fetch this much further on (while we copy)
ALIGN = 64  # XLA:CPU takes a host buffer without a copy when it is aligned like this
TILE = 128  # the side of the square tiles a transposing copy moves (a tile of both arrays stays in cache)
THREADED_BYTES = 1 << 20  # copies at least this big are split over threads (numpy drops the GIL while copying)
SPLIT = 8  # ... in this many interleaved parts (the pool's threads take them as they come free)


class CheckpointError(ValueError):
    """A checkpoint that does not hold what its config says: one sentence naming the tensor and file."""


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def aligned_copy(x: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    if x.flags.c_contiguous and x.ctypes.data % ALIGN == 0:
        return x
    out = aligned_empty(x.shape, x.dtype)
    copy_into(out, x, pool)
    return out


def copy_into(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor | None = None) -> None:
    """dst[...] = src (same shape), fast when src is a transposed view (torch's [out, in] read as our
    [in, out]): numpy's own transposing copy walks one side a whole row apart per element (a new page
    each time at these widths), so the copy goes in TILE x TILE tiles of src's contiguous axis and dst's
    last axis, spread over `pool`'s threads when it is big."""
    _run([(dst, src, t) for t in _tiles(dst, src)], pool)


def _tiles(dst: np.ndarray, src: np.ndarray) -> list[tuple[slice, ...]]:
    if src.shape != dst.shape:
        raise ValueError(f"copy of {src.shape} into {dst.shape}")
    if dst.size == 0:
        return []
    last = dst.ndim - 1
    moving = [k for k in range(src.ndim) if src.shape[k] > 1]
    fast = min(moving, key=lambda k: abs(src.strides[k])) if moving else last
    axes = [fast, last] if fast != last and src.shape[last] > 1 else []
    if not axes:  # rows contiguous in both: chunks of the leading axis
        axes = [0] if dst.ndim and dst.nbytes >= THREADED_BYTES else []
    steps = {a: TILE if len(axes) == 2 else max(1, (THREADED_BYTES // 2) * dst.shape[a] // dst.nbytes)
             for a in axes}
    tiles = []
    for starts in itertools.product(*(range(0, dst.shape[a], steps[a]) for a in axes)):
        at = dict(zip(axes, starts, strict=True))
        tiles.append(tuple(slice(at[a], at[a] + steps[a]) if a in at else slice(None) for a in range(dst.ndim)))
    return tiles


def _run(tasks: list[tuple[np.ndarray, np.ndarray, tuple]], pool: ThreadPoolExecutor | None) -> None:
    def run(part) -> None:
        for d, s, t in part:
            d[t] = s[t]

    if pool is None or len(tasks) < 2 or sum(d.nbytes for d, _, _ in tasks) < THREADED_BYTES:
        return run(tasks)
    list(pool.map(run, [tasks[i::SPLIT] for i in range(SPLIT)]))


def copy_pool() -> ThreadPoolExecutor:
    """The threads a load copies with (numpy drops the GIL while it copies): one per core, at most 4."""
    return ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="jaxdp-copy")


@dataclasses.dataclass
class Tiled:
    """A box held as the parts it was read in (e.g. one per expert and gate/up), each a view at an
    offset, never assembled: whoever places it copies each part once, straight into its destination."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: list[tuple[tuple[int, ...], np.ndarray]]  # (offset, array)

    @classmethod
    def stack(cls, items: list, axis: int) -> Tiled:
        """items (arrays or Tiled of one shape) stacked along a new `axis`."""
        parts = []
        for j, it in enumerate(items):
            for off, a in (it.parts if isinstance(it, Tiled) else [((0,) * it.ndim, it)]):
                parts.append(((*off[:axis], j, *off[axis:]), np.expand_dims(a, axis)))
        first = items[0]
        return cls((*first.shape[:axis], len(items), *first.shape[axis:]), np.dtype(first.dtype), parts)

    def astype(self, dtype) -> Tiled:
        return Tiled(self.shape, np.dtype(dtype), [(o, a.astype(dtype)) for o, a in self.parts])

    def transpose(self, perm: tuple[int, ...]) -> Tiled:
        return Tiled(tuple(self.shape[k] for k in perm), self.dtype,
                     [(tuple(o[k] for k in perm), a.transpose(perm)) for o, a in self.parts])


def memory_order(x: np.ndarray | Tiled) -> tuple[int, ...]:
    """x's axes in the order they lie in memory, outermost first (axes of one element first, as they come):
    the permutation under which its parts are row-major, i.e. how they lie in the checkpoint (a transposed
    view of torch's [out, in] gives (1, 0))."""
    def order(a: np.ndarray) -> tuple[int, ...]:
        return tuple(sorted(range(a.ndim), key=lambda k: (a.shape[k] > 1, -abs(a.strides[k]))))

    if not isinstance(x, Tiled):
        return order(x)
    orders = {order(a) for _, a in x.parts}
    return orders.pop() if len(orders) == 1 else tuple(range(len(x.shape)))  # parts that disagree: ours


def fill(dst: np.ndarray, src: np.ndarray | Tiled, index: tuple[slice, ...],
         pool: ThreadPoolExecutor | None = None) -> None:
    """dst[...] = src[index] (index: one slice with a step of 1 per dimension), one pass per part."""
    if not isinstance(src, Tiled):
        return copy_into(dst, src[index], pool)
    tasks = []
    for off, a in src.parts:
        lo = [max(s.start, o) for s, o in zip(index, off, strict=True)]
        hi = [min(s.stop, o + n) for s, o, n in zip(index, off, a.shape, strict=True)]
        if all(b > a_ for a_, b in zip(lo, hi, strict=True)):
            d = dst[tuple(slice(a_ - s.start, b - s.start) for a_, b, s in zip(lo, hi, index, strict=True))]
            s = a[tuple(slice(a_ - o, b - o) for a_, b, o in zip(lo, hi, off, strict=True))]
            tasks += [(d, s, t) for t in _tiles(d, s)]
    _run(tasks, pool)


def assemble(x: np.ndarray | Tiled) -> np.ndarray:
    if not isinstance(x, Tiled):
        return x
    out = aligned_empty(x.shape, x.dtype)
    fill(out, x, tuple(slice(0, n) for n in x.shape))
    return out


class Checkpoint:
    """Names, shapes and dtypes of every tensor of a checkpoint directory; `read` fetches a slice."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{model_dir} holds no .safetensors files; point --model-path at a "
                                        "Hugging Face checkpoint directory")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}  # name -> file, dtype, shape, a, b
        for fname in files:
            path = self.dir / fname
            if not path.exists():
                some = next(k for k, v in weight_map.items() if v == fname)
                raise CheckpointError(f"{index.name} puts {some!r} (and others) in {fname}, which is missing from "
                                      f"{self.dir}; download the whole checkpoint")
            header, n = _read_header(path)
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                begin, end = e["data_offsets"]
                self.entries[name] = (fname, e["dtype"], tuple(e["shape"]), 8 + n + begin, 8 + n + end)
        self._fds: dict[str, int] = {}
        self.pool = copy_pool()  # for whoever places what is read (copy_into, fill)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def where(self, name: str) -> str:
        return self.entries[name][0] if name in self.entries else str(self.dir)

    def shape(self, name: str) -> tuple[int, ...]:
        self._need(name)
        return self.entries[name][2]

    def dtype(self, name: str) -> np.dtype:
        self._need(name)
        code = self.entries[name][1]
        if code not in DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.where(name)} has dtype {code}, which jaxdp does not read")
        return np.dtype(DTYPES[code])

    def _need(self, name: str) -> None:
        if name not in self.entries:
            raise CheckpointError(f"the checkpoint in {self.dir} has no tensor {name!r}; it does not match its "
                                  "config.json (a different architecture or an incomplete download)")

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        if self.shape(name) != tuple(expected):
            raise CheckpointError(f"tensor {name!r} in {self.where(name)} has shape {list(self.shape(name))}, but "
                                  f"config.json implies {list(expected)}; the config does not belong to these weights")

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """tensor[index] in its stored dtype (aligned). Only the rows of the leading dimension that the
        index selects are read from disk; the other dimensions are sliced in memory."""
        self._need(name)
        fname, _, shape, begin, _ = self.entries[name]
        dtype = self.dtype(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not shape:
            rows = range(1)
        else:
            rows = range(*index[0].indices(shape[0]))
        row_elems = int(np.prod(shape[1:], dtype=np.int64))
        n_rows = len(rows)
        out = aligned_empty((n_rows, *shape[1:]) if shape else (), dtype)
        if n_rows and row_elems:
            assert rows.step == 1, "leading slices are contiguous"
            offset = begin + rows.start * row_elems * dtype.itemsize
            buf = out.reshape(-1).view(np.uint8)
            fd = self._fd(fname)
            done = 0
            while done < buf.size:  # pread may return fewer bytes than asked for
                got = os.preadv(fd, [memoryview(buf[done:done + (1 << 30)])], offset + done)
                if got <= 0:
                    raise CheckpointError(f"tensor {name!r} in {fname} is cut short; the file is truncated")
                done += got
            if hasattr(os, "posix_fadvise"):  # the next tensors are read from disk while this one is placed
                os.posix_fadvise(fd, offset + done, READAHEAD, os.POSIX_FADV_WILLNEED)
        if shape and any(s != slice(None) for s in index[1:]):
            out = aligned_copy(out[(slice(None), *index[1:])])
        return out

    def _fd(self, fname: str) -> int:
        if fname not in self._fds:
            self._fds[fname] = os.open(self.dir / fname, os.O_RDONLY)
        return self._fds[fname]

    def close(self) -> None:
        self.pool.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stored_float_dtype(model_dir: str | Path) -> str | None:
    """The floating dtype ("bfloat16", "float32", "float16", ...) that holds most of the bytes of a checkpoint
    directory's safetensors files (headers only), or None where `model_dir` holds none (a preset's name, an orbax
    conversion) or none of its tensors is a float of 16 or more bits (FP8 weights)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    size: dict[str, int] = {}
    for path in files:
        for name, e in _read_header(path)[0].items():
            if name != "__metadata__" and e.get("dtype") in ("F64", "F32", "F16", "BF16"):
                begin, end = e["data_offsets"]
                size[e["dtype"]] = size.get(e["dtype"], 0) + end - begin
    return np.dtype(DTYPES[max(size, key=size.get)]).name if size else None


def _read_header(path: Path) -> tuple[dict, int]:
    """(the header, its length) of a safetensors file; a file that is not one (a Git LFS pointer, a truncated
    download) is refused in one sentence."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            if not 0 < n <= size - 8:
                raise ValueError
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError
        except ValueError:
            raise CheckpointError(f"{path} is not a safetensors file (a Git LFS pointer or a truncated download?); "
                                  "fetch the real file, e.g. with git lfs pull") from None
    return header, n
