"""The xgrammar backend (`--grammar-backend xgrammar`): a grammar is xgrammar's CompiledGrammar (its compiler
caches by text too); each request gets a `GrammarMatcher`. The TokenizerInfo is built from tokenizer.json
(vocabulary by id, the decoder saying byte-level, byte-fallback or raw), not from a transformers tokenizer.
xgrammar has no bound on its own work: the grammar service's time limit is the only one.
"""

from __future__ import annotations

import json

import numpy as np

try:  # (not a dependency of jaxdp: `pip install xgrammar` to use it)
    import xgrammar
except ImportError:
    xgrammar = None

from jaxdp.grammar.base import GrammarError, Vocabulary, check_kind, schema_object, sentence


def vocab_type(tokenizer: dict):
    """How tokenizer.json writes bytes in its vocabulary: GPT-2's byte-level alphabet, SentencePiece's <0xNN>
    fallback tokens, or raw text."""
    decoders = [tokenizer.get("decoder") or {}]
    while decoders:
        decoder = decoders.pop()
        if decoder.get("type") == "ByteLevel":
            return xgrammar.VocabType.BYTE_LEVEL
        if decoder.get("type") == "ByteFallback":
            return xgrammar.VocabType.BYTE_FALLBACK
        decoders.extend(decoder.get("decoders") or [])
    return xgrammar.VocabType.RAW


class XGrammarMatcher:
    def __init__(self, inner):
        self.inner = inner

    def fill(self, bitmask_W: np.ndarray) -> None:
        self.inner.fill_next_token_bitmask(bitmask_W.reshape(1, -1))

    def accept(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def terminated(self) -> bool:
        return self.inner.is_terminated() or self.inner.is_completed()

    def reset(self) -> None:
        self.inner.reset()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        tokenizer = json.loads(vocab.tokenizer_json)
        encoded = [""] * vocab.vocab_size
        for token, i in tokenizer["model"]["vocab"].items():
            if i < vocab.vocab_size:
                encoded[i] = token
        for added in tokenizer.get("added_tokens", []):
            if added["id"] < vocab.vocab_size:
                encoded[added["id"]] = added["content"]
        info = xgrammar.TokenizerInfo(encoded, vocab_type(tokenizer), vocab_size=vocab.vocab_size,
                                      stop_token_ids=list(vocab.stop_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, kind: str, text: str):
        check_kind(kind, text)
        try:
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                schema_object(text)
                return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"the {kind} cannot be served: {sentence(e)}") from None

    def matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))
