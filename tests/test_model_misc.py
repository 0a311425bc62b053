"""Config reading, loader details, compile time against depth, and the one_batch tool."""

import json
import time

import jax
import numpy as np
import pytest

from jaxdp.config import UnsupportedConfigError, config_from_hf_dict, get_config
from jaxdp.layout import Layout
from jaxdp.model.loader import dequantize_fp8_blocks, load_model
from jaxdp.parallel.step import StepRunner, StepShape

BASE = {
    "model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
}
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def test_rope_scaling_under_either_spelling():
    a = config_from_hf_dict({**BASE, "rope_scaling": {"type": "yarn", **YARN}, "rope_theta": 5e4})
    b = config_from_hf_dict({**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, **YARN}})
    assert a.rope_scaling == b.rope_scaling and a.rope_theta == b.rope_theta == 5e4
    assert a.rope_scaling["rope_type"] == "yarn"
    c = config_from_hf_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert c.rope_scaling is None


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                        ("hidden_act", "gelu"), ("attention_bias", True),
                                        ("model_type", "llama")])
def test_unsupported_fields_refused_by_name(key, value):
    with pytest.raises(UnsupportedConfigError, match=key if key != "model_type" else "llama"):
        config_from_hf_dict({**BASE, key: value})


def test_unsupported_rope_and_quantization_refused():
    with pytest.raises(UnsupportedConfigError, match="longrope"):
        config_from_hf_dict({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 2}})
    with pytest.raises(UnsupportedConfigError, match="gptq"):
        config_from_hf_dict({**BASE, "quantization_config": {"quant_method": "gptq"}})
    fp8 = config_from_hf_dict({**BASE, "quantization_config": {"quant_method": "fp8",
                                                               "weight_block_size": [128, 128]}})
    assert fp8.fp8_block == (128, 128)


def test_glm5_preset_and_config_carry_the_sparse_indexer():
    cfg = get_config("glm-5")
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.qk_nope_head_dim) == (78, 6144, 154880, 192)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_key_dim) == (2048, 32, 128)
    glm = config_from_hf_dict({**BASE, "model_type": "glm_moe_dsa", "index_topk": 64, "index_n_heads": 4,
                               "index_head_dim": 32, "q_lora_rank": 16})
    assert glm.index_topk == 64  # tests/test_dsa.py checks the indexer itself against transformers


def test_fp8_block_dequantization():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 7)).astype(np.float32)
    scale = np.array([[2.0, 0.5], [4.0, 1.0]], np.float32)
    w8 = w.astype(jax.numpy.float8_e4m3fn)
    out = dequantize_fp8_blocks(np.asarray(w8), scale, (4, 4))
    expect = np.asarray(w8, np.float32) * np.repeat(np.repeat(scale, 4, 0), 4, 1)[:5, :7]
    np.testing.assert_array_equal(out, expect)


def _decode_compile_seconds(num_layers: int, pages_per_seq: int) -> float:
    """Compile time of a decode step whose page-table width was never compiled before."""
    cfg, model = load_model("deepseek-v3", "float32", num_layers=num_layers, tiny_width=True)
    layout = Layout()
    runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[:1]), num_pages=4, page_size=4)
    t0 = time.perf_counter()
    runner.compile(StepShape(True, 4, 4, pages_per_seq))
    return time.perf_counter() - t0


@pytest.mark.slow  # three compiles, one of 61 layers: 21-27 s
def test_compile_time_does_not_grow_with_depth():
    """Layers run under lax.scan: a 61-layer decode step compiles within 2x of a 4-layer one."""
    # page-table widths never used before make every program new: no in-memory or persistent cache answers
    pages = int(np.random.default_rng().integers(100, 100_000))
    _decode_compile_seconds(2, pages)  # one-time costs of the first compile in the process
    shallow = _decode_compile_seconds(4, pages + 1)
    deep = _decode_compile_seconds(61, pages + 2)
    assert deep < 2 * shallow, (deep, shallow)


def test_one_batch_cli_dumps_logits_in_the_documented_format(tmp_path, capsys):
    from jaxdp.one_batch import main

    out = tmp_path / "l.npz"
    rc = main(["--prompt-ids", "1,2,3,4,5;6,7", "--output-len", "3", "--mesh", "dp=2", "--dump-logits", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "compile:" in text and "prefill:" in text and "median" in text
    z = np.load(out)
    assert z["prompt_0"].shape == (5, 512) and z["prompt_1"].shape == (2, 512)
    assert z["decode_1"].shape == (3, 512) and z["tokens_1"].shape == (3,)
    assert z["tokens_0"][0] == z["prompt_0"][-1].argmax()
    assert z["tokens_0"][1] == z["decode_0"][0].argmax()


@pytest.mark.parametrize("argv,needle", [(["--mesh", "dp=3,tp=2"], "divide"), (["--mesh", "dp=16"], "devices"),
                                         (["--prompt-ids", "1,x"], "prompt-ids"),
                                         (["--model-path", "/nonexistent"], "nonexistent")])
def test_one_batch_user_errors_are_one_sentence(argv, needle, capsys):
    from jaxdp.one_batch import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_hf_config_round_trip(tmp_path):
    from flax import nnx

    from jaxdp.model.decoder import DeepseekV3
    from jaxdp.model.loader import load_checkpoint, save_hf_checkpoint

    cfg = get_config("tiny")
    model = DeepseekV3(cfg, nnx.Rngs(3))
    save_hf_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "deepseek_v3"
    cfg2, model2 = load_checkpoint(tmp_path, np.float32)
    assert cfg2 == cfg
    a, b = nnx.state(model), nnx.state(model2)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sharded_fp8_checkpoint_loads_dequantized(tmp_path):
    """A DeepSeek-style block-FP8 checkpoint split over two safetensors files with an index."""
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxdp.config import hf_config_dict
    from jaxdp.model.decoder import DeepseekV3
    from jaxdp.model.loader import hf_state_dict, load_checkpoint

    cfg = get_config("tiny")
    tensors = hf_state_dict(DeepseekV3(cfg, nnx.Rngs(5)))
    block = 16
    quantized, expected = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and "proj" in name:  # the Linear weights are FP8 in DeepSeek's checkpoints
            rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
            amax = np.zeros((rows, cols), np.float32)
            for i in range(rows):
                for j in range(cols):
                    amax[i, j] = np.abs(w[i * block:(i + 1) * block, j * block:(j + 1) * block]).max()
            scale_inv = np.maximum(amax, 1e-12) / 448.0
            s_full = np.repeat(np.repeat(scale_inv, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
            w8 = (w / s_full).astype(jax.numpy.float8_e4m3fn)
            quantized[name] = np.asarray(w8)
            quantized[name.replace(".weight", ".weight_scale_inv")] = scale_inv
            expected[name] = np.asarray(w8, np.float32) * s_full
        else:
            quantized[name] = w
            expected[name] = w
    names = sorted(quantized)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: quantized[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    raw = hf_config_dict(cfg) | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [block, block]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded_cfg, model = load_checkpoint(tmp_path, np.float32)
    assert loaded_cfg.fp8_block == (block, block)
    got = hf_state_dict(model)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
    assert any(np.abs(expected[n] - tensors[n]).max() > 0 for n in expected)  # it really was quantized
