"""The model against an independent implementation: transformers' DeepseekV3ForCausalLM on the CPU.

A random tiny DeepSeek-V3 (several routed experts, top-k > 1, grouped routing, a dense first layer,
q and kv LoRA, YaRN rope scaling with mscale) is written with save_pretrained; jaxdp loads the
directory and must reproduce transformers' prompt logits and 8 greedy decode steps (absorbed MLA over
the paged cache) within 1e-3 in fp32, for prompts of different lengths in one batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxdp.layout import Layout  # noqa: E402
from jaxdp.model import mla, mla_prompt  # noqa: E402
from jaxdp.model.loader import load_checkpoint  # noqa: E402
from jaxdp.one_batch import run_prompts  # noqa: E402
from jaxdp.parallel.step import StepRunner  # noqa: E402

PROMPTS = [[5, 7, 9, 11, 3, 2, 8, 60, 61, 17, 4], [1, 2, 3],
           [9, 90, 99, 9, 19, 29, 39, 49, 59, 69, 79, 89, 100, 101, 102, 103, 104, 105, 106]]
DECODE_STEPS = 8


def make_hf_model(path, *, rope_interleave=True, q_lora=24):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=q_lora,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, rope_interleave=rope_interleave, rms_norm_eps=1e-6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # weights large enough that every term matters, a non-zero correction bias
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    model = make_hf_model(path)
    return path, model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("blocked", [False, True], ids=["small-steps-in-one-piece", "blocked"])
def test_prompt_and_decode_logits_match_transformers(hf_dir, blocked, monkeypatch):
    if blocked:  # the prompt path real sizes run (the test's steps are small enough for one piece otherwise)
        monkeypatch.setattr(mla_prompt, "DENSE_MAX_SCORES", -1)
    traced = []  # which form the prompt steps took
    monkeypatch.setattr(mla, "attend_blocked", lambda *a, **k: traced.append(1) or mla_prompt.attend_blocked(*a, **k))
    path, hf = hf_dir
    with jax.default_matmul_precision("highest"):
        cfg, model = load_checkpoint(path, jnp.float32)
        layout = Layout()
        runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[:1]), num_pages=32, page_size=4)
        out = run_prompts(runner, PROMPTS, [0] * len(PROMPTS), DECODE_STEPS)
    assert bool(traced) == blocked
    for i, prompt in enumerate(PROMPTS):
        tokens = out["tokens"][i].tolist()
        ref = hf_logits(hf, prompt + tokens)
        np.testing.assert_allclose(out["prompt"][i], ref[: len(prompt)], atol=1e-3, rtol=0)
        np.testing.assert_allclose(out["decode"][i], ref[len(prompt):], atol=1e-3, rtol=0)
        assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
        # transformers' own greedy continuation agrees with ours
        assert tokens[1:] == ref[len(prompt):-1].argmax(-1).tolist()


@pytest.mark.parametrize("interleave,q_lora", [(False, 24), (True, None)])
def test_rope_layout_and_plain_q_proj(tmp_path, interleave, q_lora):
    hf = make_hf_model(tmp_path, rope_interleave=interleave, q_lora=q_lora)
    with jax.default_matmul_precision("highest"):
        cfg, model = load_checkpoint(tmp_path, jnp.float32)
        layout = Layout()
        runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[:1]), num_pages=8, page_size=4)
        out = run_prompts(runner, PROMPTS[:1], [0], 2)
    ref = hf_logits(hf, PROMPTS[0] + out["tokens"][0].tolist())
    np.testing.assert_allclose(out["prompt"][0], ref[: len(PROMPTS[0])], atol=1e-3, rtol=0)
    np.testing.assert_allclose(out["decode"][0], ref[len(PROMPTS[0]):], atol=1e-3, rtol=0)


def test_absorbed_and_expanded_paths_agree(hf_dir):
    """The same decode tokens through both MLA paths (decode vs one-token extends) give the same logits."""
    from jaxdp.batch import Piece, build_rank_batch, stack_ranks
    from jaxdp.parallel.step import StepShape

    path, _ = hf_dir
    with jax.default_matmul_precision("highest"):
        cfg, model = load_checkpoint(path, jnp.float32)
        layout = Layout()
        mesh = layout.make_mesh(jax.devices()[:1])
        results = []
        for absorbed in (True, False):
            runner = StepRunner(model, layout, mesh, num_pages=32, page_size=4)
            pages = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
            first = [Piece(p, 0, pages[i]) for i, p in enumerate(PROMPTS)]
            shape = StepShape(False, 64, 4, 8)
            b = build_rank_batch(first, num_rows=64, num_seqs=4, pages_per_seq=8, page_size=4, num_pages=32)
            runner.run(shape, stack_ranks([b]))
            dec = [Piece([7 + i], len(p), pages[i]) for i, p in enumerate(PROMPTS)]
            shape = StepShape(absorbed, 4, 4, 8)
            b = build_rank_batch(dec, num_rows=4, num_seqs=4, pages_per_seq=8, page_size=4, num_pages=32)
            logits, _ = runner.run(shape, stack_ranks([b]))
            results.append(np.asarray(logits)[0, : len(PROMPTS)])
    np.testing.assert_allclose(results[0], results[1], atol=1e-4, rtol=0)
