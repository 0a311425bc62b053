"""The MTP (NextN) layer (`jaxdp.model.mtp`) against an independent reference (its loading and the planner's
count: tests/test_mtp_loading.py).

The reference follows vLLM's `DeepSeekMultiTokenPredictorLayer` / SGLang's `DeepseekModelNextN`, written here
in torch: `eh_proj(cat([enorm(embed(next tokens)), hnorm(target's normed hidden)]))`, then one decoder layer,
`shared_head.norm` and the main model's head. The decoder layer (MLA + MoE; with GLM-5's DSA indexer) is
transformers' own: a one-layer DeepseekV3ForCausalLM / GlmMoeDsaForCausalLM fed `inputs_embeds`, whose final
norm is the MTP's shared_head.norm and whose head is the main model's. Its weights are written into the
main checkpoint under DeepSeek's names (`model.layers.{num_hidden_layers}.*`), as DeepSeek-V3 ships them.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxdp.batch import Piece, build_rank_batch  # noqa: E402
from jaxdp.model.loader import (  # noqa: E402
    load_checkpoint,
    load_mtp,
)
from jaxdp.model.mla import AttnBatch  # noqa: E402
from jaxdp.model.mtp import empty_draft_cache  # noqa: E402
from jaxdp.parallel.local import LocalComm  # noqa: E402

PROMPTS = [[5, 7, 9, 11, 3, 2, 8, 60, 61, 17, 4, 30], [1, 2, 3, 4, 99, 98, 97, 96, 95, 12, 13, 14, 15, 16, 17, 18, 19]]
NEXT = [77, 33]  # the token the target "sampled" after each prompt: the last MTP row's input
DECODED = 4  # rows of each sequence the decode path runs one at a time (the rest as one prompt step)
PAGE, PAGES = 4, 16
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=8,
              num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
              topk_group=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
              routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-6)
KINDS = {  # DeepSeek-V3 with YaRN; GLM-5 with a DSA indexer selecting 6 of up to 19 tokens
    "v3": dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "glm": dict(index_topk=6, index_n_heads=16, index_head_dim=16),
}


def _classes(kind):
    if kind == "glm":
        return transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
    return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM


def _randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():  # weights large enough that every term matters, non-zero correction biases
        for name, p in model.named_parameters():
            if "norm" in name and not name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


class Reference:
    """The target (transformers, 3 layers) and its MTP layer (eh_proj etc. in torch, the decoder layer a
    one-layer transformers model sharing the target's embedding and head)."""

    def __init__(self, kind, path):
        Config, Model = _classes(kind)
        extra = KINDS[kind] | ({"index_topk_pattern": "FSF"} if kind == "glm" else {})
        self.target = Model(Config(**COMMON, **extra, num_hidden_layers=3, first_k_dense_replace=1)).eval()
        _randomize(self.target, 0)
        self.target.save_pretrained(path)
        extra = KINDS[kind] | ({"index_topk_pattern": "F"} if kind == "glm" else {})
        self.block = Model(Config(**COMMON, **extra, num_hidden_layers=1, first_k_dense_replace=0)).eval()
        _randomize(self.block, 1)
        g = torch.Generator().manual_seed(2)
        D = COMMON["hidden_size"]
        self.enorm = 1.0 + 0.1 * torch.randn(D, generator=g)
        self.hnorm = 1.0 + 0.1 * torch.randn(D, generator=g)
        self.eh_proj = torch.randn(D, 2 * D, generator=g) * 0.15  # torch's [out, in]
        with torch.no_grad():  # DeepSeek-V3's MTP shares the embedding and the output head
            self.block.model.embed_tokens.weight.copy_(self.target.model.embed_tokens.weight)
            self.block.lm_head.weight.copy_(self.target.lm_head.weight)
        self._write_mtp(path)

    def _write_mtp(self, path):
        """The MTP layer under DeepSeek's names, in a second safetensors file; config.json declares it."""
        tmp = path / "block"
        self.block.save_pretrained(tmp)
        pre = "model.layers.3"
        rename = {"model.norm.weight": f"{pre}.shared_head.norm.weight",
                  "lm_head.weight": f"{pre}.shared_head.head.weight",
                  "model.embed_tokens.weight": f"{pre}.embed_tokens.weight"}
        stored = load_file(tmp / "model.safetensors")
        out = {rename.get(k, k.replace("model.layers.0.", f"{pre}.")): v for k, v in stored.items()}
        out |= {f"{pre}.enorm.weight": self.enorm.numpy(), f"{pre}.hnorm.weight": self.hnorm.numpy(),
                f"{pre}.eh_proj.weight": self.eh_proj.numpy()}
        save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(path / "mtp.safetensors"))
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()

    @torch.no_grad()
    def hidden(self, prompt, nxt):
        """The target's final normed hidden state at every position of the prompt (what the MTP reads)."""
        return self.target.model(torch.tensor([prompt])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, prompt, nxt, mask_position0=False):
        """(logits [n, V], pre-norm output [n, D]) of the MTP rows of a prompt: row i reads the target's
        hidden at i and the token at i + 1 (the sampled `nxt` for the last), at position i."""
        h = self.hidden(prompt, nxt)
        e = self.target.model.embed_tokens(torch.tensor(prompt[1:] + [nxt]))
        if mask_position0:
            e[0] = 0
        x = torch.cat([rms(e, self.enorm), rms(h, self.hnorm)], -1) @ self.eh_proj.T
        seen = []
        layer = self.block.model.layers[0]
        hook = layer.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
        logits = self.block(inputs_embeds=x[None], position_ids=torch.arange(len(prompt))[None]).logits[0]
        hook.remove()
        return logits.numpy(), seen[0][0].numpy(), h.numpy()


_CASES: dict = {}


def _case(kind, tmp_path_factory):
    """(kind, checkpoint dir, Reference, config, jaxdp's target model, jaxdp's MTP layer), built once."""
    if kind not in _CASES:
        path = tmp_path_factory.mktemp(f"mtp_{kind}")
        ref = Reference(kind, path)
        with jax.default_matmul_precision("highest"):
            cfg, target = load_checkpoint(path, jnp.float32)
            _, mtp = load_mtp(str(path), "float32")
        _CASES[kind] = (kind, path, ref, cfg, target, mtp)
    return _CASES[kind]


@pytest.fixture(scope="module", params=["v3", "glm"])
def case(request, tmp_path_factory):
    return _case(request.param, tmp_path_factory)


def _batch(pieces, rows, seqs):
    b = build_rank_batch(pieces, num_rows=rows, num_seqs=seqs, pages_per_seq=PAGES // 2, page_size=PAGE,
                         num_pages=PAGES)
    attn = AttnBatch(*(jnp.asarray(getattr(b, f)) for f in ("positions_T", "seq_T", "slots_T", "page_table_BN",
                                                            "seq_lens_B")))
    return b, attn


@functools.cache
def _jitted(mtp):
    """The MTP call compiled (one executable per step shape, kept across tests), as a step runs it."""
    from flax import nnx

    graphdef, state = nnx.split(mtp)

    @functools.partial(jax.jit, static_argnames=("absorbed", "mask_position0"))
    def call(state, tokens, hidden, valid, attn, cache, idx, embed, head, absorbed, mask_position0):
        return nnx.merge(graphdef, state)(tokens, hidden, valid, attn, cache, idx, LocalComm(), embed, head,
                                          absorbed=absorbed, mask_position0=mask_position0)

    return lambda *a, **k: call(state, *a, **k)


def run_mtp(target, mtp, hiddens, decoded, mask_position0=False):
    """The MTP rows of PROMPTS: all but the last `decoded` rows of each sequence in one prompt step (expanded
    MLA), then one decode step (absorbed) per remaining row. Returns per sequence (logits [n, V], hidden [n, D])."""
    cfg = mtp.cfg
    embed, head = target.embed_VD[...], target.lm_head_weight()
    pages = [list(range(0, PAGES // 2)), list(range(PAGES // 2, PAGES))]
    inputs = [p[1:] + [n] for p, n in zip(PROMPTS, NEXT, strict=True)]
    cache = empty_draft_cache(cfg, PAGES, PAGE)
    step = _jitted(mtp)
    logits = [[] for _ in PROMPTS]
    hidden = [[] for _ in PROMPTS]
    with jax.default_matmul_precision("highest"):
        split = [len(t) - decoded for t in inputs]
        rows = 32
        b, attn = _batch([Piece(t[:s], 0, pg) for t, s, pg in zip(inputs, split, pages, strict=True)], rows, 2)
        h_TD = np.zeros((rows, cfg.hidden_size), np.float32)
        h_TD[:split[0]], h_TD[split[0]:sum(split)] = hiddens[0][:split[0]], hiddens[1][:split[1]]
        out, x_TD, cache, _ = step(jnp.asarray(b.tokens_T), jnp.asarray(h_TD), jnp.asarray(b.valid_T), attn, cache,
                                   jnp.arange(rows), embed, head, absorbed=False, mask_position0=mask_position0)
        out, x_TD = np.asarray(out), np.asarray(x_TD)
        for i, (a, z) in enumerate(((0, split[0]), (split[0], sum(split)))):
            logits[i].append(out[a:z])
            hidden[i].append(x_TD[a:z])
        for j in range(decoded):
            pos = [s + j for s in split]
            b, attn = _batch([Piece([t[p]], p, pg) for t, p, pg in zip(inputs, pos, pages, strict=True)], 2, 2)
            h_TD = np.stack([hiddens[i][p] for i, p in enumerate(pos)])
            out, x_TD, cache, _ = step(jnp.asarray(b.tokens_T), jnp.asarray(h_TD), jnp.asarray(b.valid_T), attn,
                                       cache, jnp.asarray(b.logits_idx_B), embed, head, absorbed=True,
                                       mask_position0=mask_position0)
            for i in range(2):
                logits[i].append(np.asarray(out)[i:i + 1])
                hidden[i].append(np.asarray(x_TD)[i:i + 1])
    return [np.concatenate(x) for x in logits], [np.concatenate(x) for x in hidden]


def _refs(ref, mask_position0=False):
    return [ref.mtp(p, n, mask_position0) for p, n in zip(PROMPTS, NEXT, strict=True)]


@pytest.mark.parametrize("mask_position0", [False, True], ids=["sglang", "vllm-masks-position-0"])
def test_prompt_and_decode_match_the_reference(case, mask_position0):
    kind, _, ref, _, target, mtp = case
    refs = _refs(ref, mask_position0)
    logits, hidden = run_mtp(target, mtp, [h for _, _, h in refs], DECODED, mask_position0)
    for i, (ref_logits, ref_hidden, _) in enumerate(refs):
        assert np.abs(ref_logits).max() > 1.0
        np.testing.assert_allclose(logits[i], ref_logits, atol=1e-4, rtol=0, err_msg=f"{kind} sequence {i}")
        np.testing.assert_allclose(hidden[i], ref_hidden, atol=1e-4, rtol=0, err_msg=f"{kind} sequence {i}")
    if not mask_position0:  # the mask changes row 0 only (and, through attention, nothing before it)
        masked = _refs(ref, True)
        assert np.abs(masked[0][0][0] - refs[0][0][0]).max() > 1e-2


def test_prompt_path_and_decode_path_agree(case):
    """The same rows through the prompt path only, and through the decode path for most of them."""
    _, _, ref, _, target, mtp = case
    hiddens = [ref.hidden(p, n).numpy() for p, n in zip(PROMPTS, NEXT, strict=True)]
    prompt_only, _ = run_mtp(target, mtp, hiddens, 0)
    mostly_decoded, _ = run_mtp(target, mtp, hiddens, 9)
    for a, b in zip(prompt_only, mostly_decoded, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def run_mtp_mesh(spec, target, mtp, hiddens, ranks):
    """`run_mtp` (prompt step, then DECODED decode steps) under a layout: sequence i on rank ranks[i], the other
    ranks idle (all-padding rows), in one shard_map with the mesh's places (the gather before the MoE, the
    return, the LM head), as the engine's step runs the main model."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp.batch import stack_ranks
    from jaxdp.layout import parse_mesh_spec
    from jaxdp.parallel.places import ALL, GatherSpec, MeshComm
    from jaxdp.parallel.sharding import lm_head_mode, param_spec, shard_state, state_specs

    lay = parse_mesh_spec(spec)
    mesh = lay.make_mesh(jax.devices()[: lay.world])
    graphdef, state = nnx.split(mtp)
    specs = state_specs(state, lay)
    state = shard_state(state, lay, mesh)
    head_spec = param_spec("['lm_head_DV']", target.lm_head_DV, lay)
    embed = jax.device_put(target.embed_VD[...], NamedSharding(mesh, P()))
    head = jax.device_put(target.lm_head_weight(), NamedSharding(mesh, head_spec))
    pages = list(range(PAGES // 2))
    inputs = [p[1:] + [n] for p, n in zip(PROMPTS, NEXT, strict=True)]
    split = [len(t) - DECODED for t in inputs]

    @functools.cache
    def compiled(rows, absorbed):
        def per_device(state, embed, head, cache, batch, h, rows_R):
            comm = MeshComm(GatherSpec("max_len", lay.dp, lay.tp), lay.moe, lay.dense_replicated, lm_head_mode(lay),
                            rows, rows_R)
            b = {k: v[0] for k, v in batch.items()}
            attn = AttnBatch(b["positions_T"], b["seq_T"], b["slots_T"], b["page_table_BN"], b["seq_lens_B"])
            out, x, cache, _ = nnx.merge(graphdef, state)(
                b["tokens_T"], h[0], b["valid_T"], attn, {k: v[0] for k, v in cache.items()}, b["logits_idx_B"],
                comm, embed, head, absorbed=absorbed)
            return out[None], x[None], {k: v[None] for k, v in cache.items()}

        return jax.jit(jax.shard_map(per_device, mesh=mesh,
                                     in_specs=(specs, P(), head_spec, P("dp"), P("dp"), P("dp"), P()),
                                     out_specs=(P("dp"), P("dp"), P("dp")), check_vma=False))

    def step(pieces_by_rank, h_by_rank, rows, absorbed, cache):
        batches = [build_rank_batch(p, num_rows=rows, num_seqs=2, pages_per_seq=PAGES // 2, page_size=PAGE,
                                    num_pages=PAGES, all_logits=not absorbed) for p in pieces_by_rank]
        stacked = stack_ranks(batches)
        rows_R = jnp.asarray(stacked.pop("rows_R"))
        h = np.zeros((lay.dp, rows, mtp.cfg.hidden_size), np.float32)
        for r, rows_h in enumerate(h_by_rank):
            if len(rows_h):  # an idle rank's rows are all padding
                h[r, :len(rows_h)] = rows_h
        put = {k: jax.device_put(v, NamedSharding(mesh, P("dp"))) for k, v in stacked.items()}
        out, _, cache = compiled(rows, absorbed)(state, embed, head, cache, put,
                                                 jax.device_put(h, NamedSharding(mesh, P("dp"))), rows_R)
        return np.asarray(out), cache

    cache = {k: jax.device_put(jnp.stack([v] * lay.dp), NamedSharding(mesh, P("dp")))
             for k, v in empty_draft_cache(mtp.cfg, PAGES, PAGE).items()}
    assert ALL == ("dp", "tp")
    logits = [[] for _ in PROMPTS]
    with jax.default_matmul_precision("highest"):
        pieces = [[] for _ in range(lay.dp)]
        hs = [[] for _ in range(lay.dp)]
        for i, r in enumerate(ranks):
            pieces[r], hs[r] = [Piece(inputs[i][:split[i]], 0, pages)], hiddens[i][:split[i]]
        out, cache = step(pieces, hs, 32, False, cache)
        for i, r in enumerate(ranks):
            logits[i].append(out[r, :split[i]])
        for j in range(DECODED):
            pieces = [[] for _ in range(lay.dp)]
            hs = [[] for _ in range(lay.dp)]
            for i, r in enumerate(ranks):
                p = split[i] + j
                pieces[r], hs[r] = [Piece([inputs[i][p]], p, pages)], hiddens[i][p:p + 1]
            out, cache = step(pieces, hs, 2, True, cache)
            for i, r in enumerate(ranks):
                logits[i].append(out[r, :1])
    return [np.concatenate(x) for x in logits]


@pytest.mark.parametrize("spec, ranks", [("dp=2,tp=2", [0, 1]), ("dp=4,moe=ep", [0, 2])],
                         ids=["dp2-tp2", "dp4-ep-idle-ranks"])
def test_under_dp_attention_matches_the_reference(tmp_path_factory, spec, ranks):
    """Each rank drafts its own sequence with its own draft KV; ranks with no rows run the same step idle."""
    _, _, ref, _, target, mtp = _case("v3", tmp_path_factory)
    refs = _refs(ref)
    logits = run_mtp_mesh(spec, target, mtp, [h for _, _, h in refs], ranks)
    for i, (ref_logits, _, _) in enumerate(refs):
        np.testing.assert_allclose(logits[i], ref_logits, atol=1e-4, rtol=0, err_msg=f"{spec} sequence {i}")


def test_config_and_glm_indexer(case):
    kind, _, _, cfg, _, mtp = case
    assert cfg.num_nextn_predict_layers == 1
    assert (mtp.moe_layers.attn.indexer is not None) == (kind == "glm")
    if kind == "glm":  # layer 3 is past the model's layer types: the MTP layer runs its own indexer (read)
        assert np.asarray(mtp.moe_layers.attn.indexer.w_k_DE[...]).any()
