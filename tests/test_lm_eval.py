"""EleutherAI's lm-evaluation-harness itself (pinned: pyproject's `eval` extra) against
`python -m jaxdp.serve --mesh dp=8` on the default model, with its defaults (`--model local-completions`, which
finds /tokenizer_info and /tokenize and uses the server's tokenizer): a generate-until task and a multiple-choice
(loglikelihood: `echo` with `logprobs`) task on held-out sums, written here as task YAMLs over local JSONL (nothing
is downloaded but lm-eval from PyPI). Both score what the same computation gives offline (`one_batch.run_prompts`
on one device): the same answers, the same log-likelihood of every choice within 1e-4, and at least 0.9.

Slow (about 75 s, plus 45 s to make lm-eval's venv the first time): lm-eval and its 39 dependencies (datasets,
pandas, pyarrow, scikit-learn, ...) go into a venv of their own (LM_EVAL_VENV names an existing one), not into the
test extra that every CI run installs while this test does not run there."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest
from servers import Server

from jaxdp.model.loader import default_model_path

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["eval"][0]
N = 50  # held-out sums per task
HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_DEFAULT, reason="needs the embedded default model")]


@pytest.fixture(scope="module")
def lm_eval_bin() -> Path:
    version = LM_EVAL.split("==")[1]
    venv = Path(os.environ.get("LM_EVAL_VENV") or Path.home() / ".cache" / "jaxdp" / "venvs" / f"lm-eval-{version}")
    exe = venv / "bin" / "lm_eval"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LM_EVAL], check=True, timeout=3600)
    return exe


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    server = Server(["--mesh", "dp=8", "--max-running-requests", "32", "--cuda-graph-bs", "4"],
                    tmp_path_factory.mktemp("lm_eval") / "server.log")
    try:
        yield server.wait().url
    finally:
        server.stop()


def write_tasks(where: Path, tok) -> tuple[list, list]:
    """Two tasks over the same held-out sums: the answer generated, and the answer chosen among four."""
    from jaxdp.training.data import held_out_problems, prompt_text

    problems = held_out_problems(N, ("add",))
    gen, mc = [], []
    for i, p in enumerate(problems):
        prompt, a = prompt_text(tok, p, chat=True), int(p.answer)
        choices = [f"{c}<eos>" for c in (a, a + 1, a - 10, a + 11)]
        choices[0], choices[i % 4] = choices[i % 4], choices[0]
        gen.append({"prompt": prompt, "answer": p.answer})
        mc.append({"prompt": prompt, "choices": choices, "label": i % 4})
    for name, rows, spec in (
            ("sums", gen, "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n"
                          "  until: [\"<eos>\"]\n  max_gen_toks: 8\n  temperature: 0\nmetric_list:\n"
                          "  - metric: exact_match\n"),
            ("sums_mc", mc, "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
                            "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n")):
        (where / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (where / f"{name}.yaml").write_text(
            f"task: jaxdp_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {where / name}.jsonl\ntest_split: test\ndoc_to_text: \"{{{{prompt}}}}\"\n"
            f"target_delimiter: \"\"\n{spec}")
    return problems, mc


def offline(tok, problems, mc) -> tuple[list[str], list[list[tuple[float, bool]]]]:
    """Greedy answers and each choice's (log-likelihood, greedy?) from the offline logits on one device."""
    from jaxdp.layout import Layout
    from jaxdp.model.loader import load_model
    from jaxdp.one_batch import run_prompts
    from jaxdp.parallel.step import StepRunner
    from jaxdp.training.eval import answers_local

    answers = answers_local("default", problems, "dp=1")
    seqs, spans = [], []
    for doc in mc:
        ctx = tok.encode(doc["prompt"], add_special_tokens=False)
        for choice in doc["choices"]:
            whole = tok.encode(doc["prompt"] + choice, add_special_tokens=False)
            seqs.append(whole)
            spans.append(len(ctx))
    lay = Layout()
    runner = StepRunner(load_model(str(default_model_path()), "float32")[1], lay, lay.make_mesh(jax.devices()[:1]),
                        num_pages=sum(-(-len(s) // 16) for s in seqs) + 1, page_size=16)
    logits = run_prompts(runner, seqs, [0] * len(seqs), 0)["prompt"]
    scores = []
    for ids, n, lg in zip(seqs, spans, logits, strict=True):
        lg = lg.astype(np.float64)
        lp = lg - lg.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        rows = range(n - 1, len(ids) - 1)
        scores.append((sum(lp[r, ids[r + 1]] for r in rows), all(lp[r].argmax() == ids[r + 1] for r in rows)))
    return answers, [scores[i:i + 4] for i in range(0, len(scores), 4)]


def test_lm_eval_scores_what_the_offline_computation_gives(lm_eval_bin, url, tmp_path):
    from jaxdp.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    problems, mc = write_tasks(tmp_path, tok)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [str(lm_eval_bin), "run", "--model", "local-completions", "--model_args",
         f"base_url={url}/v1/completions,model={model}", "--tasks", "jaxdp_sums,jaxdp_sums_mc", "--include_path",
         str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Using remote tokenizer" in proc.stderr + proc.stdout  # its default found the server's tokenizer

    def samples(task: str) -> list[dict]:
        (path,) = glob.glob(str(tmp_path / "out" / "*" / f"samples_{task}_[0-9]*.jsonl"))
        return sorted((json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])

    answers, scores = offline(tok, problems, mc)
    gen = samples("jaxdp_sums")
    assert [s["filtered_resps"][0] for s in gen] == answers
    exact = np.mean([s["exact_match"] for s in gen])
    assert exact == np.mean([a == p.answer for a, p in zip(answers, problems, strict=True)]) and exact >= 0.9

    choice = samples("jaxdp_sums_mc")
    served = np.asarray([[float(r[0]) for r in s["filtered_resps"]] for s in choice])
    want = np.asarray([[ll for ll, _ in doc] for doc in scores])
    np.testing.assert_allclose(served, want, rtol=0, atol=1e-4)
    assert [[r[1] == "True" for r in s["filtered_resps"]] for s in choice] == [[g for _, g in d] for d in scores]
    acc = np.mean([s["acc"] for s in choice])
    assert acc == np.mean(want.argmax(1) == [d["label"] for d in mc]) and acc >= 0.9
