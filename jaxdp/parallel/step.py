"""One compiled step: a single `shard_map` over the whole mesh, with the collectives written out.

Per rank, the step reads as the article's Figure 3: attention on the rank's own rows (heads split
over the group's tp, an all-reduce inside the group), the gather, the MoE on all gathered rows (or
dispatch/combine under EP), the return, and after the last layer the LM head. A compiled step is
keyed by its `StepShape` (kind, bucket, gather mode): every rank runs the same shape.

The model state and the paged latent cache live on the mesh: the cache has a leading `dp` axis (one
cache per attention group, replicated on the group's tp devices); per-rank step inputs are stacked
on the same leading axis.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.batch import STEP_FIELDS, STEP_SPEC, step_sizes
from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.recorder import ExpertRecorder
from jaxdp.eplb.slots import check_map, held_physical_to_logical
from jaxdp.layout import Layout
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.indexer import fp8_key_width
from jaxdp.model.mla import AttnBatch
from jaxdp.model.mtp import MTPLayer, mtp_layer_is_moe
from jaxdp.model.quant import expert_quantization, with_moe_runner_backend
from jaxdp.model.sharded import ShardedModel
from jaxdp.parallel.accounting import StepAccount, account_step
from jaxdp.parallel.dcp import DCPError, SplitContext, check_dcp_pool, split_pool_spec
from jaxdp.parallel.draft_kv import DRAFT_PREFIX, split_draft
from jaxdp.parallel.packing import Layout as PackedLayout
from jaxdp.parallel.packing import pack, packed_layout, unpack, width
from jaxdp.parallel.places import ALL, GatherSpec, MeshComm, ragged_a2a_on
from jaxdp.parallel.sharding import check_divisible, lm_head_mode, shard_state, state_specs
from jaxdp.parallel.spec_step import build_spec_step, spec_abstract_args
from jaxdp.parallel.tbo import micro_batches
from jaxdp.parallel.tbo_split import split_rows


@dataclasses.dataclass(frozen=True)
class StepShape:
    absorbed: bool  # decode (absorbed MLA) or extend (expanded MLA)
    num_rows: int  # T per rank
    num_seqs: int  # B per rank
    pages_per_seq: int  # N
    gather_mode: str = "max_len"  # "max_len" | "sum_len"
    sum_rows: int = 0  # SUM_LEN buffer rows
    all_logits: bool = False  # logits of every token row (checking numbers), not one per sequence
    draft_tokens: int = 0  # a speculative step (jaxdp.parallel.spec_step): verify, accept and draft this many
    micro_rows: int = 0  # two-batch overlap: rows of each of two micro-batches (jaxdp.parallel.tbo); 0: whole

    @property
    def num_logits(self) -> int:
        return self.num_rows if self.all_logits else self.num_seqs

    @property
    def num_requests(self) -> int:
        """A speculative step's requests per rank: its sequences, or in the absorbed form (a verify of every
        row as a sequence of its own) its rows over draft_tokens + 1."""
        if self.draft_tokens and self.absorbed:
            return self.num_rows // (self.draft_tokens + 1)
        return self.num_seqs

    @property
    def kind(self) -> str:
        if self.draft_tokens:
            return "spec"
        return "decode" if self.absorbed else "extend"


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a StepRunner builds its steps and pool (its constructor takes these fields as keywords too).

    token_carry: width of the previous step's sampled tokens a step can read on the device (the engine's
    overlap: a decode row whose input token is still in flight refers to it by index). abstract: the model
    holds ShapeDtypeStructs (`nnx.eval_shape`); the weights and the pool stay ShapeDtypeStructs with their
    shardings, nothing is allocated, and the runner can only `lower` and `compile` steps (`plan --compile`
    checks full-size models this way). index_key_dtype (DSA models): None keeps the index keys in the cache
    dtype; "fp8" packs each as e4m3 values plus one fp32 scale per 128 (jaxdp.model.indexer.pack_fp8_keys)."""

    cache_dtype: object = None  # the KV pool's dtype (None: the embedding's)
    decode_kernel: object = None  # MLA decode (jaxdp.ops.attention.decode_kernels)
    moe_backend: str | None = None  # one of MOE_RUNNER_BACKENDS: how the experts multiply (jaxdp.model.moe)
    token_carry: int = 1
    abstract: bool = False
    index_key_dtype: str | None = None
    dcp_size: int = 1  # --dcp-size: the pool split token-wise over DCP subgroups of the group's tp (parallel.dcp)

    def __post_init__(self):
        if self.index_key_dtype not in (None, "fp8"):
            raise ValueError(f"index_key_dtype {self.index_key_dtype!r} is not None or 'fp8'")


class StepRunner:
    """Holds the sharded weights and caches of one model copy and runs compiled steps on them."""

    def __init__(self, model: DeepseekV3 | ShardedModel, layout: Layout, mesh, *, num_pages: int, page_size: int,
                 options: StepOptions | None = None, draft: MTPLayer | ShardedModel | None = None, **option_fields):
        """model: its state already in its final sharding on `mesh` (`jaxdp.model.sharded`, how the entry
        points build it), or a model in memory, moved onto the mesh here. The runner owns the paged pool:
        `num_pages` pages of `page_size` tokens per DP rank. `options` (or its fields as keywords): StepOptions.
        draft: the model's MTP layer (speculative decoding's draft model, `jaxdp.parallel.spec_step`), placed the
        same way; its draft KV lives in the same pages as entries "mtp_*" of the pool."""
        o = dataclasses.replace(options or StepOptions(), **option_fields)
        self.index_key_dtype = o.index_key_dtype
        placed, model = isinstance(model, ShardedModel), model.merge() if isinstance(model, ShardedModel) else model
        self.cfg = model.cfg
        self.token_carry = o.token_carry
        self.penalty_slots = 1  # a rank's slots of the penalty state its speculative steps read (ensure_penalty_slots)
        self.layout = layout
        self.mesh = mesh
        # the mesh spans processes (several nodes): each process feeds and reads only its own devices
        self.multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.num_pages, self.page_size = num_pages, page_size
        self.decode_kernel = o.decode_kernel
        self.dcp_size = o.dcp_size
        if o.dcp_size != 1:  # each device's pool holds page_size / dcp slots of every page (jaxdp.parallel.dcp)
            check_dcp_pool(o.dcp_size, layout.tp, page_size)
            if self.cfg.index_topk or draft is not None:
                raise DCPError(f"--dcp-size {o.dcp_size} is built for dense MLA without speculative decoding; drop "
                               "--dcp-size for a sparse-attention model or with --speculative-algorithm.")
            self.decode_kernel = SplitContext(o.dcp_size, layout.tp)
        self.expert_quantization = expert_quantization(model)
        check_divisible(self.cfg, layout, self.expert_quantization)
        self.abstract = o.abstract
        self.graphdef, self.state, self.state_specs = _place(model, placed, layout, mesh, o)
        self.draft_graphdef = self.draft_state = self.draft_specs = None
        if draft is not None:  # (the MTP layer's experts multiply as the layers' do)
            self.draft_graphdef, self.draft_state, self.draft_specs = _place(
                draft.merge() if isinstance(draft, ShardedModel) else draft, isinstance(draft, ShardedModel), layout,
                mesh, o)
        self.cache_dtype = o.cache_dtype or model.embed_VD.get_value().dtype
        self.cache = self._empty_cache(self.cache_dtype)
        self._no_prev = None  # the previous tokens of a step that refers to none (zeros, on the mesh)
        self._compiled: dict[StepShape, object] = {}
        self.compiles = 0  # executables built; the engine proves no request triggers one after warm-up
        self.compile_seconds = 0.0
        self.last_account: StepAccount | None = None  # the accounting of the last step that ran
        # the plain steps' routed tokens per device, MoE layer and expert (jaxdp.eplb.recorder): the last step's, and
        # their sum while recording
        self.counts_spec = jax.ShapeDtypeStruct((layout.world, self.cfg.num_moe_layers, self.cfg.n_routed_experts),
                                                jnp.int32, sharding=NamedSharding(mesh, P(ALL)))
        self.experts = ExpertRecorder(self.counts_spec if self.cfg.num_moe_layers and not o.abstract else None)
        self.last_expert_counts: jax.Array | None = None

    def _cache_entries(self, dtype) -> dict[str, tuple[int, int, object]]:
        """The paged pool's arrays per stack: (layers, values per token, dtype). DSA models also hold one index key
        per token per layer in the same pages (fp8: e4m3 values plus one fp32 scale per 128, packed as bytes)."""
        cfg = self.cfg
        entries = {"dense": (cfg.num_dense_layers, cfg.kv_cache_dim, dtype),
                   "moe": (cfg.num_moe_layers, cfg.kv_cache_dim, dtype)}
        if cfg.index_topk:
            key = (fp8_key_width(cfg.index_key_dim), jnp.uint8) if self.index_key_dtype == "fp8" else (
                cfg.index_key_dim, dtype)
            entries |= {"dense_index": (cfg.num_dense_layers, *key), "moe_index": (cfg.num_moe_layers, *key)}
        if self.draft_graphdef is not None:  # the MTP layer's draft KV: one layer, in the same pages
            name = "moe" if mtp_layer_is_moe(cfg) else "dense"
            entries[f"{DRAFT_PREFIX}{name}"] = (1, cfg.kv_cache_dim, dtype)
            if cfg.index_topk:
                entries[f"{DRAFT_PREFIX}{name}_index"] = (1, cfg.index_key_dim, dtype)
        return entries

    @property
    def cache_spec(self) -> P:
        """How the pool lies on the mesh: one per attention group, or split over its devices (--dcp-size)."""
        return split_pool_spec() if self.dcp_size > 1 else P("dp")

    @property
    def pool_bytes_per_token(self) -> int:
        """What one token takes in a rank's pool, over all layers (latent entries and index keys)."""
        total = sum(n * w * np.dtype(dt).itemsize for n, w, dt in self._cache_entries(self.cache_dtype).values())
        return -(-total // self.dcp_size)  # (on one device: a split pool holds 1/dcp of each token's group)

    def _empty_cache(self, dtype) -> dict:
        """The paged pool per stack: [dp, layers, pages, page_size, width] (see _cache_entries); split by --dcp-size,
        [dp, tp, layers, pages, page_size / dcp_size, width], each device its own part (`jaxdp.parallel.dcp`)."""
        dp, sharding = self.layout.dp, NamedSharding(self.mesh, self.cache_spec)
        split = (self.layout.tp,) if self.dcp_size > 1 else ()
        shapes = {k: ((dp, *split, n, self.num_pages, self.page_size // self.dcp_size, w), dt)
                  for k, (n, w, dt) in self._cache_entries(dtype).items()}
        if self.abstract:
            return {k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, (shape, dt) in shapes.items()}
        make = jax.jit(lambda shape, dt: jnp.zeros(shape, dt), static_argnums=(0, 1), out_shardings=sharding)
        return {k: make(shape, dt) for k, (shape, dt) in shapes.items()}

    def put(self, x: np.ndarray, spec: P | None = None) -> jax.Array:
        """A host array onto the mesh. Across processes each one supplies only its own devices' part (the
        rows of its DP ranks; the other ranks' rows of `x` are never read)."""
        sharding = NamedSharding(self.mesh, P("dp") if spec is None else spec)
        if not self.multi_process:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def local_values(self, x: jax.Array) -> np.ndarray:
        """A step output [dp, ...] back on the host; across processes only this process's ranks' rows are
        filled (the rest are zeros)."""
        if x.is_fully_addressable:
            return np.asarray(x)
        out = np.zeros(x.shape, x.dtype)
        for shard in x.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
        return out

    def close(self) -> None:
        """Free the weights, the caches and the executables."""
        self.state = self.cache = self.draft_state = self._no_prev = None
        self._compiled.clear()

    def expert_map(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The logical-to-physical expert map the steps read (slots [L, E, R + 1], replica counts [L, E]; redundant
        experts, `jaxdp.eplb.slots`), None when the experts are held without one."""
        moe = self.state["moe_layers"]["ffn"] if "moe_layers" in self.state else None
        if moe is None or "expert_slots_ES" not in moe:
            return None
        return np.asarray(moe["expert_slots_ES"].get_value()), np.asarray(moe["expert_replicas_E"].get_value())

    def set_expert_map(self, slots_LES, replicas_LE) -> None:
        """Read a new logical-to-physical expert map from the next step on: new values of the compiled steps' map
        inputs, same shapes and shardings, so nothing compiles. The map may only name slots that hold its expert
        (the weights stay where they are); anything else is refused in one sentence."""
        held = self.expert_map()
        if held is None:
            raise PlacementError("these experts are held without an expert map; start the server with "
                                 "--ep-num-redundant-experts (moe=ep) to give them one.")
        slots, replicas = np.asarray(slots_LES), np.asarray(replicas_LE)
        if slots.ndim != 3 or replicas.ndim != 2:
            raise PlacementError(f"an expert map must be slots {held[0].shape} and replica counts {held[1].shape}, "
                                 f"not {slots.shape} and {replicas.shape}.")
        num_physical = held[1].shape[1] + held[0].shape[2] - 1
        check_map(slots, replicas, held_physical_to_logical(*held, num_physical))
        moe = self.state["moe_layers"]["ffn"]
        for name, value in (("expert_slots_ES", slots), ("expert_replicas_E", replicas)):
            old = moe[name].get_value()
            moe[name].set_value(jax.device_put(value.astype(np.int32), old.sharding))

    def ensure_token_carry(self, width: int) -> None:
        """Let steps read at least `width` of the previous step's tokens (recompiles on change)."""
        if self.token_carry < width:
            self.token_carry = width
            self._no_prev = None
            self._compiled.clear()

    def ensure_penalty_slots(self, slots: int) -> None:
        """Let speculative steps read a penalty state of at least `slots` slots a rank (`jaxdp.engine.step.controls`;
        recompiles them on change)."""
        if self.penalty_slots < slots:
            self.penalty_slots = slots
            for shape in [s for s in self._compiled if s.draft_tokens]:
                del self._compiled[shape]

    def resize_pool(self, num_pages: int) -> None:
        """A pool of `num_pages` per rank (after the weights are placed, to size it from free memory)."""
        self.num_pages = num_pages
        self._compiled.clear()
        self.reset_cache()

    def reset_cache(self) -> None:
        """Zero every page (a fresh pool; the engine never needs this, experiments do)."""
        self.cache = self._empty_cache(self.cache_dtype)

    @property
    def has_draft(self) -> bool:
        return self.draft_graphdef is not None

    # ---- compiling -----------------------------------------------------------------------------
    def _build(self, shape: StepShape):
        if shape.draft_tokens:
            return build_spec_step(self, shape)
        lay, cfg = self.layout, self.cfg
        gather = GatherSpec(shape.gather_mode, lay.dp, lay.tp, shape.sum_rows)
        lm_mode = lm_head_mode(lay)
        graphdef, decode_kernel = self.graphdef, self.decode_kernel
        tied = cfg.tie_word_embeddings
        ep_ragged = ragged_a2a_on(self.mesh.devices.flat[0].platform)
        count = cfg.num_moe_layers > 0  # routed tokens per layer and logical expert (the recorder's)
        split = self.dcp_size > 1
        fixed_tree = getattr(decode_kernel, "batch_invariant", False)  # (--enable-deterministic-inference)

        def per_device(state, cache, batch, rows_R, prev_tokens):
            b = {k: v[0] for k, v in batch.items()}
            # a negative token -1-j is the j-th token sampled by the previous step on this rank
            tok = b["tokens_T"]
            b["tokens_T"] = jnp.where(tok >= 0, tok, prev_tokens[0][jnp.clip(-tok - 1, 0, prev_tokens.shape[1] - 1)])
            cache = {k: v[0, 0] if split else v[0] for k, v in cache.items()}
            tbo_split = None
            if shape.micro_rows:  # (the ranks' split rows ride after their row counts)
                rows_R, tbo_split = rows_R[: lay.dp], rows_R[lay.dp + jax.lax.axis_index("dp")]
            comm = MeshComm(gather, lay.moe, lay.dense_replicated, lm_mode, shape.num_rows, rows_R, tied, ep_ragged,
                            count_experts=count, fixed_tree=fixed_tree)
            model = nnx.merge(graphdef, state)
            attn = AttnBatch(b["positions_T"], b["seq_T"], b["slots_T"], b["page_table_BN"], b["seq_lens_B"])
            micro = None if tbo_split is None else micro_batches(attn, b["valid_T"], tbo_split, shape.micro_rows,
                                                                 shape.absorbed, comm)
            main, _ = split_draft(cache)  # (a draft KV passes through)
            logits_BV, main, rows = model(b["tokens_T"], b["valid_T"], attn, main, b["logits_idx_B"],
                                          comm, absorbed=shape.absorbed, decode_kernel=decode_kernel,
                                          rows_by_layer=count, micro=micro)
            rows_E, counts_LE = (rows[0].sum(0), rows[1]) if count else (rows, jnp.zeros((0, 0), jnp.int32))
            cache = {k: v[None, None] if split else v[None] for k, v in (cache | main).items()}
            return logits_BV[None], cache, rows_E[None], counts_LE[None]

        batch_specs = {k: P("dp") for k in STEP_FIELDS}
        cache_specs = {k: self.cache_spec for k in self.cache}
        fn = jax.shard_map(per_device, mesh=self.mesh,
                           in_specs=(self.state_specs, cache_specs, batch_specs, P(), P("dp")),
                           out_specs=(P("dp"), cache_specs, P(ALL), P(ALL)), check_vma=False)
        layout = packed_step_layout(shape)

        def step(state, cache, packed_RW, rows_R, prev_tokens):  # (the step's inputs put as one array)
            return fn(state, cache, unpack(packed_RW, layout), rows_R, prev_tokens)

        return jax.jit(step, donate_argnums=(1,))

    def compile(self, shape: StepShape) -> None:
        if shape in self._compiled:
            return
        t0 = time.perf_counter()
        jitted = self._build(shape)
        args = self._abstract_args(shape)
        self._compiled[shape] = jitted.lower(*args).compile()
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - t0

    def _abstract_args(self, shape: StepShape):
        if shape.draft_tokens:
            return spec_abstract_args(self, shape)
        dp, sh = self.layout.dp, NamedSharding(self.mesh, P("dp"))
        batch = jax.ShapeDtypeStruct((dp, width(packed_step_layout(shape))), jnp.int32, sharding=sh)
        rows = jax.ShapeDtypeStruct(((2 if shape.micro_rows else 1) * dp,), jnp.int32,
                                    sharding=NamedSharding(self.mesh, P()))
        prev = jax.ShapeDtypeStruct((dp, self.token_carry), jnp.int32, sharding=sh)
        return self.state, self.cache, batch, rows, prev

    # ---- running -------------------------------------------------------------------------------
    def run(self, shape: StepShape, stacked: dict[str, np.ndarray], prev_tokens=None):
        """Run one step; returns (logits [dp, B, V] device array, rows per expert [world, E_local]).

        prev_tokens: [dp, token_carry] int32 on the device, the previous step's sampled tokens, which
        negative entries of `tokens_T` refer to (the step is queued without waiting for them).
        A two-batch-overlap shape (`micro_rows`) splits every rank where `jaxdp.parallel.tbo_split` says; the caller
        asks for one only when every rank can split (the agreement's `tbo`)."""
        self.compile(shape)
        batch = self.put(pack(stacked, packed_step_layout(shape)))  # (one transfer for the 8 arrays)
        rows_R = np.asarray(stacked["rows_R"], np.int32)
        if shape.micro_rows:
            split_R = split_rows(stacked["seq_T"], stacked["valid_T"], shape.absorbed, 0.0, shape.micro_rows)
            if split_R is None:
                raise ValueError(f"this step does not split into two micro-batches of {shape.micro_rows} rows at "
                                 "sequence boundaries; run its whole shape (micro_rows=0).")
            rows_R = np.concatenate([rows_R, split_R])
        rows = self.put(rows_R, P())
        if prev_tokens is None:
            if self._no_prev is None:  # (kept: the step does not donate it)
                self._no_prev = self.put(np.zeros((self.layout.dp, self.token_carry), np.int32))
            prev_tokens = self._no_prev
        logits, self.cache, rows_E, counts = self._compiled[shape](self.state, self.cache, batch, rows, prev_tokens)
        self.last_expert_counts = counts
        self.experts.add(counts)  # (while recording: summed on the devices, nothing read back)
        self.last_account = self.account(shape, stacked["rows_R"])
        return logits, rows_E

    def executable(self, shape: StepShape):
        """The compiled step of `shape` (compiled first if it is not yet)."""
        self.compile(shape)
        return self._compiled[shape]

    def account(self, shape: StepShape, rows_R) -> StepAccount:
        """The accounting of a step of this shape: what crossed, what was padded, rows computed / needed."""
        return account_step(self.layout, self.cfg, [int(r) for r in rows_R], gather_mode=shape.gather_mode,
                            bucket=shape.num_rows, is_extend=not shape.absorbed, act_bytes=self.act_bytes)

    @property
    def act_bytes(self) -> int:
        return jnp.dtype(self.cache_dtype).itemsize

    def lower(self, shape: StepShape):
        """The step of this shape lowered on the runner's (possibly abstract) state: `.compile()` it for
        XLA's `memory_analysis()`."""
        return self._build(shape).lower(*self._abstract_args(shape))

    def hlo_text(self, shape: StepShape) -> str:
        """The optimized HLO of a step (to check which collectives it runs)."""
        return self.lower(shape).compile().as_text()


@functools.cache
def packed_step_layout(shape: StepShape) -> PackedLayout:
    """Where each of a plain step's arrays lies in its packed [dp, W] int32 input (`jaxdp.parallel.packing`)."""
    sizes = step_sizes(shape.num_rows, shape.num_seqs, shape.pages_per_seq, shape.num_logits)
    return packed_layout(STEP_SPEC, lambda _: sizes)


def _place(model, placed: bool, layout: Layout, mesh, o: StepOptions):
    """A model (or the MTP layer) as the runner holds it: its graph, its state on `mesh` (as given when `placed`,
    merged from a ShardedModel; moved there otherwise; ShapeDtypeStructs when `o.abstract`) and its specs."""
    if o.moe_backend is not None:
        model = with_moe_runner_backend(model, o.moe_backend)
    graphdef, state = nnx.split(model)
    specs = state_specs(state, layout)
    if o.abstract:
        return graphdef, _abstract_on(state, specs, mesh), specs
    return graphdef, state if placed else shard_state(state, layout, mesh), specs


def _abstract_on(state, specs, mesh):
    """ShapeDtypeStructs of `state` placed as `specs` say (nothing allocated)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                        state, specs)
