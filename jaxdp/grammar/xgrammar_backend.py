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
    def __init__(self, inner, vocab: Vocabulary):
        self.inner, self.vocab = inner, vocab
        self._scratch_W = np.zeros(vocab.bitmask_words, np.int32)
        self._stops_W = np.zeros(vocab.bitmask_words, np.int32)
        for t in vocab.stop_ids:
            self._stops_W[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def fill(self, bitmask_W: np.ndarray) -> None:
        self.inner.fill_next_token_bitmask(bitmask_W.reshape(1, -1))

    def accept(self, token: int) -> bool:
        return self.inner.accept_token(token)

    def terminated(self) -> bool:
        """The grammar has ended: its stop token taken, or nothing but a stop token allowed next (llguidance's
        `is_stopped`; xgrammar's own `is_completed` is true as soon as the grammar could end, `a+` after one a)."""
        if self.inner.is_terminated():
            return True
        if not self.inner.is_completed():
            return False
        self._scratch_W[:] = 0
        self.fill(self._scratch_W)
        return bool(((self._scratch_W & ~self._stops_W) == 0).all())

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

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
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled), self.vocab)
