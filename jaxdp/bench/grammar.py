"""`python -m jaxdp.bench.grammar`: the grammar backends measured side by side, the figures that picked
llguidance (README, "Dependencies"; docs/api.md, "Structured outputs").

For each backend (`--backends`, those installed) and each tokenizer (the default model's 262-token byte-level one,
and a byte-level BPE of about 120k tokens trained here on the Python standard library's sources: the vocabulary
size of DeepSeek-V3 and GLM-5, which decides the cost of a mask), and each grammar of the set below:
- uncached start: the grammar compiled (the library's own cache emptied first) and one matcher: what the first
  request with a new grammar waits for (the tokenizer's setup, once per server, is its own column);
- cached start: one more matcher from the compiled grammar (what every later request with it waits for);
- per token: the mask filled and the token accepted, over the tokens of a valid output (median and largest, us);
- the hostile grammars: the time to an answer and whether the backend refused, served or ran past the limit.

Each timing is the median of `--repeats`. It prints a table and writes JSON (`--output`).

    python -m jaxdp.bench.grammar --output grammar.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxdp.grammar.backends import BACKENDS, installed_backends
from jaxdp.grammar.base import GrammarError, Vocabulary
from jaxdp.model.loader import default_model_path

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "status": {"enum": ["open", "paid", "shipped", "returned"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "note": {"type": ["string", "null"]}}, "required": ["id", "status", "items", "note"],
    "additionalProperties": False}
TOOL_CALLS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}, "required": ["name", "parameters"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "add"}, "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
        "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}]}}

# (name, kind, text, a valid output)
CASES = [
    ("person", "json_schema", json.dumps(PERSON), '{"name":"Ada Lovelace","age":36}'),
    ("order", "json_schema", json.dumps(ORDER),
     '{"id":"ABC-1234","status":"paid","items":[{"sku":"x-1","qty":2,"price":9.5},{"sku":"y","qty":1,"price":12}],'
     '"note":null}'),
    ("tool_calls", "json_schema", json.dumps(TOOL_CALLS),
     '[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}},{"name":"add","parameters":{"a":1,"b":2}}]'),
    ("json_object", "json_object", "", '{"a":[1,2,{"b":null}],"c":"d"}'),
    ("date_regex", "regex", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", "2026-12-07T08:15:00Z"),
    ("email_regex", "regex", r"[a-z0-9._]{1,32}@[a-z0-9]{1,20}\.(com|org|net)", "ada.lovelace@example.org"),
]
HOSTILE = [
    ("nested_200", "json_schema", json.dumps(
        {"type": "object", "properties": {"a": (inner := {"type": "object", "properties": {}})}})),
    ("enum_3k", "json_schema", json.dumps({"enum": [f"value-{i:05d}" for i in range(3000)]})),
    ("dfa_blowup_regex", "regex", "(a|b)*a(a|b){24}"),
    ("nested_repeat_regex", "regex", "((a{1,50}){1,50}){1,50}b"),
    ("wide_counts_regex", "regex", "[a-z]{1000,60000}"),
]


def _nest(schema: dict, depth: int) -> dict:
    node = schema
    for _ in range(depth):
        child = {"type": "object", "properties": {}}
        node["properties"]["a"] = child
        node = child
    return schema


HOSTILE[0] = ("nested_200", "json_schema", json.dumps(_nest({"type": "object", "properties": {}}, 200)))


def synthetic_tokenizer(vocab_size: int = 131072, corpus_chars: int = 30_000_000) -> str:
    """tokenizer.json of a byte-level BPE trained on the standard library's .py files (the first `corpus_chars`)."""
    texts, n = [], 0
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        if "site-packages" in f:
            continue
        try:
            texts.append(Path(f).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        n += len(texts[-1])
        if n > corpus_chars:
            break
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok.to_str()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_case(backend_cls, vocab: Vocabulary, tok: tokenizers.Tokenizer, kind: str, text: str, valid: str,
                 repeats: int) -> dict:
    backend = backend_cls(vocab)

    def uncached_start():
        if hasattr(backend, "compiler"):  # xgrammar's own cache (llguidance keeps none)
            backend.compiler.clear_cache()
        backend.matcher(backend.compile(kind, text))

    uncached = _median_time(uncached_start, repeats)
    compiled = backend.compile(kind, text)
    cached = _median_time(lambda: backend.matcher(compiled), repeats)
    ids = tok.encode(valid, add_special_tokens=False).ids
    per_token = []
    bitmask_W = np.zeros(vocab.bitmask_words, np.int32)
    for _ in range(repeats):
        m = backend.matcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill(bitmask_W)
            ok = m.accept(t)
            per_token.append(time.perf_counter() - t0)
            if not (bitmask_W[t // 32] >> (t % 32)) & 1 or not ok:
                raise RuntimeError(f"{backend.name}: the valid output {valid!r} was refused at token {t}")
        bitmask_W[:] = 0
        m.fill(bitmask_W)
        if not all((bitmask_W[s // 32] >> (s % 32)) & 1 for s in vocab.stop_ids):
            raise RuntimeError(f"{backend.name}: the stop token is not allowed after {valid!r}")
    return {"uncached_ms": uncached * 1e3, "cached_ms": cached * 1e3, "tokens": len(ids),
            "token_us_median": statistics.median(per_token) * 1e6, "token_us_max": max(per_token) * 1e6}


def measure_hostile(backend: str, tokenizer_file: str, vocab_size: int, stop_id: int, case: str,
                    limit_s: float) -> dict:
    """The time to an answer (compile, one matcher and a first mask) in a child process, killed at `limit_s`: a
    compile that does not return would otherwise hold a thread (and a core) for the rest of the run."""
    cmd = [sys.executable, "-m", "jaxdp.bench.grammar", "--hostile-one", case, "--backends", backend,
           "--tokenizer-file", tokenizer_file, "--vocab-size", str(vocab_size), "--stop-id", str(stop_id)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
        outcome = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else \
            f"failed: exit {done.returncode}: {done.stderr.strip()[-80:]}"
        seconds = float(outcome.split(" ", 1)[0]) if outcome[0].isdigit() else time.perf_counter() - t0
        outcome = outcome.split(" ", 1)[1] if outcome[0].isdigit() else outcome
    except subprocess.TimeoutExpired:
        seconds, outcome = time.perf_counter() - t0, f"past {limit_s:g} s (killed)"
    return {"seconds": seconds, "outcome": outcome}


def hostile_one(backend: str, vocab: Vocabulary, case: str) -> str:
    """One hostile grammar in this process: "SECONDS OUTCOME"."""
    kind, text = next((k, t) for name, k, t in HOSTILE if name == case)
    t0 = time.perf_counter()
    try:
        b = BACKENDS[backend](vocab)
        t0 = time.perf_counter()  # (the tokenizer's setup is not the grammar's)
        m = b.matcher(b.compile(kind, text))
        m.fill(np.zeros(vocab.bitmask_words, np.int32))
        outcome = "served"
    except GrammarError as e:
        outcome = f"refused: {str(e)[:90]}"
    return f"{time.perf_counter() - t0:.3f} {outcome}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxdp.bench.grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: all jaxdp knows)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hostile-limit", type=float, default=10.0, metavar="S")
    p.add_argument("--no-large-vocab", action="store_true", help="the default model's tokenizer only")
    p.add_argument("--output", default=None, metavar="FILE")
    p.add_argument("--hostile-one", default=None, help=argparse.SUPPRESS)  # (the child of measure_hostile)
    p.add_argument("--tokenizer-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--stop-id", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hostile_one:
        vocab = Vocabulary(Path(args.tokenizer_file).read_text(), args.vocab_size, (args.stop_id,))
        print(hostile_one(args.backends, vocab, args.hostile_one))
        return 0
    names = [n for n in args.backends.split(",") if n]
    available = installed_backends()
    missing = [n for n in names if n not in available]
    if missing:
        print(f"not installed: {', '.join(missing)} (pip install the library to measure it)", file=sys.stderr)
        names = [n for n in names if n in available]
    default_json = (default_model_path() / "tokenizer.json").read_text()
    vocabs = [("default-262", Vocabulary(default_json, 512, (2,)))]
    if not args.no_large_vocab:
        t0 = time.perf_counter()
        synth = synthetic_tokenizer()
        size = tokenizers.Tokenizer.from_str(synth).get_vocab_size()
        print(f"trained a byte-level BPE of {size} tokens in {time.perf_counter() - t0:.1f} s")
        vocabs.append((f"bpe-{size // 1000}k", Vocabulary(synth, size, (0,))))
    rows, hostile = [], []
    tmp = tempfile.TemporaryDirectory()
    for vname, vocab in vocabs:
        tok = tokenizers.Tokenizer.from_str(vocab.tokenizer_json)
        tokenizer_file = os.path.join(tmp.name, f"{vname}.json")
        Path(tokenizer_file).write_text(vocab.tokenizer_json)
        for name in names:
            cls = BACKENDS[name]
            t0 = time.perf_counter()
            cls(vocab)
            setup_ms = (time.perf_counter() - t0) * 1e3
            for case, kind, text, valid in CASES:
                r = measure_case(cls, vocab, tok, kind, text, valid, args.repeats)
                rows.append({"backend": name, "vocab": vname, "tokenizer_setup_ms": setup_ms, "grammar": case} | r)
                print(f"{name} {vname} {case}: {r['uncached_ms']:.1f} ms", file=sys.stderr, flush=True)
            for case, _, _ in HOSTILE:
                hostile.append({"backend": name, "vocab": vname, "grammar": case} | measure_hostile(
                    name, tokenizer_file, vocab.vocab_size, vocab.stop_ids[0], case, args.hostile_limit))
                print(f"{name} {vname} {case}: {hostile[-1]['outcome']}", file=sys.stderr, flush=True)
    print(f"\n{'backend':<11} {'vocab':<12} {'grammar':<12} {'uncached ms':>11} {'cached ms':>9} "
          f"{'tokens':>6} {'us/token':>8} {'max us':>8} {'setup ms':>8}")
    for r in rows:
        print(f"{r['backend']:<11} {r['vocab']:<12} {r['grammar']:<12} {r['uncached_ms']:>11.2f} "
              f"{r['cached_ms']:>9.3f} {r['tokens']:>6} {r['token_us_median']:>8.1f} {r['token_us_max']:>8.0f} "
              f"{r['tokenizer_setup_ms']:>8.0f}")
    print(f"\n{'backend':<11} {'vocab':<12} {'hostile grammar':<20} {'seconds':>8}  outcome")
    for h in hostile:
        print(f"{h['backend']:<11} {h['vocab']:<12} {h['grammar']:<20} {h['seconds']:>8.2f}  {h['outcome']}")
    if args.output:
        Path(args.output).write_text(json.dumps({"cases": rows, "hostile": hostile}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
