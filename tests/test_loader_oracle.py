"""A block-FP8 copy of the transformers oracle model (tests/test_model_oracle.py), loaded with its weights
kept FP8, matches transformers' DeepseekV3 on the exactly dequantized weights: prompt logits and greedy
decode steps, on one device and under tp=2 (whole 16-wide blocks per device)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from test_loader import fp8_weight, pow2_fp8  # noqa: E402
from test_model_oracle import PROMPTS, hf_logits, make_hf_model  # noqa: E402

from jaxdp.layout import parse_mesh_spec  # noqa: E402
from jaxdp.model.sharded import load_sharded  # noqa: E402
from jaxdp.one_batch import run_prompts  # noqa: E402
from jaxdp.parallel.step import StepRunner  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def fp8_and_oracle(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_oracle")
    make_hf_model(root / "hf")
    tensors = load_file(root / "hf" / "model.safetensors")
    quantized, exact = {}, {}
    for name, w in tensors.items():
        if fp8_weight(name, w):
            w8, scale, deq = pow2_fp8(w, BLOCK)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")], exact[name] = w8, scale, deq
        else:
            quantized[name] = exact[name] = w
    raw = json.loads((root / "hf" / "config.json").read_text())
    for sub, data, extra in (("fp8", quantized, {"quantization_config": {"quant_method": "fp8",
                                                                          "weight_block_size": [BLOCK, BLOCK]}}),
                             ("exact", exact, {})):
        (root / sub).mkdir()
        save_file(data, str(root / sub / "model.safetensors"), metadata={"format": "pt"})
        (root / sub / "config.json").write_text(json.dumps(raw | extra))
    oracle = transformers.DeepseekV3ForCausalLM.from_pretrained(root / "exact", torch_dtype=torch.float32).eval()
    assert any(np.abs(exact[n] - tensors[n]).max() > 0 for n in exact)  # it really was quantized
    return root / "fp8", oracle


@pytest.mark.parametrize("mesh", ["dp=1", "tp=2"])
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(fp8_and_oracle, mesh):
    path, oracle = fp8_and_oracle
    layout = parse_mesh_spec(mesh)
    mesh_ = layout.make_mesh(jax.devices()[: layout.world])
    with jax.default_matmul_precision("highest"):
        model = load_sharded(path, layout, mesh_, jnp.float32)
        assert model.merge().moe_layers.attn.w_q_b_QHK.get_value().dtype == jnp.float8_e4m3fn
        runner = StepRunner(model, layout, mesh_, num_pages=32, page_size=4)
        out = run_prompts(runner, PROMPTS, [0] * len(PROMPTS), 4)
    for i, prompt in enumerate(PROMPTS):
        ref = hf_logits(oracle, prompt + out["tokens"][i].tolist())
        np.testing.assert_allclose(out["prompt"][i], ref[: len(prompt)], atol=1e-3, rtol=0)
        np.testing.assert_allclose(out["decode"][i], ref[len(prompt):], atol=1e-3, rtol=0)
        assert np.abs(ref).max() > 1.0
