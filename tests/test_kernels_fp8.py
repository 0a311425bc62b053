"""The block-FP8 Pallas GEMMs (kernels_pallas/fp8_gemm.py) against their pure-jnp references in interpret mode,
the model's FP8 weights read from the whole layer stack (jaxdp.model.stacked, fp8.StackedWeight), and the kernels
compiled by XLA:GPU for a simulated H200 (with the plugin; tests/test_xla_gpu.py runs them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model import fp8
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.layers import dot
from jaxdp.model.mla import AttnBatch
from jaxdp.model.quant import with_moe_runner_backend
from jaxdp.model.stacked import InStack
from jaxdp.ops.gemm import einsum, projection
from jaxdp.parallel.local import LocalComm
from jaxdp.planner.xla_target import plugin_installed
from kernels_pallas import fp8_gemm
from kernels_pallas.fp8_gemm import block_columns, fp8_grouped_matmul, fp8_matmul

needs_plugin = pytest.mark.skipif(
    not plugin_installed(), reason="XLA:GPU's CUDA plugin is not on this process's path: CI runs these through "
    "tests/test_xla_gpu.py (the xla-gpu extra installed apart); here: pip install -e '.[xla-gpu]'")


def quantized(rng, shape, name=None):
    """(e4m3 values, block scales) of a random weight, blocked as jaxdp holds `name` (plain [.., K, N]: 128x128)."""
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.5, 4, size=shape[:1] + (1,) * (len(shape) - 1))
    blocks = fp8.scale_blocks(name, shape, 128) if name else (1,) * (len(shape) - 2) + (128, 128)
    q, s = fp8.quantize(w, blocks)
    return jnp.asarray(q), jnp.asarray(s)


def dequantized(q, s, dtype=jnp.float32):
    return np.asarray(fp8.dequantize(q, s, 128, dtype), np.float32)


@pytest.mark.parametrize("rows", [1, 40, 130])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_gemm_matches_the_reference_per_layer(rows, dtype):
    rng = np.random.default_rng(rows)
    q, s = quantized(rng, (3, 256, 384))
    x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
    cols = block_columns(384)
    for layer in (0, 2):
        got = np.asarray(fp8_matmul(x, q, s, cols, jnp.int32(layer), interpret=True), np.float32)
        ref = np.asarray(fp8_gemm.fp8_matmul_reference(x, q, s, cols, layer), np.float32)
        exact = np.asarray(x, np.float32) @ dequantized(q[layer], s[layer])  # float64-free independent product
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())
        np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * np.abs(exact).max() * 2)


def test_dense_gemm_per_column_scales_and_plain_weights():
    """A weight whose out dims were factored (w_q_b's K=192: one scale per column) and a plain float32 weight
    (the router) read in place."""
    rng = np.random.default_rng(1)
    q, s = quantized(rng, (2, 128, 4, 192), "w_q_b_QHK")  # [L, Q, H, K]: scales [L, 1, 4, 192]
    x = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    w = fp8.StackedWeight(q, s, jnp.int32(1), 128, jnp.float32)
    w_KN, s_KbS, cols = w.gemm_operands(1)
    assert w_KN.shape == (2, 128, 768) and s_KbS.shape == (2, 1, 768) and list(cols) == list(range(768))
    got = fp8_matmul(x, w_KN, s_KbS, cols, jnp.int32(1), interpret=True)
    np.testing.assert_allclose(got, np.asarray(x) @ dequantized(q[1], s[1]).reshape(128, 768), rtol=1e-4, atol=1e-3)
    router = jnp.asarray(rng.standard_normal((3, 256, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((10, 256)), jnp.float32)
    np.testing.assert_allclose(fp8_matmul(x, router, None, None, jnp.int32(2), interpret=True),
                               np.asarray(x) @ np.asarray(router[2]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes,valid", [([10, 0, 17, 5], None), ([0, 40, 0, 0], 33), ([3, 3, 3, 3], 7)])
def test_grouped_gemm_matches_the_reference(sizes, valid):
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    q, s = quantized(rng, (2, 4, 256, 2 * 128))
    x = jnp.asarray(rng.standard_normal((45, 256)), jnp.bfloat16)
    cols, group = block_columns(256), jnp.asarray(sizes, jnp.int32)
    got = fp8_grouped_matmul(x, q, s, cols, group, jnp.int32(1), num_valid_rows=valid, interpret=True)
    ref = fp8_gemm.fp8_grouped_matmul_reference(x, q, s, cols, group, 1, num_valid_rows=valid)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    end = min(sum(sizes), valid if valid is not None else 45)
    assert not got[end:].any()  # rows in no group (or past num_valid_rows) stay zero
    w = dequantized(q[1], s[1])
    e0 = sizes[0]  # the second expert's rows, by hand
    np.testing.assert_allclose(got[e0:min(e0 + sizes[1], end)], (np.asarray(x, np.float32) @ w[1])[e0:min(
        e0 + sizes[1], end)], rtol=3e-2, atol=3e-2 * np.abs(ref).max())


def test_gemms_refuse_what_they_cannot_tile():
    rng = np.random.default_rng(0)
    q, s = quantized(rng, (1, 256, 128))
    with pytest.raises(ValueError, match="do not match"):
        fp8_matmul(jnp.ones((4, 128)), q, s, block_columns(128), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        fp8_matmul(jnp.ones((4, 256)), q, s, block_columns(128), block_m=48, interpret=True)
    with pytest.raises(ValueError, match="at least 16"):  # Triton's dot: the model multiplies such a weight as XLA does
        fp8_matmul(jnp.ones((4, 256)), q[..., :8], s[..., :1], np.zeros(8, np.int32), interpret=True)
    assert fp8_gemm.tiles(256, 48) and not fp8_gemm.tiles(256, 8) and not fp8_gemm.tiles(192, 64)


@pytest.mark.parametrize("eq,shape,name", [
    ("td,dkf->tkf", (256, 2, 256), "w_gate_up_D2F"),
    ("thv,hvd->td", (2, 128, 256), "w_o_HVD"),
    ("tq,qhk->thk", (128, 2, 192), "w_q_b_QHK"),
    ("thv,hvd->td", (4, 64, 256), "w_o_HVD"),  # V=64: K is not blocked by 128, the dense product
])
def test_stacked_fp8_dot_is_the_dense_product(eq, shape, name):
    """What layers.dot computes for a weight the scan handed whole: the kernel (forced, interpret mode) and the
    CPU's path both equal the product with the layer dequantized."""
    rng = np.random.default_rng(7)
    q, s = quantized(rng, (3,) + shape, name)
    w = fp8.StackedWeight(q, s, jnp.int32(1), 128, jnp.dtype(jnp.float32))
    lead = {"td,dkf->tkf": (9, 256), "thv,hvd->td": (9,) + shape[:2], "tq,qhk->thk": (9, 128)}[eq]
    x = jnp.asarray(rng.standard_normal(lead), jnp.float32)
    want = jnp.einsum(eq, x, dequantized(q[1], s[1]), precision=jax.lax.Precision.HIGHEST)
    for backend in ("pallas", None):
        with jax.default_matmul_precision("highest"):  # float32 dots on a GPU: IEEE, not TF32 (the default)
            got = projection(eq, x, w, dot, backend=backend)
        assert got.shape == want.shape and got.dtype == x.dtype
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    view = w[..., :5]  # a view of some columns, read as an array: those columns of the layer
    assert isinstance(view, fp8.StackedWeight) and view.shape == shape[:-1] + (5,)
    np.testing.assert_array_equal(jnp.asarray(view), dequantized(q[1], s[1])[..., :5])
    np.testing.assert_array_equal(w[0], dequantized(q[1], s[1])[0])  # other reads: the layer


@pytest.mark.parametrize("contract,offset,width", [("A", 0, 128), ("A", 128, 128), ("B", 0, 128), ("B", 128, 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_head_gemm_matches_the_reference(contract, offset, width, dtype):
    """MLA's kv_b_proj [A, H, B] per head (4 heads), columns [offset, offset + width) of B: contracting A (the
    absorbed W_UV) or B (q_nope . W_UK), a layer of a 3-layer stack, block FP8 and plain."""
    rng = np.random.default_rng(width + offset)
    a, h, b = 256, 4, 256
    q, s = quantized(rng, (3, a, h, b), "w_kv_b_LHX")  # scales [3, 2, 4, 2]
    cols = np.arange(b) // 128
    k = a if contract == "A" else width
    x = jnp.asarray(rng.standard_normal((37, h, k)), dtype)
    w = dequantized(q[2], s[2])[..., offset:offset + width]
    exact = np.einsum("mha,ahb->mhb" if contract == "A" else "mhb,ahb->mha", np.asarray(x, np.float32), w)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    for scales, ref_w in ((s, exact), (None, None)):
        got = fp8_gemm.fp8_head_matmul(x, q, scales, None if scales is None else cols, jnp.int32(2), offset=offset,
                                       width=width, contract=contract, interpret=True, out_dtype=jnp.float32)
        ref = fp8_gemm.fp8_head_matmul_reference(x, q, scales, None if scales is None else cols, 2, offset=offset,
                                                 width=width, contract=contract, out_dtype=jnp.float32)
        assert got.shape == (37, h, width if contract == "A" else a) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())
        if ref_w is not None:
            np.testing.assert_allclose(got, ref_w, rtol=tol, atol=tol * np.abs(ref_w).max() * 2)


def test_head_gemm_refuses_what_it_cannot_tile():
    rng = np.random.default_rng(0)
    q, s = quantized(rng, (1, 256, 2, 256), "w_kv_b_LHX")
    cols = np.arange(256) // 128
    with pytest.raises(ValueError, match="do not match"):  # x's K is not A
        fp8_gemm.fp8_head_matmul(jnp.ones((4, 2, 128)), q, s, cols, contract="A", interpret=True)
    with pytest.raises(ValueError, match="at least 16"):  # a width Triton's dot cannot tile
        fp8_gemm.fp8_head_matmul(jnp.ones((4, 2, 8)), q, s, cols, width=8, contract="B", interpret=True)
    assert fp8_gemm.head_tiles(512, 192, "B") and not fp8_gemm.head_tiles(192, 128, "A")


@pytest.mark.parametrize("eq,first", [("bhn,lhn->bhl", False), ("bhl,lhv->bhv", False), ("lhv,bhl->bhv", True),
                                      ("tl,lhy->thy", False)])
def test_mla_kv_b_products_read_the_stack_in_place(eq, first):
    """MLA's products with kv_b_proj (jaxdp.model.mla, prefill): the absorbed W_UK and W_UV halves (views of the
    stacked weight), the weight-first form of the decode step and the prompt's expansion, by the kernels (forced,
    interpret mode) and by the CPU's path, equal the product with the layer dequantized."""
    from jaxdp.model.mla import weight_first

    rng = np.random.default_rng(3)
    q, s = quantized(rng, (2, 128, 4, 256), "w_kv_b_LHX")
    whole = fp8.StackedWeight(q, s, jnp.int32(1), 128, jnp.dtype(jnp.float32))
    layer = dequantized(q[1], s[1])
    w, dense = {"bhn,lhn->bhl": (whole[..., :128], layer[..., :128]),
                "tl,lhy->thy": (whole, layer)}.get(eq, (whole[..., 128:], layer[..., 128:]))
    x_shape = {"bhn,lhn->bhl": (5, 4, 128), "tl,lhy->thy": (5, 128)}.get(eq, (5, 4, 128))
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    want = np.einsum(eq, dense, np.asarray(x)) if first else np.einsum(eq, np.asarray(x), dense)
    for backend in ("pallas", None):
        if first:
            xs, ws = eq.split("->")[0].split(",")[::-1]
            got = projection(f"{xs},{ws}->{eq.split('->')[1]}", x, w, lambda _, x, w: weight_first(eq, w, x),
                             backend=backend)
        else:
            got = einsum(eq, x, w, preferred_element_type=jnp.float32) if backend is None else projection(
                eq, x, w, dot, backend="pallas")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    if first:
        np.testing.assert_allclose(weight_first(eq, w, x), want, rtol=1e-4, atol=1e-3)


CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                  num_layers=2, first_k_dense_replace=1, num_heads=2, q_lora_rank=128, kv_lora_rank=128,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=128, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, fp8_block=(128, 128))


def logits(model, backend):
    model = with_moe_runner_backend(model, backend)
    tokens = jnp.arange(6, dtype=jnp.int32) * 37 % CFG.vocab_size
    batch = AttnBatch(positions_T=jnp.arange(6) % 3, seq_T=jnp.arange(6) // 3)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        return m(tokens, jnp.ones(6, bool), batch, None, jnp.arange(6), LocalComm(), absorbed=False)[0]

    return np.asarray(run(state))


@pytest.mark.slow
def test_an_fp8_model_reads_its_stacks_in_place_with_the_same_logits():
    """A block-FP8 model (128 x 128 blocks, widths the kernels tile): under the pallas runner the layer scan
    hands the FP8 weights, the router and the experts whole (InStack) and the experts run the grouped FP8 GEMM
    (interpret mode); the logits are those of the auto runner's dequantized experts. Slow (20-50 s): the
    interpret-mode grouped GEMM inside the layer scan."""
    from jaxdp.model.quant import apply_quantization
    from jaxdp.model.stacked import read_in_place

    model = apply_quantization(DeepseekV3(CFG, nnx.Rngs(0)), None)
    assert model.moe_layers.attn.w_o_HVD.get_value().dtype == jnp.float8_e4m3fn
    pallas = with_moe_runner_backend(model, "pallas")
    whole = nnx.split(pallas.moe_layers, read_in_place(pallas.moe_layers), ...)[1]
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(whole)}
    assert {"w_o_HVD", "w_o_HVD_bscale", "w_gate_up_ED2I", "w_down_EID", "router_DE", "w_down_FD"} <= names
    assert "attn_norm" not in names and "router_bias_E" not in names
    np.testing.assert_allclose(logits(model, "pallas"), logits(model, "auto"), rtol=2e-4, atol=2e-4)


def test_in_stack_reads_as_its_layer():
    stack = jnp.arange(24.0).reshape(3, 2, 4)
    v = InStack(stack, jnp.int32(2))
    assert v.shape == (2, 4) and v.dtype == stack.dtype
    np.testing.assert_array_equal(v[...], stack[2])


@needs_plugin
def test_the_fp8_gemms_compile_for_a_simulated_h200_reading_the_stack_in_place():
    """Compiled (not only lowered) by XLA:GPU, interpret left to the kernels: one Triton custom call each, with
    the grid of its launch rule, reading the [L, ...] stack with the layer index (no layer copied out)."""
    from jaxdp.planner.hlo_checks import check_layer_copies, parse, triton_calls
    from jaxdp.planner.xla_target import compile_for_gpu

    spec = jax.ShapeDtypeStruct
    layers, m, k, n, e = 4, 512, 7168, 4608, 8  # a dense gate/up of DeepSeek-V3 under tp=8 (2F/8), 8 experts
    cols = block_columns(n)
    dense = compile_for_gpu(lambda x, w, s, i: fp8_matmul(x, w, s, cols, i), spec((m, k), jnp.bfloat16),
                            spec((layers, k, n), jnp.float8_e4m3fn), spec((layers, k // 128, n // 128), jnp.float32),
                            spec((), jnp.int32))
    mod = parse(dense.as_text())
    assert [(c["name"], c["grid"]) for c in triton_calls(mod)] == [("fp8_matmul", (m // 64, n // 64, 1))]
    assert check_layer_copies(mod, min_bytes=1)["ok"]
    grouped = compile_for_gpu(lambda x, w, s, g, i: fp8_grouped_matmul(x, w, s, cols, g, i),
                              spec((m, k), jnp.bfloat16), spec((layers, e, k, n), jnp.float8_e4m3fn),
                              spec((layers, e, k // 128, n // 128), jnp.float32), spec((e,), jnp.int32),
                              spec((), jnp.int32))
    mod = parse(grouped.as_text())
    assert [(c["name"], c["grid"]) for c in triton_calls(mod)] == [("fp8_grouped_matmul", (m // 16 + e, n // 64, 1))]
    assert check_layer_copies(mod, min_bytes=1)["ok"]
    assert grouped.memory_analysis().output_size_in_bytes == m * n * 2
    # MLA's kv_b_proj per head (DeepSeek-V3 under dp=8: [512, 128, 256]): q_nope . W_UK and W_UV after attention
    a, h, b = 512, 128, 256
    for contract, k, n in (("B", 128, a), ("A", a, 128)):
        head = compile_for_gpu(lambda x, w, s, i, c=contract: fp8_gemm.fp8_head_matmul(
            x, w, s, np.arange(b) // 128, i, offset=0 if c == "B" else 128, width=128, contract=c),
            spec((m, h, k), jnp.bfloat16), spec((layers, a, h, b), jnp.float8_e4m3fn),
            spec((layers, a // 128, h, b // 128), jnp.float32), spec((), jnp.int32))
        mod = parse(head.as_text())
        assert [(c["name"], c["grid"]) for c in triton_calls(mod)] == [("fp8_head_matmul", (m // 64, h, n // 64))]
        assert check_layer_copies(mod, min_bytes=1)["ok"]
