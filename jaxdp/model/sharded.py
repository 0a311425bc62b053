"""The model's parameters created directly in their final sharding, abstractly or from a checkpoint.

`param_table` says, per parameter, its shape, dtype, logical axes and PartitionSpec for a config, a layout and
a quantization: the one description of the state that `load_sharded` fills from safetensors (each device's
piece read as a slice, `jax.make_array_from_callback`), `init_sharded` fills with random weights, and
`abstract_state` turns into `jax.ShapeDtypeStruct`s (for compiling the step without weights). All of it is
read off the abstract model: the axes as each weight declared them where the model creates it, the specs
the step's own rules make of them (`jaxdp.parallel.sharding`).

The layer stacks [L, ...] are never assembled on the host: each is created on the mesh once (zeros),
then every layer's piece is read and written into it in place (a donated dynamic_update_slice). On a GPU a
piece goes to its device in the order it is stored (torch's [out, in]: the host copies only contiguous
runs) and the update transposes it there; on a CPU the host transposes as it copies. A device
piece is read once per call and shared by the devices that hold the same index (replicas); each process
reads only what its own devices hold. Peak host memory is two parameters of one layer (the one placed,
the next one read meanwhile) beyond what the devices hold (on a CPU the devices' buffers are host memory;
an aligned piece is taken without a copy).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxdp.config import ModelConfig, load_hf_config
from jaxdp.layout import Layout
from jaxdp.model import fp8, modelopt
from jaxdp.model.checkpoint import Checkpoint, CheckpointError, Tiled, aligned_copy, aligned_empty, fill, memory_order
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.layers import axes_of
from jaxdp.model.mtp import MTPLayer, apply_mtp_quantization, mtp_prefix
from jaxdp.model.quant import apply_quantization, resolve_quantization
from jaxdp.model.sources import Box, mtp_sources, sources
from jaxdp.parallel.sharding import check_divisible, state_specs

log = logging.getLogger("jaxdp.loader")
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: P
    axes: tuple[str, ...] = ()  # the logical axes the weight declared ("layers" first in a stack)


@dataclasses.dataclass
class ShardedModel:
    """A model's graph and its state, every array already in its final sharding on `mesh`."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State

    def merge(self) -> DeepseekV3:
        return nnx.merge(self.graphdef, self.state)


def _dotted(path) -> str:
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def abstract_model(cfg: ModelConfig, dtype, quantization: str | None = None) -> DeepseekV3:
    """The model's structure (shapes and dtypes, no values) with its quantization applied."""
    cfg, method = resolve_quantization(cfg, quantization)
    return nnx.eval_shape(lambda: apply_quantization(DeepseekV3(cfg, nnx.Rngs(0), dtype), method))


def param_table(cfg: ModelConfig, layout: Layout, dtype, quantization: str | None = None) -> dict[str, ParamInfo]:
    """{dotted path: shape, dtype, PartitionSpec, logical axes} of every parameter (stacks with their layer axis)."""
    return table_of(abstract_model(cfg, dtype, quantization), layout)


def table_of(abstract, layout: Layout) -> dict[str, ParamInfo]:
    """`param_table` of an abstract module (the model, or its MTP layer)."""
    _, state = nnx.split(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    specs = jax.tree.leaves(state_specs(state, layout), is_leaf=lambda x: isinstance(x, P))
    return {_dotted(p): ParamInfo(tuple(v.get_value().shape), np.dtype(v.get_value().dtype), s,
                                  axes_of(v))
            for (p, v), s in zip(leaves, specs, strict=True)}


def abstract_mtp(cfg: ModelConfig, dtype, quantization: str | None = None) -> MTPLayer:
    """An MTP layer's structure (shapes and dtypes, no values) with its quantization applied."""
    cfg, method = resolve_quantization(cfg, quantization)
    return nnx.eval_shape(lambda: apply_mtp_quantization(MTPLayer(cfg, nnx.Rngs(0), dtype), method))


def abstract_state(cfg: ModelConfig, layout: Layout, mesh, dtype, quantization: str | None = None):
    """(graphdef, state of jax.ShapeDtypeStruct with their NamedSharding on `mesh`)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, quantization))
    table = param_table(cfg, layout, dtype, quantization)
    return graphdef, jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, table[_dotted(p)].spec)),
        state)


def check_fp8_split(table: dict[str, ParamInfo], mesh, layout: Layout, block: int | None) -> None:
    """Every FP8 weight must split into whole scale blocks on every device."""
    for path, info in table.items():
        if not path.endswith(fp8.SCALE_SUFFIX):
            continue
        w = table[path.removesuffix(fp8.SCALE_SUFFIX)]
        for ax, (wd, sd) in enumerate(zip(w.shape, info.shape, strict=True)):
            parts = _parts(w.spec, ax, mesh)
            if wd != sd and parts > 1 and (wd // parts) % block:
                raise ValueError(f"the FP8 weight {path.removesuffix(fp8.SCALE_SUFFIX)} ({wd} wide along axis {ax}) "
                                 f"does not split into whole {block}-wide scale blocks over {parts} devices under "
                                 f"--mesh {layout.spec()}; choose a layout that splits it less")


def _parts(spec: P, ax: int, mesh) -> int:
    names = tuple(spec) + (None,) * 8
    axes = names[ax]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def _layer_spec(spec: P, ndim: int) -> P:
    return P(*(tuple(spec) + (None,) * (ndim - len(spec)))[1:])


def _box(sharding: NamedSharding, shape: tuple[int, ...]) -> Box:
    """The smallest box holding every piece this process's devices need."""
    idx = [tuple(s.indices(d)[:2] for s, d in zip(ix, shape, strict=True))
           for ix in sharding.addressable_devices_indices_map(shape).values()]
    return tuple(slice(min(i[a][0] for i in idx), max(i[a][1] for i in idx)) for a in range(len(shape)))


def _place(arr: np.ndarray | Tiled, box: Box, shape: tuple[int, ...], sharding: NamedSharding,
           pool: ThreadPoolExecutor | None = None) -> jax.Array:
    """An array of `shape` on the mesh from the host box `arr` that covers this process's pieces."""
    pieces: dict[tuple, np.ndarray] = {}

    def piece(index) -> np.ndarray:
        key = _key(index, shape)
        if key not in pieces:  # replicas share one read (and on a CPU one buffer)
            rel = tuple(slice(a - b.start, z - b.start) for (a, z), b in zip(key, box, strict=True))
            if isinstance(arr, Tiled):
                pieces[key] = aligned_empty(tuple(z - a for a, z in key), arr.dtype)
                fill(pieces[key], arr, rel, pool)
            else:
                pieces[key] = aligned_copy(arr[rel], pool)
        return pieces[key]

    return jax.make_array_from_callback(shape, sharding, piece)


def _permuted(sharding: NamedSharding, perm: tuple[int, ...]) -> NamedSharding:
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*(spec[k] for k in perm)))


def _place_as_stored(arr: np.ndarray | Tiled, box: Box, shape: tuple[int, ...], sharding: NamedSharding,
                     pool: ThreadPoolExecutor | None = None) -> tuple[jax.Array, tuple[int, ...]]:
    """(`arr` on the mesh in the order its values lie in the checkpoint, the permutation back to ours): the
    host copies only contiguous runs, and whoever takes the array transposes it on the devices."""
    perm = memory_order(arr)
    if perm == tuple(range(len(shape))):
        return _place(arr, box, shape, sharding, pool), perm
    x = _place(arr.transpose(perm), tuple(box[k] for k in perm), tuple(shape[k] for k in perm),
               _permuted(sharding, perm), pool)
    return x, tuple(int(k) for k in np.argsort(perm))


class _Transposes:
    """The compiled transposes into our layout (one per permutation and sharding), for the devices' path."""

    def __init__(self):
        self._fns: dict = {}

    def __call__(self, x: jax.Array, back: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
        if back == tuple(range(len(back))):
            return x
        key = (back, sharding)
        if key not in self._fns:
            self._fns[key] = jax.jit(lambda a: jnp.transpose(a, back), out_shardings=sharding)
        return self._fns[key](x)


def load_sharded(model_dir: str | Path, layout: Layout, mesh, dtype=jnp.bfloat16, quantization: str | None = None,
                 cfg: ModelConfig | None = None, transpose_on_devices: bool | None = None) -> ShardedModel:
    """A Hugging Face checkpoint (bf16/fp32, block-FP8 kept FP8, ModelOpt NVFP4 experts kept NVFP4) read
    straight into its sharding on `mesh`. Every tensor is checked against the config before anything
    is allocated."""
    dtype = jnp.dtype(dtype)
    mo_config, cfg = _checkpoint_config(model_dir, cfg)
    with Checkpoint(model_dir) as ck:
        stored_nvfp4 = mo_config is not None and modelopt.experts_are_nvfp4(ck.__contains__, cfg)
        quantization = "nvfp4" if stored_nvfp4 else quantization
        cfg, method = resolve_quantization(cfg, quantization)
        check_divisible(cfg, layout, method)
        abstract = abstract_model(cfg, dtype, quantization)
        table = table_of(abstract, layout)
        input_scales: list[np.ndarray] = []
        top, stacks = sources(cfg, _layer_shapes(table), nvfp4_stored=stored_nvfp4, input_scales=input_scales)
        first = {"dense_layers": 0, "moe_layers": cfg.num_dense_layers}
        counts = {"dense_layers": cfg.num_dense_layers, "moe_layers": cfg.num_moe_layers}
        arrays = _check_and_read(ck, cfg, table, top, stacks, first, counts, layout, mesh, transpose_on_devices)
    return _finish(cfg, abstract, arrays, input_scales)


def load_mtp_sharded(model_dir: str | Path, layout: Layout, mesh, dtype=jnp.bfloat16, quantization: str | None = None,
                     cfg: ModelConfig | None = None, k: int = 0,
                     transpose_on_devices: bool | None = None) -> ShardedModel:
    """MTP layer k of a checkpoint (`jaxdp.model.mtp.MTPLayer`, stored as layer num_hidden_layers + k) read
    like the main layers: block-FP8 kept FP8; its experts NVFP4 when the checkpoint stores them so, else as
    `quantization` asks (ModelOpt exports usually leave the MTP layer unquantized). A checkpoint that lacks
    the layer is refused in one sentence (`check_mtp`)."""
    dtype = jnp.dtype(dtype)
    mo_config, cfg = _checkpoint_config(model_dir, cfg)
    with Checkpoint(model_dir) as ck:
        check_mtp(ck, cfg, k)
        prefix = mtp_prefix(cfg, k)
        stored_nvfp4 = mo_config is not None and f"{prefix}.mlp.experts.0.gate_proj.weight_scale_2" in ck
        quantization = "nvfp4" if stored_nvfp4 else quantization
        cfg, method = resolve_quantization(cfg, quantization)
        check_divisible(cfg, layout, method)
        abstract = abstract_mtp(cfg, dtype, quantization)
        table = table_of(abstract, layout)
        input_scales: list[np.ndarray] = []
        top, stacks = mtp_sources(cfg, _layer_shapes(table), prefix, nvfp4_stored=stored_nvfp4,
                                  input_scales=input_scales)
        first, counts = {s: cfg.num_layers + k for s in stacks}, {s: 1 for s in stacks}
        arrays = _check_and_read(ck, cfg, table, top, stacks, first, counts, layout, mesh, transpose_on_devices)
    return _finish(cfg, abstract, arrays, input_scales)


def check_mtp(ck: Checkpoint, cfg: ModelConfig, k: int = 0) -> None:
    """Refuse, in one sentence, a checkpoint without MTP layer k. An MTP layer that stores an embedding or head
    differing from the main model's is served with the main model's all the same (as SGLang does; only the
    acceptance of drafts can suffer), with a warning."""
    n, prefix = cfg.num_nextn_predict_layers, mtp_prefix(cfg, k)
    if k >= n:
        raise CheckpointError(f"{ck.dir}/config.json declares num_nextn_predict_layers={n}, so the checkpoint has "
                              f"no MTP layer {k}; use a checkpoint that ships its MTP (NextN) layer")
    names = [f"{prefix}.{t}.weight" for t in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "input_layernorm")]
    missing = [name for name in names if name not in ck]
    if missing:
        raise CheckpointError(f"{ck.dir}/config.json declares num_nextn_predict_layers={n}, but the checkpoint lacks "
                              f"the MTP layer's tensors ({missing[0]!r} among {len(missing)} of {len(names)} looked "
                              "for); use a checkpoint that ships its MTP layer (many quantized re-uploads drop it), "
                              "or serve without speculative decoding")
    main_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for own, main in ((f"{prefix}.embed_tokens.weight", "model.embed_tokens.weight"),
                      (f"{prefix}.shared_head.head.weight", main_head)):
        if own in ck and main in ck and not _same_rows(ck, own, main):
            log.warning("%r in %s differs from the main model's %r; the MTP layer uses the main model's (as SGLang "
                        "does), so fewer drafts may be accepted", own, ck.where(own), main)


def _same_rows(ck: Checkpoint, a: str, b: str, rows: int = 8) -> bool:
    """Whether two [V, D] tensors have the same shape and the same first and last rows (a cheap identity check:
    two full copies of a vocab x hidden matrix are not read for it)."""
    if ck.shape(a) != ck.shape(b):
        return False
    V = ck.shape(a)[0]
    boxes = [(slice(0, min(rows, V)),), (slice(max(V - rows, 0), V),)]
    return all(np.array_equal(ck.read(a, box).astype(np.float32), ck.read(b, box).astype(np.float32))
               for box in boxes)


def _checkpoint_config(model_dir, cfg: ModelConfig | None):
    mo_config = modelopt.read_quant_config(model_dir)
    cfg = cfg or (modelopt.load_config(model_dir) if mo_config else load_hf_config(model_dir))
    if cfg.fp8_block and cfg.fp8_block[0] != cfg.fp8_block[1]:
        raise ValueError(f"{model_dir}/config.json declares FP8 blocks of {list(cfg.fp8_block)}; jaxdp reads square "
                         "blocks (DeepSeek's [128, 128])")
    return mo_config, cfg


def _layer_shapes(table: dict[str, ParamInfo]) -> dict[str, tuple[int, ...]]:
    """Per parameter its shape, the stacks' per layer (stack axis dropped)."""
    return {p: i.shape[1:] if i.axes[:1] == ("layers",) else i.shape for p, i in table.items()}


def _check_and_read(ck, cfg, table, top, stacks, first, counts, layout, mesh, transpose_on_devices):
    """Check every source's tensors against the config, then read and place them all."""
    for src in top:
        src.check(ck, "")
    for stack, srcs in stacks.items():
        for i in range(first[stack], first[stack] + counts[stack]):
            for src in srcs:
                src.check(ck, f"model.layers.{i}")
    check_fp8_split(table, mesh, layout, cfg.fp8_block[0] if cfg.fp8_block else None)
    on_devices = mesh.devices.flat[0].platform != "cpu" if transpose_on_devices is None else transpose_on_devices
    return _read_all(ck, table, top, stacks, mesh, first, counts, on_devices)


def _finish(cfg: ModelConfig, abstract, arrays: dict[str, jax.Array], input_scales: list) -> ShardedModel:
    if input_scales:
        log.info(modelopt.describe_input_scales(input_scales))
    graphdef, astate = nnx.split(abstract)
    state = jax.tree_util.tree_map_with_path(lambda p, x: arrays[_dotted(p)], astate)
    return ShardedModel(cfg, graphdef, state)


def _read_all(ck: Checkpoint, table, top, stacks, mesh, first, counts, on_devices: bool) -> dict[str, jax.Array]:
    """Every parameter read and placed in order, the next one read (in a thread) while this one is
    placed: one parameter of one layer ahead at most. `on_devices`: torch's [out, in] goes to the devices as
    stored and is transposed there (a GPU's memory does that at hundreds of GB/s, where the host's
    transposing copies manage about one per core); else the host transposes as it copies (on a CPU, where
    the devices' buffers are host memory and replicas share one)."""
    total = sum(int(np.prod(i.shape, dtype=np.int64)) * i.dtype.itemsize for i in table.values())
    transposes = _Transposes()
    arrays: dict[str, jax.Array] = {}
    layers: dict[str, _Stack] = {}
    jobs = [(src, "", False, 0) for src in top] + [
        (src, f"model.layers.{first[stack] + j}", True, j)
        for stack, srcs in stacks.items() for j in range(counts[stack]) for src in srcs]

    def where(src, stacked: bool):
        shardings = {p: NamedSharding(mesh, _layer_spec(table[p].spec, len(table[p].shape)) if stacked
                                      else table[p].spec) for p in src.paths}
        shapes = {p: table[p].shape[1:] if stacked else table[p].shape for p in src.paths}
        return shardings, shapes, {p: _box(shardings[p], shapes[p]) for p in src.paths}

    def read(job) -> dict:
        src, pre, stacked, _ = job
        return src.read(ck, pre, where(src, stacked)[2])

    def put(job, got: dict) -> None:
        src, _, stacked, layer = job
        shardings, shapes, boxes = where(src, stacked)
        for p in src.paths:
            info, host = table[p], got.pop(p)
            if host.dtype != info.dtype:
                host = host.astype(info.dtype)
            if not stacked and on_devices:
                arrays[p] = transposes(*_place_as_stored(host, boxes[p], shapes[p], shardings[p], ck.pool),
                                       shardings[p])
            elif not stacked:
                arrays[p] = _place(host, boxes[p], shapes[p], shardings[p], ck.pool)
            else:
                if p not in layers:
                    layers[p] = _Stack(info, NamedSharding(mesh, info.spec), shardings[p], not on_devices)
                layers[p].set(layer, host, boxes[p], ck.pool)
            del host
            bar.update(int(np.prod(shapes[p], dtype=np.int64)) * info.dtype.itemsize)

    with (tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True, disable=total < GiB) as bar,
          ThreadPoolExecutor(1, thread_name_prefix="jaxdp-read") as reader):
        ahead = reader.submit(read, jobs[0]) if jobs else None
        for i, job in enumerate(jobs):
            got = ahead.result()
            ahead = reader.submit(read, jobs[i + 1]) if i + 1 < len(jobs) else None
            put(job, got)
            del got
    return arrays | {p: s.done() for p, s in layers.items()}


class _Stack:
    """A stacked [L, ...] parameter filled one layer at a time. On a GPU it is created on the devices
    (zeros) and each layer's array, placed as stored, is transposed into it in place (one donated update).
    On a CPU (`host_pieces`) a device's buffer is host memory: each distinct device piece of the whole stack
    is an aligned host buffer, filled layer by layer and taken by the devices without a copy at the end
    (replicas share one)."""

    def __init__(self, info: ParamInfo, sharding: NamedSharding, layer_sharding: NamedSharding, host_pieces: bool):
        self.info, self.sharding, self.layer_sharding = info, sharding, layer_sharding
        self.layer_shape = info.shape[1:]
        self.pieces: dict[tuple, np.ndarray] | None = None
        self.array = None
        if host_pieces:
            idx = sharding.addressable_devices_indices_map(info.shape).values()
            keys = {_key(ix[1:], self.layer_shape) for ix in idx}
            self.pieces = {k: aligned_empty((info.shape[0], *(b - a for a, b in k)), info.dtype) for k in keys}
        else:
            self.array = jax.jit(lambda: jnp.zeros(info.shape, info.dtype), out_shardings=sharding)()
            self.updates: dict[tuple[int, ...], Callable] = {}  # per permutation back to our layout

    def set(self, layer: int, host: np.ndarray | Tiled, box: Box, pool: ThreadPoolExecutor | None = None) -> None:
        if self.pieces is None:
            x, back = _place_as_stored(host, box, self.layer_shape, self.layer_sharding, pool)
            if back not in self.updates:
                self.updates[back] = jax.jit(
                    lambda s, v, i: jax.lax.dynamic_update_index_in_dim(s, jnp.transpose(v, back), i, 0),
                    donate_argnums=0, out_shardings=self.sharding)
            self.array = self.updates[back](self.array, x, jnp.int32(layer))
            return
        for key, piece in self.pieces.items():
            fill(piece[layer], host, tuple(slice(a - b.start, z - b.start) for (a, z), b in zip(key, box, strict=True)),
                 pool)

    def done(self) -> jax.Array:
        if self.pieces is None:
            return self.array
        return jax.make_array_from_callback(self.info.shape, self.sharding,
                                            lambda ix: self.pieces[_key(ix[1:], self.layer_shape)])


def _key(index, shape) -> tuple:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def init_sharded(cfg: ModelConfig, layout: Layout, mesh, dtype=jnp.float32, seed: int = 0,
                 quantization: str | None = None) -> ShardedModel:
    """Random weights (seeded), each array created by the devices in its final sharding."""
    rcfg, method = resolve_quantization(cfg, quantization)
    check_divisible(rcfg, layout, method)
    if rcfg.fp8_block:  # (a block-FP8 weight split into pieces of a scale block: one sentence, before allocating)
        check_fp8_split(param_table(cfg, layout, dtype, quantization), mesh, layout, rcfg.fp8_block[0])
    graphdef, astate = abstract_state(cfg, layout, mesh, dtype, quantization)
    shardings = jax.tree.map(lambda x: x.sharding, astate)

    def build():
        return nnx.split(apply_quantization(DeepseekV3(rcfg, nnx.Rngs(seed), dtype), method))[1]

    return ShardedModel(rcfg, graphdef, jax.jit(build, out_shardings=shardings)())


def init_mtp_sharded(cfg: ModelConfig, layout: Layout, mesh, dtype=jnp.float32, seed: int = 0,
                     quantization: str | None = None) -> ShardedModel:
    """An MTP layer with random weights (seeded), created by the devices in its final sharding."""
    rcfg, method = resolve_quantization(cfg, quantization)
    check_divisible(rcfg, layout, method)
    abstract = abstract_mtp(cfg, dtype, quantization)
    graphdef, astate = nnx.split(abstract)
    table = table_of(abstract, layout)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, table[_dotted(p)].spec), astate)

    def build():
        return nnx.split(apply_mtp_quantization(MTPLayer(rcfg, nnx.Rngs(seed), dtype), method))[1]

    return ShardedModel(rcfg, graphdef, jax.jit(build, out_shardings=shardings)())


def shard_model(model: DeepseekV3, layout: Layout, mesh) -> ShardedModel:
    """A model already in memory (e.g. restored from orbax) moved onto the mesh in the step's sharding."""
    if model.cfg.fp8_block:
        check_fp8_split(table_of(model, layout), mesh, layout, model.cfg.fp8_block[0])
    graphdef, state = nnx.split(model)
    specs = state_specs(state, layout)
    return ShardedModel(model.cfg, graphdef,
                        jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs))


def weight_bytes_per_device(state) -> dict[str, int]:
    """Bytes of weights one device holds, by dtype (every device holds the same under these specs)."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(state):
        shard = x.sharding.shard_shape(x.shape)
        name = jnp.dtype(x.dtype).name
        out[name] = out.get(name, 0) + int(np.prod(shard, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
    return out


def describe_weight_bytes(state) -> str:
    by = weight_bytes_per_device(state)
    parts = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    return f"weights per device: {sum(by.values()) / GiB:.2f} GiB ({parts})"
