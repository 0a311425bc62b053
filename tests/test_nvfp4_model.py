"""The tiny model with NVFP4 routed experts: logits near the unquantized model's, every layout and both MoE
runner backends equal to one device, ModelOpt checkpoints, and the jaxdp.quantize (orbax) round trip.

The tiny model (hidden 64, 8 experts of intermediate 32, top-2, two MoE layers) has random weights, so
its experts' NVFP4 error is that of Gaussian weights: ~9.5% relative (Frobenius) per weight matrix.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxdp.config import UnsupportedConfigError, hf_config_dict
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.checkpoint import Checkpoint
from jaxdp.model.loader import hf_state_dict, load_model, save_hf_checkpoint
from jaxdp.model.modelopt import read_quant_config
from jaxdp.model.moe import NVFP4_PARAMS
from jaxdp.model.quant import quantize_experts
from jaxdp.model.sources import read_dense
from jaxdp.one_batch import run_prompts
from jaxdp.parallel.step import StepRunner
from kernels_pallas.nvfp4 import dequantize_nvfp4, quantize_nvfp4, quantize_nvfp4_gate_up

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 500], [42, 42, 42, 42]]
OUTPUT_LEN = 2


def copy_model(model, dtype=None):
    """A separate model object; floating weights cast to `dtype` (the router stays float32, as loaded)."""
    graphdef, state = nnx.split(model)
    if dtype is not None:
        state = jax.tree_util.tree_map_with_path(
            lambda p, x: x if "router" in jax.tree_util.keystr(p) else x.astype(dtype), state)
    return nnx.merge(graphdef, state)


def logits(model, spec="dp=1", backend=None) -> np.ndarray:
    """Prompt logits of every position, then OUTPUT_LEN greedy decode steps, all prompts stacked."""
    lay = parse_mesh_spec(spec)
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(model, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=8, page_size=8,
                            moe_backend=backend)
        out = run_prompts(runner, PROMPTS, [i % lay.dp for i in range(len(PROMPTS))], OUTPUT_LEN)
    return np.concatenate(out["prompt"] + out["decode"])


@pytest.fixture(scope="module")
def dense():
    return load_model("tiny", "float32", seed=7)[1]


@pytest.fixture(scope="module")
def nvfp4(dense):
    return quantize_experts(copy_model(dense), "nvfp4")


@pytest.fixture(scope="module")
def reference(nvfp4):
    return logits(nvfp4, backend="xla")


def test_experts_are_held_as_nvfp4(nvfp4, dense):
    moe = nvfp4.moe_layers.ffn
    shapes = {name: (getattr(moe, name).get_value().shape, getattr(moe, name).get_value().dtype)
              for name in NVFP4_PARAMS}
    assert shapes["w_gate_up_packed"] == ((2, 8, 2, 32, 32), jnp.uint8)
    assert shapes["w_gate_up_scale"] == ((2, 8, 2, 32, 4), jnp.float8_e4m3fn)
    assert shapes["w_down_packed"] == ((2, 8, 64, 16), jnp.uint8)
    assert shapes["w_down_scale"] == ((2, 8, 64, 2), jnp.float8_e4m3fn)
    assert shapes["w_gate_up_gscale"] == shapes["w_down_gscale"] == ((2, 8), jnp.float32)
    assert not hasattr(moe, "w_gate_up_ED2I") and hasattr(dense.moe_layers.ffn, "w_gate_up_ED2I")


def test_nvfp4_logits_close_to_bf16(dense):
    """bf16 model vs the same bf16 model with NVFP4 experts. Measured (seed 7, 4 prompts, 19 positions +
    8 decode rows): max |diff| 0.73 with max |logit| 3.75 (0.19), relative Frobenius error 0.083, about
    the weights' own NVFP4 error (0.095): the bound 0.15 / 0.25 leaves margin; float32 gives the same."""
    bf16 = copy_model(dense, jnp.bfloat16)
    ref = logits(bf16)
    got = logits(quantize_experts(copy_model(bf16), "nvfp4"))
    rel_fro = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    rel_max = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0.01 < rel_fro < 0.15, rel_fro  # and it did quantize
    assert rel_max < 0.25, rel_max


@pytest.mark.parametrize("spec", ["dp=8,moe=ep", "dp=2", "dp=4,tp=2,moe=ep"])
def test_nvfp4_layouts_equal_one_device(spec, nvfp4, reference):
    """EP splits whole experts; TP (dp=2: I=32 over 2 devices, 16 each) splits gate/up rows and the
    down projection's scale blocks."""
    np.testing.assert_allclose(logits(nvfp4, spec), reference, atol=1e-4, rtol=0)


def test_nvfp4_tp_refuses_to_split_a_scale_block(nvfp4):
    lay = parse_mesh_spec("dp=8")  # I=32 over 8 devices: 4 values each, a quarter of a scale block
    with pytest.raises(ValueError, match="16-value scale block; moe=ep"):
        StepRunner(nvfp4, lay, lay.make_mesh(jax.devices()[:8]), num_pages=8, page_size=8)


@pytest.mark.parametrize("backend", ["pallas", "blocked"])
def test_pallas_and_blocked_moe_backends_equal_xla(nvfp4, reference, backend):
    """The grouped NVFP4 GEMM (interpret mode on the CPU), and the blocked grouped matmul over the dequantized
    experts, inside the sharded step, TP over 2 devices."""
    np.testing.assert_allclose(logits(nvfp4, "dp=2", backend=backend), reference, atol=1e-4, rtol=0)


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(dense, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_hf_checkpoint(dense, path)
    return path


def write_modelopt_checkpoint(model, out) -> None:
    """What ModelOpt's unified HF export writes for a model whose routed experts only are NVFP4."""
    cfg = model.cfg
    tensors = hf_state_dict(model)
    for layer in range(cfg.num_dense_layers, cfg.num_layers):
        for e in range(cfg.n_routed_experts):
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            gate, up, down = (tensors.pop(f"{pre}.{p}_proj.weight") for p in ("gate", "up", "down"))
            quantized = (*quantize_nvfp4_gate_up(gate, up), quantize_nvfp4(down))
            for name, (packed, scale, scale_2) in zip(("gate", "up", "down"), quantized, strict=True):
                tensors |= {f"{pre}.{name}_proj.weight": np.asarray(packed),
                            f"{pre}.{name}_proj.weight_scale": np.asarray(scale),
                            f"{pre}.{name}_proj.weight_scale_2": np.asarray(scale_2, np.float32),
                            f"{pre}.{name}_proj.input_scale": np.asarray(0.01 * (e + 1), np.float32)}
    tensors = {k: np.array(v, order="C") for k, v in tensors.items()}  # safetensors writes the raw buffer
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                                 "model.layers.*.mlp.shared_experts*", "model.layers.0.mlp*"]}
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    config = {**hf_config_dict(cfg), "quantization_config": {"quant_method": "modelopt", **quant}}
    (out / "config.json").write_text(json.dumps(config))


def assert_same_params(a, b):
    leaves_a = jax.tree_util.tree_leaves_with_path(nnx.state(a))
    leaves_b = jax.tree_util.tree_leaves_with_path(nnx.state(b))
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.itemsize == 1:  # uint8 codes and E4M3 scales: compare the bytes
            x, y = x.view(np.uint8), y.view(np.uint8)
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_modelopt_checkpoint_loads_like_quantize_at_load(dense, hf_dir, reference, tmp_path, caplog):
    write_modelopt_checkpoint(dense, tmp_path)
    with caplog.at_level("INFO", logger="jaxdp.loader"):
        _, from_modelopt = load_model(str(tmp_path), "float32")
    assert "48 input_scale values in [0.01, 0.08]" in caplog.text  # 2 layers x 8 experts x 3, recorded
    _, at_load = load_model(str(hf_dir), "float32", quantization="nvfp4")
    assert_same_params(from_modelopt, at_load)
    np.testing.assert_array_equal(logits(from_modelopt), reference)
    # any other NVFP4 weight is dequantized on read
    name = "model.layers.1.mlp.experts.3.down_proj"
    expected = dequantize_nvfp4(*quantize_nvfp4(hf_state_dict(dense)[f"{name}.weight"]))
    with Checkpoint(tmp_path) as ck:
        np.testing.assert_array_equal(read_dense(ck, f"{name}.weight", None), np.asarray(expected))


@pytest.mark.parametrize("quant,needle", [({"quant_algo": "FP8"}, "quant_algo 'FP8'"),
                                           ({"quant_algo": "NVFP4", "group_size": 32}, "group_size 32")])
def test_modelopt_settings_jaxdp_does_not_read_are_refused(quant, needle, tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    with pytest.raises(UnsupportedConfigError, match=needle):
        read_quant_config(tmp_path)


def test_quantize_cli_orbax_round_trip_and_one_batch(hf_dir, nvfp4, reference, tmp_path, capsys):
    from jaxdp import one_batch, quantize

    out = tmp_path / "converted"
    assert quantize.main(["--model-path", str(hf_dir), "--out", str(out), "--dtype", "float32"]) == 0
    meta = json.loads((out / "jaxdp_checkpoint.json").read_text())
    assert meta["quantization"] == "nvfp4" and (out / "config.json").exists()
    cfg, restored = load_model(str(out), "float32")
    assert cfg == nvfp4.cfg
    assert_same_params(restored, nvfp4)
    prompts = ";".join(",".join(map(str, p)) for p in PROMPTS)
    dump = tmp_path / "logits.npz"
    argv = ["--model-path", str(out), "--prompt-ids", prompts, "--output-len", str(OUTPUT_LEN),
            "--dtype", "float32", "--mesh", "dp=4,moe=ep", "--ranks", "0,1,2,3", "--dump-logits", str(dump)]
    assert one_batch.main(argv) == 0
    assert "experts nvfp4 (auto)" in capsys.readouterr().out  # the CPU's default MoE runner
    got = np.load(dump)
    rows = np.concatenate([got[f"prompt_{i}"] for i in range(len(PROMPTS))]
                          + [got[f"decode_{i}"] for i in range(len(PROMPTS))])
    np.testing.assert_allclose(rows, reference, atol=1e-4, rtol=0)
