"""The accounting reproduces the article's figures for GLM-5 on 4 ranks, and its rules hold elsewhere."""

import pytest

from jaxdp.config import get_config
from jaxdp.layout import Layout
from jaxdp.parallel.accounting import (
    FIVE_SITUATIONS,
    MAX_LEN,
    SUM_LEN,
    account_situations,
    account_step,
    bucket_for,
    decode_buckets,
    extend_buckets,
    five_situations,
)

GLM = get_config("glm-5")
KiB, MiB = 2**10, 2**20


@pytest.fixture(scope="module")
def five():
    return account_situations(Layout(dp=4, tp=1), GLM)


def test_buckets_match_sglang_defaults():
    d = decode_buckets(512)
    assert len(d) == 52 and d[:10] == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48] and d[-1] == 512
    assert d[d.index(256) + 1] == 272  # step 8 up to 256, then 16
    e = extend_buckets(2048)
    assert len(e) == 42 and e[0] == 4 and e[-1] == 2048
    assert bucket_for(40, d) == 40 and bucket_for(41, d) == 48 and bucket_for(4096, e) is None


def test_row_and_balanced_gather(five):
    a = five["balanced"]
    assert a.row_bytes == 12_288
    assert a.gather_mode == MAX_LEN and a.gathered_rows == 64
    gather = a.collective("gather")
    assert gather.buffer_bytes == 768 * KiB and gather.op == "all_gather"
    assert gather.calls == GLM.num_layers  # 75 MoE layers + 3 dense layers, all gathered
    assert a.collective("return").buffer_bytes == 768 * KiB
    assert a.collective("agreement").buffer_bytes == 4 * 10 * 4


def test_long_prompt_uses_exact_buffer(five):
    a = five["long_prompt"]
    assert a.gather_mode == SUM_LEN and not a.recorded
    assert a.gathered_rows == 4_144 and round(a.gathered_bytes / MiB, 1) == 48.6
    assert a.padded_rows == 16_384 and a.padded_bytes == 192 * MiB
    assert a.collective("gather").op == "all_reduce"


def test_five_situation_ratios(five):
    sglang = [round(five[n].experts_sglang.ratio, 1) for n in FIVE_SITUATIONS]
    assert sglang == [1.0, 4.0, 2.5, 3.7, 1.0]
    assert five["short_prompt"].experts_sglang.computed == 2_048
    assert five["short_prompt"].experts_sglang.needed == 560
    assert all(a.experts_jaxdp.ratio == 1 for a in five.values())
    assert five["skewed"].bucket == 40 and five["short_prompt"].bucket == 512


def test_lm_head_forms(five):
    bal = FIVE_SITUATIONS["balanced"].rows
    assert five["balanced"].lm_head.ratio == 4 and five["balanced"].lm_head_form == "gather"
    a2a = account_step(Layout(dp=4, lm_head_a2a=True), GLM, bal)
    assert a2a.lm_head_form == "all_to_all" and a2a.lm_head.ratio == 1
    assert a2a.collective("logits").op == "all_to_all"
    fallback = account_step(Layout(dp=4, lm_head_a2a=True), GLM, (40, 8, 8, 8))
    assert fallback.lm_head_form == "gather" and fallback.lm_head.ratio == 4
    whole = account_step(Layout(dp=4, dp_lm_head=True), GLM, bal)
    assert whole.lm_head.ratio == 1 and whole.collective("logits") is None


def test_expert_parallel_has_no_gather_in_moe_layers():
    a = account_step(Layout(dp=4, moe="ep"), GLM, (1, 0, 0, 0))
    assert a.collective("gather").calls == GLM.num_dense_layers
    d = a.collective("dispatch")
    assert d.calls == GLM.num_moe_layers and d.buffer_bytes == 1 * GLM.num_experts_per_tok * 12_288
    assert a.experts_sglang.ratio == 1 and a.attention_sglang.ratio == 4
    rep = account_step(Layout(dp=4, moe="ep", dense_replicated=True, dp_lm_head=True), GLM, (1, 0, 0, 0))
    assert rep.collective("gather") is None and rep.gather_mode == "none"
    assert rep.attention_sglang.ratio == 1 and rep.attention_jaxdp.ratio == 4  # own buckets vs one program
    prompt = account_step(Layout(dp=4, moe="ep"), GLM, (512, 16, 16, 16), is_extend=True)
    assert prompt.gather_mode == SUM_LEN  # SGLang refuses the relabeling with EP backends


def test_tp_inside_groups_folds_the_all_reduce_into_the_gather():
    a = account_step(Layout(dp=2, tp=2), GLM, (16, 16))
    scatter, gather = a.collective("attn_group_scatter"), a.collective("gather")
    assert scatter.group == 2 and scatter.op == "reduce_scatter" and scatter.buffer_bytes == 16 * 12_288
    assert gather.group == 4 and gather.buffer_bytes == 32 * 12_288
    assert a.collective("attn_allreduce") is None


def test_tensor_parallelism_and_idle():
    a = account_step(Layout(dp=1, tp=4), GLM, (64,))
    assert {c.name for c in a.collectives} == {"attn_allreduce", "mlp_allreduce", "logits"}
    assert a.collective("attn_allreduce").buffer_bytes == 768 * KiB and a.experts_sglang.ratio == 1
    idle = account_step(Layout(dp=4), GLM, (0, 0, 0, 0))
    assert idle.kind == "idle" and idle.collectives == () and idle.bytes_per_step == 0


def test_unrecorded_decode_takes_the_cheaper_mode():
    assert account_step(Layout(dp=4), GLM, (600, 0, 0, 0), is_extend=False).gather_mode == SUM_LEN
    assert account_step(Layout(dp=4), GLM, (600, 600, 600, 600), is_extend=False).gather_mode == MAX_LEN
    forced = account_step(Layout(dp=4), GLM, (16, 16, 16, 16), gather_mode="sum_len")
    assert forced.gather_mode == SUM_LEN and forced.collective("gather").op == "all_reduce"


def test_scaled_situations_on_the_tiny_model():
    tiny = get_config("tiny")
    sits = five_situations(dp=2, scale=1 / 8)
    assert sits["long_prompt"].rows == (512, 2) and sits["single"].rows == (1, 0)
    accts = account_situations(Layout(dp=2), tiny, sits, extend_max_tokens=256)
    assert accts["long_prompt"].gather_mode == SUM_LEN and accts["short_prompt"].gather_mode == MAX_LEN
    assert accts["single"].experts_sglang.ratio == 2 and accts["long_prompt"].gathered_rows == 514
    assert accts["balanced"].row_bytes == tiny.hidden_size * 2


def test_errors_and_metrics(five):
    with pytest.raises(ValueError, match="one per DP rank"):
        account_step(Layout(dp=4), GLM, (1, 2))
    with pytest.raises(ValueError, match="smaller than"):
        account_step(Layout(dp=4), GLM, (40, 8, 8, 8), bucket=32)
    m = five["skewed"].metrics()
    assert m["experts_ratio_sglang"] == 2.5 and m["experts_ratio"] == 1 and m["imbalance"] == 2.5
    assert m["bytes_gather"] == 160 * 12_288 * 78 and all(isinstance(v, int | float) for v in m.values())
    assert five["skewed"].to_dict()["experts_sglang"]["ratio"] == 2.5
