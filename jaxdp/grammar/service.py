"""The `grammars` object the engine and the API are given: `start(spec)` returns a Future of a request's matcher.

Compiles run on a small thread pool of their own, never on the event loop or the scheduler's loop; a compiled
grammar is cached by (kind, text) (least recently used first out), so a schema sent again costs one matcher.
Bounds: the text's size (`MAX_GRAMMAR_CHARS`, refused at once) and the compile's time (`COMPILE_TIMEOUT_S`: the
Future fails with one sentence then, whatever the compile still does). A compile that ran past the limit keeps its
worker until it returns (a thread cannot be stopped), so the pool refuses new grammars at once, in one sentence,
while every worker is held that way; requests without a grammar never wait on the pool at all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any

from jaxdp.grammar.backends import BACKENDS
from jaxdp.grammar.base import COMPILE_TIMEOUT_S, Backend, GrammarError, Matcher, Vocabulary

CACHE_ENTRIES = 256
WORKERS = 2


class Grammars:
    """One server's grammar service over one backend."""

    def __init__(self, backend: Backend, *, timeout_s: float = COMPILE_TIMEOUT_S, workers: int = WORKERS,
                 cache_entries: int = CACHE_ENTRIES):
        self.backend, self.timeout_s, self.workers = backend, timeout_s, workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.RLock()  # (a Future's callbacks may start another grammar)
        self._compiled: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        self._cache_entries = cache_entries
        self._overdue = 0  # workers held by a compile past its time limit

    @staticmethod
    def reading_problem(backend: str, vocab: Vocabulary | None) -> str | None:
        """Why the `backend` library cannot read `vocab`'s tokenizer (llguidance takes no tokenizer.json without a
        decoder, such as a bare word-level one), or None where it can, or where no grammar is served anyway."""
        if backend == "none" or vocab is None:
            return None
        try:
            BACKENDS[backend](vocab)
        except Exception as e:  # (each library raises its own error for a tokenizer it cannot read)
            return str(e) or type(e).__name__
        return None

    @classmethod
    def create(cls, backend: str, vocab: Vocabulary | None, **kwargs: Any) -> Grammars | None:
        """The service for `--grammar-backend backend` over `vocab` (None for "none", or without a tokenizer)."""
        return None if backend == "none" or vocab is None else cls(BACKENDS[backend](vocab), **kwargs)

    def start(self, spec: Any) -> concurrent.futures.Future[Matcher]:
        """A Future of a new matcher for `spec` (its `kind` and `text`): done at once when the grammar was compiled
        before, failed with a GrammarError when it cannot be served."""
        out: concurrent.futures.Future[Matcher] = concurrent.futures.Future()
        compiled = self._compile(spec.kind, spec.text)
        if compiled.done():
            self._finish(compiled, out)
        else:
            compiled.add_done_callback(lambda f: self._finish(f, out))
        return out

    def check(self, spec: Any) -> concurrent.futures.Future[None]:
        """A Future that fails with the GrammarError when `spec` cannot be served (the API's validation: a compile
        that the request's own start then finds in the cache)."""
        out: concurrent.futures.Future[None] = concurrent.futures.Future()
        compiled = self._compile(spec.kind, spec.text)

        def done(f: concurrent.futures.Future) -> None:
            e = f.exception()
            out.set_exception(e) if e is not None else out.set_result(None)

        compiled.add_done_callback(done)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _finish(self, compiled: concurrent.futures.Future, out: concurrent.futures.Future) -> None:
        e = compiled.exception()
        if e is not None:
            out.set_exception(e)
            return
        try:
            out.set_result(self.backend.matcher(compiled.result()))
        except GrammarError as err:
            out.set_exception(err)

    def _compile(self, kind: str, text: str) -> concurrent.futures.Future:
        key = (kind, text)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached
            future: concurrent.futures.Future = concurrent.futures.Future()
            if self._overdue >= self.workers:
                future.set_exception(GrammarError(
                    "the server's grammar compiler is busy with grammars past their time limit; try again shortly"))
                return future  # (not cached)
            self._compiled[key] = future
            while len(self._compiled) > self._cache_entries:
                self._compiled.popitem(last=False)
        timer = threading.Timer(self.timeout_s, self._overrun, (key, future, kind))
        timer.daemon = True
        work = self._pool.submit(self.backend.compile, kind, text)
        work.add_done_callback(lambda w: self._compiled_done(w, key, future, timer))
        timer.start()
        return future

    def _compiled_done(self, work: concurrent.futures.Future, key: tuple[str, str],
                       future: concurrent.futures.Future, timer: threading.Timer) -> None:
        timer.cancel()
        e = work.exception()
        if e is not None and not isinstance(e, GrammarError):  # a library's own failure, as one sentence
            e = GrammarError(f"the {key[0]} cannot be served: {type(e).__name__}")
        with self._lock:
            if future.done():  # it ran past the limit (refused then, and cached so): its worker is free again
                self._overdue -= 1
                return
            future.set_exception(e) if e is not None else future.set_result(work.result())

    def _overrun(self, key: tuple[str, str], future: concurrent.futures.Future, kind: str) -> None:
        with self._lock:
            if future.done():
                return
            self._overdue += 1
            future.set_exception(GrammarError(
                f"the {kind} did not compile within {self.timeout_s:g} s; send a simpler one"))
