"""The MTP (NextN) layer's weights: loaded from bf16, block-FP8 and NVFP4 checkpoints and written back like the
main layers, refused in one sentence when a checkpoint lacks them, and counted by the planner as the loader holds
them. The checkpoints are tests/test_mtp.py's reference ones (DeepSeek's tensor names)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_mtp import _case  # noqa: E402

from jaxdp.config import PRESETS  # noqa: E402
from jaxdp.model.checkpoint import CheckpointError  # noqa: E402
from jaxdp.model.loader import (  # noqa: E402
    check_mtp_checkpoint,
    hf_state_dict,
    load_checkpoint,
    load_mtp,
    save_hf_checkpoint,
)
from jaxdp.model.mtp import MTPLayer, empty_draft_cache  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The DeepSeek-V3 case's target and MTP layer as jaxdp holds them, for the writer and the formats."""
    _, _, _, _, model, mtp = _case("v3", tmp_path_factory)
    return model, mtp


def test_a_preset_gets_a_random_mtp_layer():
    cfg, mtp = load_mtp("tiny", "float32", seed=3)
    assert isinstance(mtp, MTPLayer) and cfg == PRESETS["tiny"] and mtp.moe_layers.ffn.shared is not None
    assert np.asarray(mtp.w_eh_XD[...]).std() > 0 and mtp.moe_layers.attn_norm[...].shape == (1, cfg.hidden_size)


def test_bf16_checkpoint_round_trips_through_the_writer(tiny, tmp_path):
    model, mtp = tiny
    save_hf_checkpoint(model, tmp_path, ml_dtypes.bfloat16, mtp=mtp)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _, loaded = load_mtp(str(tmp_path), "float32")
    want, got = hf_state_dict(model, mtp), hf_state_dict(model, loaded)
    mtp_names = [k for k in want if k.startswith("model.layers.3.")]
    assert len(mtp_names) > 40 and "model.layers.3.eh_proj.weight" in mtp_names
    # the copies of the embedding and the head that DeepSeek-V3 stores with its MTP layer
    np.testing.assert_array_equal(want["model.layers.3.embed_tokens.weight"], want["model.embed_tokens.weight"])
    np.testing.assert_array_equal(want["model.layers.3.shared_head.head.weight"], want["lm_head.weight"])
    for name in (n for n in mtp_names if "embed_tokens" not in n and "shared_head.head" not in n):
        np.testing.assert_array_equal(got[name], want[name].astype(ml_dtypes.bfloat16).astype(np.float32), name)


def _fp8_checkpoint(tensors, cfg, path, block=16):
    """DeepSeek's block FP8: every Linear of the layers e4m3 with a float32 scale per block; eh_proj, the
    router, embeddings and heads stay as they are (as DeepSeek-V3's checkpoint stores them)."""
    from jaxdp.config import hf_config_dict
    from jaxdp.model.fp8 import quantize

    out, expected = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and "proj" in name and "eh_proj" not in name:
            values, scale = quantize(w, (block, block))
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = values, scale
            s_full = np.repeat(np.repeat(scale, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
            expected[name] = values.astype(np.float32) * s_full
        else:
            out[name] = expected[name] = w
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(path / "model.safetensors"))
    raw = hf_config_dict(cfg) | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [block, block]}}
    (path / "config.json").write_text(json.dumps(raw))
    return expected


def test_fp8_checkpoint_keeps_the_mtp_layer_fp8(tiny, tmp_path):
    model, mtp = tiny
    expected = _fp8_checkpoint(hf_state_dict(model, mtp), model.cfg.with_(num_nextn_predict_layers=1), tmp_path)
    cfg, loaded = load_mtp(str(tmp_path), "float32")
    assert cfg.fp8_block == (16, 16)
    attn = loaded.moe_layers.attn
    assert attn.w_kv_b_LHX[...].dtype == jnp.float8_e4m3fn and hasattr(attn, "w_kv_b_LHX_bscale")
    assert loaded.moe_layers.ffn.w_gate_up_ED2I[...].dtype == jnp.float8_e4m3fn
    assert loaded.w_eh_XD[...].dtype == jnp.float32  # as stored: dense
    got = hf_state_dict(model, loaded)
    for name in (k for k in expected if k.startswith("model.layers.3.") and "head" not in k and "embed" not in k):
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_nvfp4_experts_of_the_mtp_layer_as_stored(tiny, tmp_path):
    """A ModelOpt export: the MTP layer's experts NVFP4 load as NVFP4 (equal to quantizing at load); an
    export that leaves the MTP layer unquantized loads it dense."""
    from kernels_pallas.nvfp4 import quantize_nvfp4, quantize_nvfp4_gate_up

    model, mtp = tiny
    dense_dir, q_dir = tmp_path / "dense", tmp_path / "nvfp4"
    save_hf_checkpoint(model, dense_dir, mtp=mtp)
    tensors = hf_state_dict(model, mtp)
    for e in range(model.cfg.n_routed_experts):
        pre = f"model.layers.3.mlp.experts.{e}"
        gate, up, down = (tensors.pop(f"{pre}.{p}_proj.weight") for p in ("gate", "up", "down"))
        for name, (packed, scale, scale_2) in zip(("gate", "up", "down"),
                                                   (*quantize_nvfp4_gate_up(gate, up), quantize_nvfp4(down)),
                                                   strict=True):
            tensors |= {f"{pre}.{name}_proj.weight": np.asarray(packed),
                        f"{pre}.{name}_proj.weight_scale": np.asarray(scale),
                        f"{pre}.{name}_proj.weight_scale_2": np.asarray(scale_2, np.float32)}
    q_dir.mkdir()
    save_file({k: np.array(v, order="C") for k, v in tensors.items()}, str(q_dir / "model.safetensors"))
    quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    config = json.loads((dense_dir / "config.json").read_text())
    config |= {"quantization_config": {"quant_method": "modelopt", **quant}}
    (q_dir / "config.json").write_text(json.dumps(config))
    _, stored = load_mtp(str(q_dir), "float32")
    _, at_load = load_mtp(str(dense_dir), "float32", quantization="nvfp4")
    assert stored.moe_layers.ffn.quantization == "nvfp4"
    for name in ("w_gate_up_packed", "w_gate_up_scale", "w_down_packed", "w_down_gscale"):
        a, b = (np.asarray(getattr(m.moe_layers.ffn, name)[...]) for m in (stored, at_load))
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                      b.view(np.uint8) if b.dtype.itemsize == 1 else b, err_msg=name)
    (q_dir / "model.safetensors").unlink()  # the same export with the MTP layer left in bf16
    save_file(hf_state_dict(model, mtp), str(q_dir / "model.safetensors"))
    _, unquantized = load_mtp(str(q_dir), "float32")
    assert unquantized.moe_layers.ffn.quantization is None


def test_a_checkpoint_without_its_mtp_layer_is_refused_in_one_sentence(tiny, tmp_path):
    model, mtp = tiny
    save_hf_checkpoint(model, tmp_path)  # declares what it writes: no MTP layer
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with pytest.raises(CheckpointError, match=r"declares num_nextn_predict_layers=0, so the checkpoint has no MTP"):
        load_mtp(str(tmp_path), "float32")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    for refuse in (lambda: check_mtp_checkpoint(str(tmp_path)), lambda: load_mtp(str(tmp_path), "float32")):
        with pytest.raises(CheckpointError) as err:
            refuse()
        msg = str(err.value)
        assert "lacks the MTP layer's tensors ('model.layers.3.enorm.weight'" in msg and "\n" not in msg
    load_checkpoint(tmp_path, jnp.float32)  # the main model loads: it never reads the MTP layer


def test_an_mtp_head_that_is_not_the_main_models_is_served_with_a_warning(tiny, tmp_path, caplog):
    model, mtp = tiny
    save_hf_checkpoint(model, tmp_path, mtp=mtp)
    with caplog.at_level("WARNING", logger="jaxdp.loader"):
        load_mtp(str(tmp_path), "float32")
    assert "differs" not in caplog.text
    tensors = load_file(tmp_path / "model.safetensors")
    head = tensors["model.layers.3.shared_head.head.weight"]
    head[-1] *= 2  # the last row: the check reads the first and last rows only
    save_file(tensors | {"model.layers.3.shared_head.head.weight": head}, str(tmp_path / "model.safetensors"))
    with caplog.at_level("WARNING", logger="jaxdp.loader"):
        load_mtp(str(tmp_path), "float32")
    assert "'model.layers.3.shared_head.head.weight' in model.safetensors differs from the main model's" in caplog.text


@pytest.mark.parametrize("preset, mesh, expert_dtype", [("deepseek-v3", "dp=8", "fp8"),
                                                       ("deepseek-v3", "tp=8,moe=ep", "bf16"),
                                                       ("glm-5", "dp=4", "bf16")])
def test_planner_counts_the_mtp_layer_as_the_loader_holds_it(preset, mesh, expert_dtype):
    """At full size (abstract, nothing allocated): the planner's MTP component holds as many parameters as
    the module, and as many bytes per device as the loader's description of it (jaxdp's placement)."""
    import math

    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxdp.layout import parse_mesh_spec
    from jaxdp.model.sharded import abstract_mtp, table_of
    from jaxdp.planner.weights import weights_per_device

    cfg = PRESETS[preset]
    layout = parse_mesh_spec(mesh)
    base = weights_per_device(cfg, layout, expert_dtype)
    (extra,) = [c for c in weights_per_device(cfg, layout, expert_dtype, include_mtp=True) if c not in base]
    assert extra.name.startswith("MTP layer")
    abstract = abstract_mtp(cfg, jnp.bfloat16, "fp8" if expert_dtype == "fp8" else None)
    weights = [x for p, x in nnx.to_flat_state(nnx.state(abstract)) if not str(p[-1]).endswith("_bscale")]
    assert extra.params == sum(math.prod(x.shape) for x in weights)
    mesh_ = layout.make_mesh(jax.devices()[: layout.total_devices])
    held = sum(math.prod(NamedSharding(mesh_, i.spec).shard_shape(i.shape)) * i.dtype.itemsize
               for i in table_of(abstract, layout).values())
    planned = weights_per_device(cfg, layout, expert_dtype, placement="jaxdp", include_mtp=True)[-1]
    assert abs(held / planned.bytes_per_device - 1) < 0.002, (held, planned.bytes_per_device)


def test_planner_counts_the_draft_kv():
    from jaxdp.planner.weights import kv_bytes

    cfg = PRESETS["glm-5"]
    draft = empty_draft_cache(cfg.with_(hidden_size=8), 1, 1, jnp.bfloat16)  # one token of one page
    per_token = sum(x.size * x.dtype.itemsize for x in draft.values())
    assert kv_bytes(cfg, include_mtp=True).per_token - kv_bytes(cfg).per_token == per_token == 576 * 2 + 128 * 2
    assert kv_bytes(PRESETS["tiny"], include_mtp=True) == kv_bytes(PRESETS["tiny"])  # no MTP layer declared
