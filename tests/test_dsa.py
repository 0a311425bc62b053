"""DeepSeek sparse attention (GLM-5 `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`) against transformers.

Random tiny checkpoints written with save_pretrained, with `index_topk` (6) well below the prompt lengths
and, for GLM-5, "shared" layers that reuse the previous full layer's selection. jaxdp must reproduce
transformers' prompt logits and 8 greedy decode steps (sparse absorbed MLA over the paged cache) within
1e-3 in fp32, prompts of different lengths in one batch, on one device and under dp=8, tp=8, dp=8,moe=ep.

16 index heads: a token all of whose heads score below zero gets exactly 0 after the ReLU, and two such
tokens tie; with few heads that happens often enough to make top-k's tie order (which no implementation
specifies) decide the selection.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxdp.config import UnsupportedConfigError, config_from_hf_dict  # noqa: E402
from jaxdp.layout import parse_mesh_spec  # noqa: E402
from jaxdp.model.loader import load_checkpoint  # noqa: E402
from jaxdp.one_batch import run_prompts  # noqa: E402
from jaxdp.parallel.step import StepRunner  # noqa: E402

TOPK = 6
PROMPTS = [[5, 7, 9, 11, 3, 2, 8, 60, 61, 17, 4], [1, 2, 3],
           [9, 90, 99, 9, 19, 29, 39, 49, 59, 69, 79, 89, 100, 101, 102, 103, 104, 105, 106],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
DECODE_STEPS = 8
# V3.2 differs from GLM-5 only in the indexer's rope and in having no shared layers: the one-device test
# shows both; the layouts, the kernel and the no-cache path run on GLM-5 only (CI time), not as skipped V3.2 cases
GLM_ONLY = pytest.mark.parametrize("checkpoint", ["glm"], indirect=True)


def make_dsa_model(path, kind: str):
    """A random tiny GLM-5 ("glm": layers full, shared, full, shared) or DeepSeek-V3.2 ("v32")."""
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, rms_norm_eps=1e-6, index_topk=TOPK, index_n_heads=16, index_head_dim=16,
    )
    if kind == "glm":
        from transformers import GlmMoeDsaConfig as Config
        from transformers import GlmMoeDsaForCausalLM as Model

        common["index_topk_pattern"] = "FSFS"
    else:
        from transformers import DeepseekV32Config as Config
        from transformers import DeepseekV32ForCausalLM as Model
    torch.manual_seed(1)
    model = Model(Config(**common)).eval()
    with torch.no_grad():  # weights large enough that every term matters
        for name, p in model.named_parameters():
            if "norm" in name and not name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["glm", "v32"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"dsa_{request.param}")
    hf = make_dsa_model(path, request.param)
    with jax.default_matmul_precision("highest"):
        cfg, model = load_checkpoint(path, jnp.float32)
    return request.param, hf, cfg, model


def check_against_transformers(out, hf, prompts):
    for i, prompt in enumerate(prompts):
        tokens = out["tokens"][i].tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0].numpy()
        np.testing.assert_allclose(out["prompt"][i], ref[: len(prompt)], atol=1e-3, rtol=0, err_msg=f"prompt {i}")
        np.testing.assert_allclose(out["decode"][i], ref[len(prompt):], atol=1e-3, rtol=0, err_msg=f"decode {i}")
        assert np.abs(ref).max() > 1.0
        assert tokens[1:] == ref[len(prompt):-1].argmax(-1).tolist()


def run(model, spec: str, ranks, num_pages=32, page_size=4, decode_kernel=None, index_key_dtype=None):
    lay = parse_mesh_spec(spec)
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(model, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=num_pages,
                            page_size=page_size, decode_kernel=decode_kernel, index_key_dtype=index_key_dtype)
        return run_prompts(runner, PROMPTS, ranks, DECODE_STEPS)


def test_config_reads_the_sparse_attention_fields(checkpoint):
    kind, _, cfg, model = checkpoint
    assert cfg.index_topk == TOPK and cfg.index_n_heads == 16 and cfg.index_head_dim == 16
    assert cfg.index_rope_interleave == (kind == "glm")
    assert cfg.indexer_full == ((True, False, True, False) if kind == "glm" else (True,) * 4)
    # layer 1 (the first MoE layer) is shared in GLM-5: no indexer weights in the checkpoint, zeros, never read
    assert np.asarray(model.moe_layers.attn.indexer.w_k_DE[...])[0].any() == (kind == "v32")


def test_prompt_and_decode_match_transformers_on_one_device(checkpoint):
    _, hf, _, model = checkpoint
    out = run(model, "dp=1", [0] * len(PROMPTS))
    check_against_transformers(out, hf, PROMPTS)


@GLM_ONLY
@pytest.mark.parametrize("spec", ["dp=8", pytest.param("tp=8", marks=pytest.mark.slow),
                                  pytest.param("dp=8,moe=ep", marks=pytest.mark.slow)])
def test_layouts_match_transformers(checkpoint, spec):
    """dp=8 runs in CI; tp=8 and dp=8,moe=ep (-m slow) add nothing the sparse paths do differently: the
    indexer is whole on every device of a group, so tp only splits MLA's heads, and ep only the MoE."""
    _, hf, _, model = checkpoint
    dp = parse_mesh_spec(spec).dp
    out = run(model, spec, [(3 * i) % dp for i in range(len(PROMPTS))])
    check_against_transformers(out, hf, PROMPTS)


@GLM_ONLY
def test_pallas_sparse_decode_kernel_in_the_model_matches_transformers(checkpoint):
    """--attention-backend pallas (interpret mode on the CPU): the sparse decode kernel inside the step."""
    from jaxdp.ops.attention import decode_kernels as decode_kernel

    _, hf, _, model = checkpoint
    out = run(model, "dp=2", [0, 1, 1, 0], decode_kernel=decode_kernel("pallas"))
    check_against_transformers(out, hf, PROMPTS)


@pytest.mark.parametrize("dim", [128, 256, 16])
def test_fp8_index_keys_pack_to_sglangs_size_and_round_trip(dim):
    from jaxdp.model.indexer import fp8_key_width, pack_fp8_keys, unpack_fp8_keys

    k = jax.random.normal(jax.random.key(dim), (5, dim)) * jnp.arange(1, 6)[:, None]
    packed = pack_fp8_keys(k)
    assert packed.dtype == jnp.uint8 and packed.shape == (5, fp8_key_width(dim))
    assert fp8_key_width(128) == 132  # GLM-5's index_head_dim: SGLang's 132 bytes a token
    back = np.asarray(unpack_fp8_keys(packed, dim))
    k = np.asarray(k)
    blocks = k.reshape(5, -1, min(dim, 128))
    bound = np.abs(blocks).max(-1, keepdims=True) / 16  # e4m3: 3 mantissa bits, scaled to the block's max
    assert np.all(np.abs(back.reshape(blocks.shape) - blocks) <= bound)
    assert 0 < np.abs(back - k).max()  # quantized, not stored as is


@GLM_ONLY
def test_fp8_index_keys_in_the_pool_keep_most_selections(checkpoint):
    """index_key_dtype="fp8": the pool holds packed keys (e4m3 + a scale per 128). Quantizing moves a
    selection only where two scores nearly tie, which in this tiny random model changes a prompt's logits
    a lot: here two of the three prompts longer than index_topk keep transformers' logits within 1e-3 (a
    wrong packing would move all three)."""
    _, hf, _, model = checkpoint
    out = run(model, "dp=1", [0] * len(PROMPTS), index_key_dtype="fp8")
    exact = []
    for i, prompt in enumerate(PROMPTS):
        if len(prompt) <= TOPK:
            continue
        tokens = out["tokens"][i].tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0].numpy()
        got = np.concatenate([out["prompt"][i], out["decode"][i]])
        exact.append(bool(np.abs(got - ref).max() < 1e-3))
    assert sum(exact) == 2, exact


@GLM_ONLY
def test_training_forward_without_cache_matches_transformers(checkpoint):
    """No cache (training): the indexer selects among the step's own rows of each sequence."""
    from jaxdp.model.mla import AttnBatch
    from jaxdp.parallel.local import LocalComm

    _, hf, _, model = checkpoint
    tokens = PROMPTS[0] + PROMPTS[2]
    seq = [0] * len(PROMPTS[0]) + [1] * len(PROMPTS[2])
    pos = list(range(len(PROMPTS[0]))) + list(range(len(PROMPTS[2])))
    with jax.default_matmul_precision("highest"):
        batch = AttnBatch(jnp.asarray(pos), jnp.asarray(seq))
        logits, _, _ = model(jnp.asarray(tokens), jnp.ones(len(tokens), bool), batch, None,
                             jnp.arange(len(tokens)), LocalComm(), absorbed=False)
    logits = np.asarray(logits)
    for prompt, rows in ((PROMPTS[0], slice(0, 11)), (PROMPTS[2], slice(11, None))):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits[rows], ref, atol=1e-3, rtol=0)


BASE = {"model_type": "glm_moe_dsa", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 6, "num_attention_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "index_topk": 64, "index_n_heads": 4, "index_head_dim": 32}


@pytest.mark.parametrize("extra, full", [
    ({}, (True,) * 6),
    ({"index_topk_freq": 2}, (True, True, False, True, False, True)),  # offset 2, as transformers derives it
    ({"index_topk_pattern": "FFSSFS"}, (True, True, False, False, True, False)),
    ({"indexer_types": ["full", "shared"] * 3}, (True, False) * 3),
])
def test_indexer_layer_types_follow_transformers(extra, full):
    from transformers import GlmMoeDsaConfig

    cfg = config_from_hf_dict({**BASE, **extra})
    assert cfg.indexer_full == full
    hf_args = {k: v for k, v in {**BASE, **extra}.items() if k != "model_type"}
    assert tuple(t == "full" for t in GlmMoeDsaConfig(**hf_args).indexer_types) == full


def test_bad_indexer_layer_types_are_refused_in_one_sentence():
    with pytest.raises(UnsupportedConfigError, match="starting with 'full'"):
        config_from_hf_dict({**BASE, "index_topk_pattern": "SFFFFF"})
    with pytest.raises(UnsupportedConfigError, match="q_lora_rank"):
        config_from_hf_dict({**BASE, "model_type": "deepseek_v32", "q_lora_rank": None})


def test_fp8_index_keys_through_the_construction_path_and_the_pool_size():
    """`serve --index-key-dtype fp8` reaches the runner: the index keys are packed bytes (e4m3 plus an fp32 scale
    per 128 values) and a token takes that many fewer bytes of the pool, which is what the pool is sized by."""
    import jax

    from jaxdp.config import PRESETS
    from jaxdp.engine.setup import build_runners
    from jaxdp.layout import Layout
    from jaxdp.model.indexer import fp8_key_width
    from jaxdp.serve import build_parser

    assert build_parser().parse_args(["--index-key-dtype", "fp8"]).index_key_dtype == "fp8"
    cfg, layout = PRESETS["glm-5-tiny"], Layout()
    mesh = layout.make_mesh(jax.devices()[:1])
    plain, packed = (build_runners("glm-5-tiny", layout, [mesh], dtype="bfloat16", num_pages=4, page_size=4,
                                   index_key_dtype=k)[0] for k in (None, "fp8"))
    assert packed.cache["moe_index"].dtype == jax.numpy.uint8
    assert packed.cache["moe_index"].shape[-1] == fp8_key_width(cfg.index_key_dim)
    saved = cfg.num_layers * (2 * cfg.index_key_dim - fp8_key_width(cfg.index_key_dim))
    assert plain.pool_bytes_per_token - packed.pool_bytes_per_token == saved


@GLM_ONLY
def test_prompt_rows_in_blocks_match_transformers(checkpoint, monkeypatch):
    """The prompt path's indexer in blocks of 3 rows (a long prompt over a long context; the step's rows
    are not a multiple of 3, so the last block is padded) selects as transformers does."""
    from jaxdp.model import indexer

    _, hf, _, model = checkpoint
    monkeypatch.setattr(indexer, "query_block", lambda T, C, E, I: 3)
    out = run(model, "dp=1", [0] * len(PROMPTS))
    check_against_transformers(out, hf, PROMPTS)
