"""`python -m jaxdp.training.eval`: greedy accuracy per skill on the held-out problems (`jaxdp.training.data`).

Either through a running server (`--url`: OpenAI `/v1/completions`, temperature 0) or locally through
the compiled mesh step on this machine's devices (`jaxdp.one_batch.run_prompts`, greedy), under any
layout (`--mesh dp=1` by default). An answer counts when the completion, up to the eos, is exactly the
expected text.

    python -m jaxdp.training.eval --model-path default --n 200
    python -m jaxdp.training.eval --url http://127.0.0.1:30000 --n 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import ARITHMETIC, SKILLS, Problem, held_out_problems, prompt_text

MAX_NEW_TOKENS = 8  # the longest answer (5 characters) plus the eos, with room to spare
CHUNK = 64  # prompts per prefill step locally


def resolve_model_path(model_path: str | Path | None) -> Path:
    if model_path in (None, "default"):
        from jaxdp.model.loader import default_model_path

        return default_model_path()
    return Path(model_path)


def accuracy(problems: list[Problem], answers: list[str]) -> dict[str, float]:
    """Accuracy per skill, and over the arithmetic skills together ("arithmetic")."""
    hits: dict[str, list[bool]] = {}
    for p, a in zip(problems, answers, strict=True):
        hits.setdefault(p.skill, []).append(a.strip() == p.answer)
    out = {s: float(np.mean(hits[s])) for s in SKILLS if s in hits}
    arith = [h for s in ARITHMETIC for h in hits.get(s, [])]
    if arith:
        out["arithmetic"] = float(np.mean(arith))
    return out


def answers_local(model_path: str | Path | None, problems: list[Problem], layout_spec: str = "dp=1", *,
                  chat: bool = True, dtype: str = "float32", page_size: int = 16) -> list[str]:
    """Greedy answers of the model, run through the compiled mesh step under `layout_spec` (prompt i on
    rank i mod dp). Needs as many JAX devices as the layout (set up before JAX starts on a CPU)."""
    import jax

    from jaxdp.layout import ensure_host_devices, parse_mesh_spec
    from jaxdp.model.loader import load_model
    from jaxdp.one_batch import run_prompts
    from jaxdp.parallel.step import StepRunner

    path = resolve_model_path(model_path)
    tok = Tokenizer(path)
    layout = parse_mesh_spec(layout_spec)
    ensure_host_devices(layout.world)
    _, model = load_model(str(path), dtype)
    prompts = [tok.encode(prompt_text(tok, p, chat)) for p in problems]
    per_seq_pages = -(-(max(map(len, prompts), default=1) + MAX_NEW_TOKENS) // page_size)
    per_rank = -(-min(CHUNK, len(prompts)) // layout.dp)
    runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[: layout.world]),
                        num_pages=per_rank * per_seq_pages + 1, page_size=page_size)
    answers: list[str] = []
    for start in range(0, len(prompts), CHUNK):
        chunk = prompts[start:start + CHUNK]
        out = run_prompts(runner, chunk, [i % layout.dp for i in range(len(chunk))], MAX_NEW_TOKENS)
        for toks in out["tokens"]:
            toks = [int(t) for t in toks]
            if tok.eos_token_id in toks:
                toks = toks[: toks.index(tok.eos_token_id)]
            answers.append(tok.decode(toks))
    return answers


def evaluate_local(model_path: str | Path | None = "default", layout_spec: str = "dp=1", n: int = 50, *,
                   skills: tuple[str, ...] = SKILLS, chat: bool = True) -> dict[str, float]:
    """Held-out greedy accuracy per skill (n problems per skill) of a checkpoint, run on this machine."""
    problems = held_out_problems(n, skills)
    return accuracy(problems, answers_local(model_path, problems, layout_spec, chat=chat))


async def _answers_server(url: str, texts: list[str], model: str | None, concurrency: int) -> list[str]:
    import httpx

    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=120.0) as client:
        if model is None:
            r = await client.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def one(text: str) -> str:
            async with sem:
                r = await client.post(f"{base}/v1/completions", json={
                    "model": model, "prompt": text, "max_tokens": MAX_NEW_TOKENS, "temperature": 0.0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(t) for t in texts)))


def answers_server(url: str, problems: list[Problem], tok: Tokenizer, *, chat: bool = True,
                   model: str | None = None, concurrency: int = 16) -> list[str]:
    """Greedy answers from a running OpenAI-compatible server (`/v1/completions`)."""
    texts = [prompt_text(tok, p, chat) for p in problems]
    return asyncio.run(_answers_server(url, texts, model, concurrency))


def format_report(acc: dict[str, float], n: int) -> str:
    lines = [f"{'skill':<12}{'accuracy':>10}   (greedy, {n} held-out problems per skill)"]
    lines += [f"{k:<12}{v:>10.1%}" for k, v in acc.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.training.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="default", help="checkpoint directory, or 'default'")
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000 (else: run locally)")
    ap.add_argument("--served-model-name", help="the model name to send (default: the server's first)")
    ap.add_argument("--mesh", default="dp=1", help="layout for the local run")
    ap.add_argument("--n", type=int, default=200, help="held-out problems per skill")
    ap.add_argument("--skills", default=",".join(SKILLS))
    ap.add_argument("--plain", action="store_true",
                    help="plain prompts ('37+48=') instead of the chat template")
    args = ap.parse_args(argv)
    skills = tuple(s for s in args.skills.split(",") if s)
    unknown = [s for s in skills if s not in SKILLS]
    if unknown:
        print(f"error: unknown skill(s) {', '.join(unknown)}; choose from {', '.join(SKILLS)}",
              file=sys.stderr)
        return 2
    problems = held_out_problems(args.n, skills)
    try:
        path = resolve_model_path(args.model_path)
        if args.url:
            tok = Tokenizer(path)
            answers = answers_server(args.url, problems, tok, chat=not args.plain,
                                     model=args.served_model_name)
        else:
            answers = answers_local(path, problems, args.mesh, chat=not args.plain)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot reach {args.url}: {e}; start the server or drop --url", file=sys.stderr)
        return 2
    print(format_report(accuracy(problems, answers), args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
