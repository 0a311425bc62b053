"""Peak host memory of a load: a checkpoint of DeepSeek-V3's real widths (generated here, never committed)
loaded with --mesh tp=8 on 8 host devices through the serving construction path, in a child process
that reports its own peak RSS. The full-size run (>= 1.5 GiB, bf16 and block-FP8) is marked slow; a
smaller sibling with the same layout rules runs in CI with a bound a float32 detour or a whole-stack
host copy would break."""

import pytest

from jaxdp.bench.loading import load_in_child, real_width_config, write_checkpoint

GiB = 1 << 30
# widths that keep every split of tp=8 whole in DeepSeek's 128-wide FP8 blocks, ~0.25 GiB in bf16
SMALL = dict(vocab_size=8192, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=1024, num_heads=16,
             q_lora_rank=512, kv_lora_rank=512)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_small_real_layout_load_adds_little_beyond_the_weights(tmp_path, fp8):
    size = write_checkpoint(tmp_path, real_width_config(2, 8, **SMALL), fp8=fp8)
    got = load_in_child(tmp_path, "tp=8")
    added = got["peak_rss_bytes"] - got["rss_before_load_bytes"]
    assert added <= 1.35 * size, (added / size, got)
    by = got["weights_per_device"]
    if fp8:  # the layers' weights stayed FP8: bf16 only in the embedding (whole) and the LM head (split)
        V, D = SMALL["vocab_size"], SMALL["hidden_size"]
        assert by["float8_e4m3fn"] > 0.1 * size / 8
        assert by["bfloat16"] <= 2 * V * D * (1 + 1 / 8) + (1 << 20), by


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_real_width_checkpoint_loads_within_the_memory_of_its_weights(tmp_path, fp8):
    size = write_checkpoint(tmp_path, real_width_config(2, 8), fp8=fp8)
    assert size >= 1.5 * GiB
    got = load_in_child(tmp_path, "tp=8")
    assert got["peak_rss_bytes"] <= 1.2 * size + GiB, (got["peak_rss_bytes"] / GiB, size / GiB)
