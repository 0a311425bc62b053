"""GLM-5 sparse attention through the engine and the server: prompts longer than `index_topk` (6), read in
prefill chunks shorter than it, and a prefix reused from the cache, give transformers' greedy tokens.
The server test (a process start and a warm-up, about a minute) runs with -m slow."""

import httpx
import jax
import pytest
from servers import Server

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_dsa import TOPK, make_dsa_model  # noqa: E402

from jaxdp.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * j + 3) % 128 for j in range(23)], [(5 * j + 1) % 128 for j in range(17)],
           [(11 * j + 2) % 128 for j in range(30)]]
CHUNK = 8  # all ranks together: 4 per rank under dp=2, shorter than index_topk


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm_serving")
    return path, make_dsa_model(path, "glm")


def hf_greedy(hf, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' greedy continuation, each step a full forward over the whole sequence (no cache)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_engine_long_prompts_chunked_and_from_the_prefix_cache(glm):
    path, hf = glm
    assert all(len(p) > TOPK for p in PROMPTS) and CHUNK // 2 < TOPK
    config = EngineConfig(page_size=4, num_pages=64, max_running_requests=8, chunked_prefill_size=CHUNK,
                          decode_buckets=[1, 2, 4], extend_buckets=[4, 8], max_len_extend_rows=8)
    with jax.default_matmul_precision("highest"):
        eng = Engine(str(path), "dp=2", config)
        try:
            reqs = eng.generate(PROMPTS, GREEDY, ranks=[0, 1, 0])
            for prompt, req in zip(PROMPTS, reqs, strict=True):
                assert req.output_ids == hf_greedy(hf, prompt), req.rid
            # the first prompt again, longer: its pages come from the prefix cache (latents and index keys)
            longer = PROMPTS[0] + [9, 8, 7, 6, 5]
            again = eng.generate([longer], GREEDY, ranks=[0])[0]
            assert again.cached_tokens >= 16
            assert again.output_ids == hf_greedy(hf, longer)
        finally:
            eng.shutdown()


@pytest.mark.slow
def test_server_long_prompt_matches_transformers(glm, tmp_path):
    """Chunks of 10 // 2 = 5 per rank (a per-rank chunk under 8 leaves the server's default extend buckets,
    which start at 8, empty)."""
    path, hf = glm
    server = Server(["--model-path", str(path), "--mesh", "dp=2", "--skip-tokenizer-init", "--page-size", "4",
                     "--chunked-prefill-size", "10", "--max-running-requests", "4", "--cuda-graph-bs", "2",
                     "--max-total-tokens", "256"], tmp_path / "server.log")
    try:
        server.wait()
        body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                             "ignore_eos": True}}
        out = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        assert out["output_ids"] == hf_greedy(hf, PROMPTS[2])
    finally:
        server.stop()
