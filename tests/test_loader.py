"""The sharded streaming loader: every parameter created in its final sharding from slices of the files,
block-FP8 weights kept FP8 (and exact against their dequantization), bad checkpoints refused in one
sentence before anything is allocated, and one construction path for the entry points."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxdp.config import PRESETS, hf_config_dict
from jaxdp.layout import parse_mesh_spec
from jaxdp.model import checkpoint, fp8
from jaxdp.model.checkpoint import CheckpointError, memory_order
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.loader import hf_state_dict, load_checkpoint
from jaxdp.model.sharded import abstract_state, load_sharded, param_table, weight_bytes_per_device
from jaxdp.one_batch import run_prompts
from jaxdp.parallel.step import StepRunner

BLOCK = 16
# the tiny preset with expert / MLP widths that split into whole 16-wide FP8 blocks over 8 devices
CFG = PRESETS["tiny"].with_(moe_intermediate_size=128, intermediate_size=128)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 500]]


def pow2_fp8(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek-style block FP8 of a torch [out, in] weight with power-of-two scales:
    (e4m3 values, weight_scale_inv, the exact float32 dequantization)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    pad = np.pad(np.abs(w), ((0, rows * block - w.shape[0]), (0, cols * block - w.shape[1])))
    amax = pad.reshape(rows, block, cols, block).max(axis=(1, 3))
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / fp8.FP8_MAX))).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
    w8 = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale, w8.astype(np.float32) * full


def write(path, tensors: dict, cfg, quant: dict | None = None, split: bool = True) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path / fname))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    raw = hf_config_dict(cfg) | ({"quantization_config": quant} if quant else {})
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random model as bf16-exact float32, and the same model in block FP8 whose exact dequantization
    is a second float32 checkpoint."""
    root = tmp_path_factory.mktemp("ckpts")
    tensors = hf_state_dict(DeepseekV3(CFG, nnx.Rngs(3)))
    tensors = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()}
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if fp8_weight(name, w):
            w8, s, exact = pow2_fp8(w, BLOCK)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = w8, s
            dequantized[name] = exact
        else:
            quantized[name] = dequantized[name] = w
    write(root / "dense", tensors, CFG)
    write(root / "fp8", quantized, CFG, {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]})
    write(root / "fp8_exact", dequantized, CFG)
    return root


def fp8_weight(name: str, w: np.ndarray) -> bool:
    return w.ndim == 2 and "proj" in name and name.startswith("model.layers.")


def gathered(state) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


@pytest.mark.parametrize("mesh", ["tp=8", "dp=2,tp=4,moe=ep", "dp=8"])
def test_sharded_load_matches_one_device_in_the_steps_sharding(checkpoints, mesh):
    _, one = load_checkpoint(checkpoints / "dense", jnp.float32)
    layout = parse_mesh_spec(mesh)
    m = layout.make_mesh(jax.devices()[:8])
    sharded = load_sharded(checkpoints / "dense", layout, m, jnp.float32)
    table = param_table(sharded.cfg, layout, jnp.float32)
    for path, x in jax.tree_util.tree_flatten_with_path(sharded.state)[0]:
        dotted = ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        assert x.sharding.spec == table[dotted].spec, dotted
    want = gathered(nnx.state(one))
    for k, v in gathered(sharded.state).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


def _row_major(a: np.ndarray) -> bool:
    moving = [k for k in memory_order(a) if a.shape[k] > 1]
    return moving == sorted(moving)


@pytest.mark.parametrize("name,mesh", [("dense", "tp=8"), ("dense", "dp=2,tp=4,moe=ep"), ("fp8", "tp=8")])
def test_the_devices_transpose_what_a_gpu_load_places_as_stored(checkpoints, monkeypatch, name, mesh):
    """A GPU's load (torch's [out, in] placed as stored, transposed by the devices), forced on the CPU: the
    same arrays in the same shardings as the host's transposing copies, and the host copies only row-major
    runs (where the host's path, checked by the same spy, transposes)."""
    layout = parse_mesh_spec(mesh)
    m = layout.make_mesh(jax.devices()[:8])
    copies: list[bool] = []
    run = checkpoint._run

    def spy(tasks, pool):
        copies.extend(_row_major(src[t]) for _, src, t in tasks)
        return run(tasks, pool)

    monkeypatch.setattr(checkpoint, "_run", spy)
    host = load_sharded(checkpoints / name, layout, m, jnp.float32, transpose_on_devices=False)
    assert copies and not all(copies)
    copies.clear()
    dev = load_sharded(checkpoints / name, layout, m, jnp.float32, transpose_on_devices=True)
    assert copies and all(copies)
    specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_flatten_with_path(host.state)[0]}
    for p, x in jax.tree_util.tree_flatten_with_path(dev.state)[0]:
        assert x.sharding.spec == specs[jax.tree_util.keystr(p)], p
    want = gathered(host.state)
    for k, v in gathered(dev.state).items():
        assert v.dtype == want[k].dtype, k
        np.testing.assert_array_equal(v.view(np.uint8), want[k].view(np.uint8), err_msg=k)


def test_fp8_checkpoint_stays_fp8_and_gives_the_logits_of_its_exact_dequantization(checkpoints):
    layout = parse_mesh_spec("tp=8")
    mesh = layout.make_mesh(jax.devices()[:8])
    q = load_sharded(checkpoints / "fp8", layout, mesh, jnp.float32)
    held = {p: (i.dtype, i.shape) for p, i in param_table(q.cfg, layout, jnp.float32).items()}
    linear = [p for p in held if p.rsplit(".", 1)[-1] in fp8.FP8_WEIGHTS]
    assert len(linear) == 16  # dense: 5 attention + 2 MLP; MoE: 5 attention + 2 experts + 2 shared
    for p in linear:  # the Linear weights stay 1 byte a weight, with their block scales beside them
        assert held[p][0] == jnp.float8_e4m3fn, p
        scale = held[p + fp8.SCALE_SUFFIX]
        assert scale == (np.float32, (held[p][1][0],) + fp8.scale_shape(p.rsplit(".", 1)[-1], held[p][1][1:], BLOCK))
    fp8_bytes = sum(int(np.prod(held[p][1])) for p in linear) // 8  # each split over 8 devices but kv_a, q_a
    assert weight_bytes_per_device(q.state)["float8_e4m3fn"] >= fp8_bytes
    exact = load_sharded(checkpoints / "fp8_exact", layout, mesh, jnp.float32)
    logits = []
    for model in (q, exact):
        with jax.default_matmul_precision("highest"):
            runner = StepRunner(model, layout, mesh, num_pages=16, page_size=4)
            logits.append(run_prompts(runner, PROMPTS, [0] * len(PROMPTS), 3))
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(logits[0]["prompt"][i], logits[1]["prompt"][i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(logits[0]["decode"][i], logits[1]["decode"][i], atol=1e-5, rtol=0)
    assert np.abs(logits[1]["prompt"][0]).max() > 0.1


def test_quantization_fp8_at_load_matches_the_in_memory_quantization(checkpoints):
    """--quantization fp8 on a dense checkpoint: the same values as quantizing the model in memory (on one
    device: DeepSeek's 128-wide blocks do not split over 8 devices at the tiny widths)."""
    layout = parse_mesh_spec("dp=1")
    mesh = layout.make_mesh(jax.devices()[:1])
    at_load = load_sharded(checkpoints / "dense", layout, mesh, jnp.float32, quantization="fp8")
    _, dense = load_checkpoint(checkpoints / "dense", jnp.float32)
    fp8.to_fp8(dense, 128, jnp.float32)
    want = gathered(nnx.state(dense))
    got = gathered(at_load.state)
    assert want.keys() == got.keys()
    for k in want:  # the same scales (XLA divides by 448 as a product: 1 ulp); e4m3 values equal but rare ties
        g, w = got[k].astype(np.float32), want[k].astype(np.float32)
        if fp8.SCALE_SUFFIX in k:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0, err_msg=k)
        else:
            np.testing.assert_allclose(g, w, rtol=0.125, atol=0, err_msg=k)
            assert np.mean(g != w) < 0.002, k


def test_abstract_state_is_what_the_loader_builds(checkpoints):
    layout = parse_mesh_spec("dp=2,tp=4")
    mesh = layout.make_mesh(jax.devices()[:8])
    cfg = CFG.with_(fp8_block=(BLOCK, BLOCK))
    _, abstract = abstract_state(cfg, layout, mesh, jnp.float32)
    real = load_sharded(checkpoints / "fp8", layout, mesh, jnp.float32)
    for (pa, a), (pr, r) in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                                jax.tree_util.tree_flatten_with_path(real.state)[0], strict=True):
        assert pa == pr and a.shape == r.shape and a.dtype == r.dtype and a.sharding == r.sharding


# ---- bad checkpoints: one sentence naming the tensor and the file, before anything is allocated ----


@pytest.fixture
def no_allocation(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("an array was allocated before the checkpoint was checked")

    monkeypatch.setattr(jax, "make_array_from_callback", boom)


def _fp8_tensors(cfg=CFG):
    tensors = hf_state_dict(DeepseekV3(cfg, nnx.Rngs(3)))
    out = {}
    for name, w in tensors.items():
        if fp8_weight(name, w):
            w8, s, _ = pow2_fp8(w, BLOCK)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = w8, s
        else:
            out[name] = w
    return out


FP8 = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
NAME = "model.layers.1.self_attn.q_b_proj.weight"


@pytest.mark.parametrize("case,needle", [
    ("shape", f"tensor '{NAME}' in model-0000"),
    ("scale", f"scale tensor '{NAME.replace('.weight', '.weight_scale_inv')}' in model-0000"),
    ("block", "blocks that config.json declares"),
    ("missing_file", "model-00002-of-00002.safetensors, which is missing"),
    ("missing_tensor", "has no tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"),
    ("lfs_pointer", "model-00002-of-00002.safetensors is not a safetensors file (a Git LFS pointer"),
])
def test_a_malformed_checkpoint_is_refused_in_one_sentence(tmp_path, no_allocation, case, needle):
    tensors, quant = _fp8_tensors(), dict(FP8)
    if case == "shape":
        tensors[NAME] = tensors[NAME][:-1]
    elif case == "scale":
        s = NAME.replace(".weight", ".weight_scale_inv")
        tensors[s] = tensors[s][:, :1]
    elif case == "block":
        quant["weight_block_size"] = [2 * BLOCK, 2 * BLOCK]
    elif case == "missing_tensor":
        del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    write(tmp_path, tensors, CFG, quant)
    if case == "missing_file":
        (tmp_path / "model-00002-of-00002.safetensors").unlink()
    if case == "lfs_pointer":  # what a clone without git-lfs leaves in place of the weights
        (tmp_path / "model-00002-of-00002.safetensors").write_text(
            "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456789\n")
    layout = parse_mesh_spec("tp=8")
    with pytest.raises((CheckpointError, FileNotFoundError)) as e:
        load_sharded(tmp_path, layout, layout.make_mesh(jax.devices()[:8]), jnp.float32)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_unknown_quant_method_and_unsplittable_fp8_blocks_are_refused(tmp_path):
    from jaxdp.config import UnsupportedConfigError

    write(tmp_path / "awq", _fp8_tensors(), CFG, {"quant_method": "awq"})
    layout = parse_mesh_spec("tp=8")
    with pytest.raises(UnsupportedConfigError, match="quant_method='awq' is not supported"):
        load_sharded(tmp_path / "awq", layout, layout.make_mesh(jax.devices()[:8]), jnp.float32)
    narrow = PRESETS["tiny"]  # experts 32 wide: 4 per device under tp=8, not whole 16-wide blocks
    write(tmp_path / "narrow", _fp8_tensors(narrow), narrow, FP8)
    with pytest.raises(ValueError, match="does not split into whole 16-wide scale blocks"):
        load_sharded(tmp_path / "narrow", layout, layout.make_mesh(jax.devices()[:8]), jnp.float32)


def test_fused_expert_layout_quantized_to_fp8_at_load(tmp_path):
    """transformers' in-memory expert layout (gate_up_proj [E, 2I, D]) read dense and quantized at load."""
    cfg = CFG
    tensors = hf_state_dict(DeepseekV3(cfg, nnx.Rngs(4)))
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_dense_layers, cfg.num_layers):
        pre = f"model.layers.{i}.mlp.experts"
        E = range(cfg.n_routed_experts)
        gate_up = [np.concatenate([tensors.pop(f"{pre}.{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in E]
        tensors[f"{pre}.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{pre}.down_proj"] = np.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in E])
        assert tensors[f"{pre}.gate_up_proj"].shape[1] == 2 * I
    write(tmp_path / "fused", tensors, cfg)
    layout = parse_mesh_spec("dp=1")
    mesh = layout.make_mesh(jax.devices()[:1])
    got = load_sharded(tmp_path / "fused", layout, mesh, jnp.float32, quantization="fp8").merge()
    ffn = got.moe_layers.ffn
    assert ffn.w_gate_up_ED2I.get_value().dtype == jnp.float8_e4m3fn
    _, dense = load_checkpoint(tmp_path / "fused", jnp.float32)
    np.testing.assert_allclose(np.asarray(fp8.weight(ffn, "w_gate_up_ED2I")),
                               np.asarray(dense.moe_layers.ffn.w_gate_up_ED2I.get_value()), rtol=0.07, atol=1e-6)


def test_an_engine_leaves_jax_compilation_cache_config_to_the_entry_points():
    """A library constructor must not change JAX's global configuration; serve's --compilation-cache-dir
    is the entry point's (and '' leaves the cache off)."""
    from jaxdp.engine import Engine
    from jaxdp.engine.setup import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    engine = Engine("tiny", warmup=False)
    assert engine.runner.state is not None
    assert jax.config.jax_compilation_cache_dir == before
    enable_compilation_cache("")
    assert jax.config.jax_compilation_cache_dir == before


def test_the_fp8_step_keeps_no_dequantized_copy_of_the_stack(monkeypatch):
    """XLA's memory analysis of a compiled decode step: with FP8 weights the step's temporaries stay below
    those of the same model held dense with XLA's products (which on the CPU convert its bf16 weights for the
    dots; `jaxdp.native`'s products, off here, read them in place and hold none): no dequantized copy in the
    model's dtype. (XLA:CPU has no FP8 arithmetic and converts an FP8 stack to f16 before slicing a layer out
    of it; a GPU's step reads the FP8 layer in place, docs/gpu-on-paper.md.)"""
    from jaxdp import native
    from jaxdp.layout import Layout
    from jaxdp.model.sharded import init_sharded
    from jaxdp.parallel.step import StepShape

    cfg = PRESETS["tiny"].with_(hidden_size=512, moe_intermediate_size=256, intermediate_size=512, num_layers=6)
    layout = Layout()
    mesh = layout.make_mesh(jax.devices()[:1])
    temp, weights = {}, {}
    monkeypatch.setenv(native.ENV, "0")
    for q in (None, "fp8"):
        runner = StepRunner(init_sharded(cfg, layout, mesh, jnp.bfloat16, 0, q), layout, mesh, num_pages=4,
                            page_size=4)
        shape = StepShape(True, 4, 4, 2)
        compiled = runner._build(shape).lower(*runner._abstract_args(shape)).compile()
        temp[q] = compiled.memory_analysis().temp_size_in_bytes
        weights[q] = sum(weight_bytes_per_device(runner.state).values())
    monkeypatch.undo()
    assert weights["fp8"] < 0.6 * weights[None]
    dense_stack = weights[None]  # a whole dequantized copy would add at least this much
    assert temp["fp8"] < temp[None] and temp["fp8"] < dense_stack + 0.25 * temp[None], (temp, weights)


@pytest.mark.parametrize("box", [(slice(0, 300), slice(0, 272)), (slice(128, 256), slice(0, 128)),
                                 (slice(37, 201), slice(5, 250)), (slice(299, 300), slice(271, 272))])
def test_read_dense_dequantizes_only_its_box_and_equals_the_slice_of_the_whole(tmp_path, box):
    from jaxdp.model.checkpoint import Checkpoint
    from jaxdp.model.modelopt import dequantize_weight
    from jaxdp.model.sources import read_dense
    from kernels_pallas.nvfp4 import quantize_nvfp4

    rng = np.random.default_rng(0)
    w8, scale, _ = pow2_fp8(rng.standard_normal((300, 272)).astype(np.float32), 128)
    packed, s16, s2 = (np.asarray(a) for a in quantize_nvfp4(jnp.asarray(rng.standard_normal((300, 272)),
                                                                          jnp.float32)))
    save_file({"a.weight": w8, "a.weight_scale_inv": scale, "b.weight": packed, "b.weight_scale": s16,
               "b.weight_scale_2": s2}, str(tmp_path / "model.safetensors"))
    whole_fp8 = fp8.dequantize_fp8_blocks(w8, scale, (128, 128))
    whole_nvfp4 = dequantize_weight(packed, s16, s2)
    with Checkpoint(tmp_path) as ck:
        np.testing.assert_array_equal(read_dense(ck, "a.weight", 128, box), whole_fp8[box])
        np.testing.assert_array_equal(read_dense(ck, "b.weight", None, box), whole_nvfp4[box])
        np.testing.assert_array_equal(read_dense(ck, "a.weight", None), whole_fp8)
