"""`--dtype auto` on a CPU holds the weights as stored: a bf16 checkpoint stays bf16 (the native kernels read it in
place, half float32's bytes), a float32 one, random weights or the default model stay float32; a GPU takes bf16."""

import jax
import jax.numpy as jnp
import pytest

from jaxdp.bench.loading import write_checkpoint
from jaxdp.config import PRESETS
from jaxdp.engine.setup import build_runners, default_model_path
from jaxdp.layout import Layout
from jaxdp.model.checkpoint import stored_float_dtype
from jaxdp.ops.platform import default_dtype


def test_stored_float_dtype_reads_the_headers(tmp_path):
    write_checkpoint(tmp_path / "bf16", PRESETS["tiny"])
    assert stored_float_dtype(tmp_path / "bf16") == "bfloat16"
    assert stored_float_dtype(default_model_path()) == "float32"  # the embedded default model
    assert stored_float_dtype("tiny") is None and stored_float_dtype(tmp_path) is None  # a preset, no safetensors


@pytest.mark.parametrize("stored, want", [("bfloat16", "bfloat16"), ("float32", "float32"), (None, "float32")])
def test_auto_on_a_cpu_is_the_stored_dtype_where_it_is_bf16(stored, want, monkeypatch):
    assert default_dtype(stored) == want
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_dtype(stored) == "bfloat16"


def test_a_bf16_checkpoint_is_held_as_stored_under_auto(tmp_path):
    write_checkpoint(tmp_path, PRESETS["tiny"])
    layout = Layout()
    runner = build_runners(str(tmp_path), layout, [layout.make_mesh(jax.devices()[:1])], dtype="auto",
                           num_pages=4, page_size=4)[0]
    leaves = jax.tree.leaves(runner.state)
    bf16 = sum(x.nbytes for x in leaves if x.dtype == jnp.bfloat16)
    assert bf16 >= 0.99 * sum(x.nbytes for x in leaves)  # the weights as stored (float32: the routers' biases)
