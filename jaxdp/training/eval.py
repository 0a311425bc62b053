"""`python -m jaxdp.training.eval`: greedy accuracy per skill on the held-out problems (`jaxdp.training.data`).

Either through a running server (`--url`: OpenAI `/v1/completions`, temperature 0) or locally through
the compiled mesh step on this machine's devices (`jaxdp.one_batch.run_prompts`, greedy), under any
layout (`--mesh dp=1` by default). An answer counts when the completion, up to the eos, is exactly the
expected text.

    python -m jaxdp.training.eval --model-path default --n 200
    python -m jaxdp.training.eval --url http://127.0.0.1:30000 --n 200
    python -m jaxdp.training.eval --accept-steps 3 --n 100     # the MTP layer's accept length (speculate)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.layout import ensure_host_devices, parse_mesh_spec
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.loader import check_mtp_checkpoint, default_model_path, load_model, load_mtp
from jaxdp.model.mla import AttnBatch
from jaxdp.model.mtp import MTPLayer
from jaxdp.one_batch import run_prompts
from jaxdp.parallel.local import LocalComm
from jaxdp.parallel.step import StepRunner
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import ARITHMETIC, LONG, LONG_MAX, SKILLS, Problem, held_out_problems, prompt_text

MAX_NEW_TOKENS = 8  # the longest short answer (5 characters) plus the eos, with room to spare
MAX_NEW_TOKENS_LONG = LONG_MAX + 4  # the long skills' answers: up to 64 letters and the eos
CHUNK = 64  # prompts per prefill step locally


def resolve_model_path(model_path: str | Path | None) -> Path:
    if model_path in (None, "default"):
        return default_model_path()
    return Path(model_path)


def max_new_tokens(skill: str) -> int:
    """The tokens a greedy answer of `skill` may take (its eos included)."""
    return MAX_NEW_TOKENS_LONG if skill in LONG else MAX_NEW_TOKENS


def accuracy(problems: list[Problem], answers: list[str]) -> dict[str, float]:
    """Accuracy per skill, over the arithmetic skills together ("arithmetic") and the long ones ("long")."""
    hits: dict[str, list[bool]] = {}
    for p, a in zip(problems, answers, strict=True):
        hits.setdefault(p.skill, []).append(a.strip() == p.answer)
    out = {s: float(np.mean(hits[s])) for s in SKILLS if s in hits}
    arith = [h for s in ARITHMETIC for h in hits.get(s, [])]
    if arith:
        out["arithmetic"] = float(np.mean(arith))
    long = [h for s in LONG for h in hits.get(s, [])]
    if long:
        out["long"] = float(np.mean(long))
    return out


def greedy_tokens_local(model_path: str | Path | None, problems: list[Problem], layout_spec: str = "dp=1", *,
                        chat: bool = True, dtype: str = "float32", page_size: int = 16) -> list[list[int]]:
    """Greedy output tokens of the model (up to the eos, excluded), run through the compiled mesh step under
    `layout_spec` (prompt i on rank i mod dp). Needs as many JAX devices as the layout (set up before JAX
    starts on a CPU)."""
    import jax

    path = resolve_model_path(model_path)
    tok = Tokenizer(path)
    layout = parse_mesh_spec(layout_spec)
    ensure_host_devices(layout.world)
    _, model = load_model(str(path), dtype)
    prompts = [tok.encode(prompt_text(tok, p, chat)) for p in problems]
    budget = max((max_new_tokens(p.skill) for p in problems), default=MAX_NEW_TOKENS)
    per_seq_pages = -(-(max(map(len, prompts), default=1) + budget) // page_size)
    per_rank = -(-min(CHUNK, len(prompts)) // layout.dp)
    runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[: layout.world]),
                        num_pages=per_rank * per_seq_pages + 1, page_size=page_size)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), CHUNK):
        chunk = prompts[start:start + CHUNK]
        new = max(max_new_tokens(p.skill) for p in problems[start:start + CHUNK])
        out = run_prompts(runner, chunk, [i % layout.dp for i in range(len(chunk))], new)
        for toks in out["tokens"]:
            toks = [int(t) for t in toks]
            outputs.append(toks[: toks.index(tok.eos_token_id)] if tok.eos_token_id in toks else toks)
    return outputs


def answers_local(model_path: str | Path | None, problems: list[Problem], layout_spec: str = "dp=1", *,
                  chat: bool = True, dtype: str = "float32", page_size: int = 16) -> list[str]:
    """Greedy answers of the model (`greedy_tokens_local`, decoded)."""
    tok = Tokenizer(resolve_model_path(model_path))
    return [tok.decode(t) for t in greedy_tokens_local(model_path, problems, layout_spec, chat=chat, dtype=dtype,
                                                       page_size=page_size)]


def evaluate_local(model_path: str | Path | None = "default", layout_spec: str = "dp=1", n: int = 50, *,
                   skills: tuple[str, ...] = SKILLS, chat: bool = True) -> dict[str, float]:
    """Held-out greedy accuracy per skill (n problems per skill) of a checkpoint, run on this machine."""
    problems = held_out_problems(n, skills)
    return accuracy(problems, answers_local(model_path, problems, layout_spec, chat=chat))


# ---- speculative decoding, simulated offline: accept length ------------------------------------------------

Drafter = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (tokens [P, W], lengths [P]) -> drafts [P, k]


def _flat_batch(n, W: int) -> tuple[AttnBatch, jax.Array]:
    """One sequence of n rows (the rest padding) as a flat step without a cache."""
    rows = jnp.arange(W, dtype=jnp.int32)
    valid = rows < n
    return AttnBatch(positions_T=rows, seq_T=jnp.where(valid, 0, 1)), valid


def _target(model: DeepseekV3, tokens_W: jax.Array, n, logits_idx: jax.Array, *, hidden: bool = False):
    """The model over one sequence's first n rows, recomputed (no cache): the logits of the rows `logits_idx`
    (with `hidden`: the final normed hidden state of every row instead)."""
    W = tokens_W.shape[0]
    batch, valid = _flat_batch(n, W)
    rows = jnp.arange(W, dtype=jnp.int32) if hidden else logits_idx
    out = model(tokens_W, valid, batch, None, rows, LocalComm(dense_experts=True), absorbed=False,
                return_hidden=hidden)
    return out[3] if hidden else out[0]


def mtp_chain(model: DeepseekV3, mtp: MTPLayer, tokens_W: jax.Array, n, k: int) -> jax.Array:
    """k draft tokens [k] after the first n tokens of `tokens_W`, by the engine's draft chain (full recompute):
    step 1 at row n - 2 reads the target's final normed hidden state of row n - 2 and token n - 1 (every row
    i <= n - 2 of the draft pass likewise: hidden i, token i + 1); step s > 1 is one more row, n - 3 + s, reading
    the previous step's output after `mtp.shared_norm` and the token it drafted, over the rows before it."""
    W = tokens_W.shape[0]
    hidden = _target(model, tokens_W, n, None, hidden=True)
    tok_in = jnp.concatenate([tokens_W[1:], tokens_W[-1:]])  # row i: token i + 1
    hid_in, embed, head, drafts = hidden, model.embed_VD[...], model.lm_head_weight(), []
    for s in range(k):
        r = n - 2 + s  # the row of draft step s + 1
        batch, valid = _flat_batch(r + 1, W)
        logits, x, _, _ = mtp(tok_in, hid_in, valid, batch, None, jnp.reshape(r, (1,)).astype(jnp.int32),
                              LocalComm(dense_experts=True), embed, head, absorbed=False)
        d = jnp.argmax(logits[0]).astype(tokens_W.dtype)
        drafts.append(d)
        nxt = jnp.minimum(r + 1, W - 1)
        tok_in = tok_in.at[nxt].set(d)
        hid_in = hid_in.at[nxt].set(mtp.shared_norm(x[r]).astype(hid_in.dtype))
    return jnp.stack(drafts)


def target_chain(model: DeepseekV3, tokens_W: jax.Array, n, k: int) -> jax.Array:
    """k draft tokens by the target itself, greedily (the ideal drafter: every draft is accepted)."""
    drafts = []
    for s in range(k):
        logits = _target(model, tokens_W, n + s, jnp.reshape(n + s - 1, (1,)).astype(jnp.int32))
        d = jnp.argmax(logits[0]).astype(tokens_W.dtype)
        drafts.append(d)
        tokens_W = tokens_W.at[jnp.minimum(n + s, tokens_W.shape[0] - 1)].set(d)
    return jnp.stack(drafts)


def make_drafter(chain: Callable[..., jax.Array], *modules: nnx.Module, k: int) -> Drafter:
    """A batched, compiled drafter from a chain function (`mtp_chain`, `target_chain`) and its modules."""
    graphs, states = zip(*(nnx.split(m) for m in modules), strict=True)

    @jax.jit
    def run(states, tokens_PW, n_P):
        mods = [nnx.merge(g, st) for g, st in zip(graphs, states, strict=True)]
        return jax.vmap(lambda t, n: chain(*mods, t, n, k))(tokens_PW, n_P)

    return lambda tokens, n: np.asarray(run(states, jnp.asarray(tokens), jnp.asarray(n)))


def speculate(model: DeepseekV3, drafter: Drafter, prompts: list[list[int]], max_new: int, k: int, eos_id: int
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy speculative decoding, simulated with full recomputes: the target's first token from the prompt,
    then per verify k drafts (`drafter`) checked against the target's greedy tokens at once; the longest
    agreeing prefix is accepted plus the target's own next token. Returns each prompt's output (up to max_new
    tokens, the eos included) and the tokens accepted at each of its verifies (accepted drafts + 1; the last
    verify cut at the eos or at max_new). The outputs are the target's greedy ones whatever the drafter."""
    P = len(prompts)
    W = -(-(max(map(len, prompts)) + max_new + k + 1) // 16) * 16
    graph, state = nnx.split(model)

    @jax.jit
    def verify(state, tokens_PW, n_P):  # the target's greedy token after each of rows n - 1 .. n - 1 + k
        m = nnx.merge(graph, state)
        idx = lambda n: n - 1 + jnp.arange(k + 1, dtype=jnp.int32)  # noqa: E731
        return jax.vmap(lambda t, n: jnp.argmax(_target(m, t, n + k, idx(n)), -1))(tokens_PW, n_P)

    outs: list[list[int]] = [[] for _ in range(P)]
    accepted: list[list[int]] = [[] for _ in range(P)]
    tokens = np.zeros((P, W), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    n = np.array([len(p) for p in prompts], np.int32)
    first = np.asarray(verify(state, tokens, n - k))[np.arange(P), k]  # (rows beyond n are ignored)
    for i in range(P):
        outs[i].append(int(first[i]))
        tokens[i, n[i]] = first[i]
    n += 1
    active = [o[-1] != eos_id and len(o) < max_new for o in outs]
    while any(active):
        drafts = drafter(tokens, n)
        for i in range(P):
            tokens[i, n[i]: n[i] + k] = drafts[i] if active[i] else 0
        greedy = np.asarray(verify(state, tokens, n))
        for i in range(P):
            if not active[i]:
                continue
            a = 0
            while a < k and drafts[i, a] == greedy[i, a]:
                a += 1
            new = [int(t) for t in greedy[i, : a + 1]]
            if eos_id in new:
                new = new[: new.index(eos_id) + 1]
            new = new[: max_new - len(outs[i])]
            outs[i] += new
            accepted[i].append(len(new))
            tokens[i, n[i]: n[i] + len(new)] = new
            tokens[i, n[i] + len(new):] = 0
            n[i] += len(new)
            active[i] = outs[i][-1] != eos_id and len(outs[i]) < max_new
    return outs, accepted


def accept_lengths(problems: list[Problem], accepted: list[list[int]]) -> dict[str, float]:
    """Accept length per skill (and over the long skills, "long"): tokens per verify, over all its verifies."""
    per: dict[str, list[int]] = {}
    for p, acc in zip(problems, accepted, strict=True):
        per.setdefault(p.skill, []).extend(acc)
    out = {s: float(np.mean(per[s])) for s in SKILLS if per.get(s)}
    long = [a for s in LONG for a in per.get(s, [])]
    if long:
        out["long"] = float(np.mean(long))
    return out


def evaluate_speculative(model_path: str | Path | None = "default", n: int = 50, k: int = 3, *,
                         skills: tuple[str, ...] = SKILLS, chat: bool = True
                         ) -> tuple[dict[str, float], dict[str, float]]:
    """(accept length per skill, greedy accuracy per skill) of a checkpoint's MTP layer drafting k steps for its
    model, on n held-out problems per skill, simulated on this machine (`speculate`)."""
    path = resolve_model_path(model_path)
    check_mtp_checkpoint(str(path))
    tok = Tokenizer(path)
    _, model = load_model(str(path), "float32")
    _, mtp = load_mtp(str(path), "float32")
    drafter = make_drafter(mtp_chain, model, mtp, k=k)
    problems = held_out_problems(n, skills)
    outputs: list[list[int]] = [[] for _ in problems]
    accepted: list[list[int]] = [[] for _ in problems]
    for long in (False, True):  # two shapes: the short answers and the long ones
        idx = [i for i, p in enumerate(problems) if (p.skill in LONG) == long]
        if not idx:
            continue
        prompts = [tok.encode(prompt_text(tok, problems[i], chat)) for i in idx]
        outs, accs = speculate(model, drafter, prompts, max_new_tokens(problems[idx[0]].skill), k,
                               tok.eos_token_id)
        for i, o, a in zip(idx, outs, accs, strict=True):
            outputs[i], accepted[i] = o, a
    answers = [tok.decode([t for t in o if t != tok.eos_token_id]) for o in outputs]
    return accept_lengths(problems, accepted), accuracy(problems, answers)


def format_accept_report(accept: dict[str, float], acc: dict[str, float], n: int, k: int) -> str:
    lines = [f"{'skill':<14}{'accept length':>14}{'accuracy':>10}   (greedy, {k} draft steps, {n} held-out "
             "problems per skill)"]
    lines += [f"{s:<14}{v:>14.2f}{acc.get(s, float('nan')):>10.1%}" for s, v in accept.items()]
    return "\n".join(lines)


async def _answers_server(url: str, texts: list[str], model: str | None, concurrency: int,
                          budget: int = MAX_NEW_TOKENS) -> list[str]:
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
                    "model": model, "prompt": text, "max_tokens": budget, "temperature": 0.0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(t) for t in texts)))


def answers_server(url: str, problems: list[Problem], tok: Tokenizer, *, chat: bool = True,
                   model: str | None = None, concurrency: int = 16) -> list[str]:
    """Greedy answers from a running OpenAI-compatible server (`/v1/completions`)."""
    texts = [prompt_text(tok, p, chat) for p in problems]
    budget = max((max_new_tokens(p.skill) for p in problems), default=MAX_NEW_TOKENS)
    return asyncio.run(_answers_server(url, texts, model, concurrency, budget))


def format_report(acc: dict[str, float], n: int) -> str:
    lines = [f"{'skill':<12}{'accuracy':>10}   (greedy, {n} held-out problems per skill)"]
    lines += [f"{k:<12}{v:>10.1%}" for k, v in acc.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.training.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="default", help="checkpoint directory, or 'default'")
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000 (else: run locally)")
    ap.add_argument("--served-model-name", help="the model name to send (default: the server's first)")
    ap.add_argument("--mesh", default="dp=1", help="layout for the local run")
    ap.add_argument("--n", type=int, default=200, help="held-out problems per skill")
    ap.add_argument("--skills", default=",".join(SKILLS))
    ap.add_argument("--plain", action="store_true",
                    help="plain prompts ('37+48=') instead of the chat template")
    ap.add_argument("--accept-steps", type=int, default=0, metavar="K",
                    help="measure the checkpoint's MTP layer instead: greedy speculative decoding with K draft "
                         "steps, simulated here; prints the accept length per skill")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    skills = tuple(s for s in args.skills.split(",") if s)
    unknown = [s for s in skills if s not in SKILLS]
    if unknown:
        print(f"error: unknown skill(s) {', '.join(unknown)}; choose from {', '.join(SKILLS)}",
              file=sys.stderr)
        return 2
    if args.accept_steps < 0 or (args.accept_steps and args.url):
        print("error: --accept-steps takes a number of draft steps >= 1 and runs locally (without --url)",
              file=sys.stderr)
        return 2
    if args.accept_steps:
        try:
            accept, acc = evaluate_speculative(args.model_path, args.n, args.accept_steps, skills=skills,
                                               chat=not args.plain)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_accept_report(accept, acc, args.n, args.accept_steps))
        return 0
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
