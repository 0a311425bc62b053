"""Requests and their sampling parameters, as the schedulers and the API see them (no arrays here); what the engine
asks of a grammar backend (`GrammarSpec`, `Matcher`, `Grammars`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import math
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import re2

MAX_LOGPROB_TOKEN_IDS = 20  # token_ids_logprob: the most token ids a request may ask about
MAX_MIN_TOKENS_STOP_IDS = 16  # the most stop_token_ids beside a min_new_tokens (the sampler masks each of them)
BAN_WIDTH = 2 * MAX_MIN_TOKENS_STOP_IDS  # a step row's ids min_new_tokens holds off: stop ids and the model's eos ids
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries: a step row holds this many (id, bias) pairs
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class BadRequest(ValueError):
    """A request the engine cannot serve as given; the message says what to change (HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A grammar a request's output must follow: `kind` one of GRAMMAR_KINDS, `text` the schema, regex or EBNF
    (json_object: any JSON object; its text is ignored)."""

    kind: str
    text: str = ""


class Matcher(Protocol):
    """One request's place in its grammar (a grammar backend makes it; the engine's loop thread alone calls it)."""

    def fill(self, bitmask_W: np.ndarray) -> None:
        """Write the tokens the grammar allows next into an int32 row of ceil(V/32) words: bit j of word i
        set = token 32*i+j allowed."""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it."""

    def terminated(self) -> bool:
        """The grammar reached its end (the request finishes, "stop")."""

    def reset(self) -> None:
        """Back to the grammar's start."""

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a verify walks a request's drafts and back)."""


class Grammars(Protocol):
    """A grammar backend as the engine is given it: compiling happens off the engine's loop."""

    def start(self, spec: GrammarSpec) -> concurrent.futures.Future[Matcher]:
        """A matcher of `spec` at its start, once compiled (a failed future: the request ends with its message)."""


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0  # no stop (eos, stop ids, stop strings) ends it before this many output tokens
    return_logprob: bool = False
    top_logprobs: int = 0  # alternatives per output token (0..MAX_TOP_LOGPROBS), best first
    logprob_start_len: int = -1  # prompt logprobs from this position on (-1: none; SGLang's name)
    token_ids_logprob: list[int] | None = None  # logprobs of these tokens at every position that reports logprobs
    frequency_penalty: float = 0.0  # OpenAI's: logit -= frequency_penalty * count over output tokens
    presence_penalty: float = 0.0  # ... and -= presence_penalty if the token is in the output
    repetition_penalty: float = 1.0  # HF/vLLM's, over prompt and output tokens: positive logits divided, others times
    logit_bias: dict[int, float] | None = None  # token id: bias added to its logit (at most MAX_LOGIT_BIAS)
    grammar: GrammarSpec | None = None  # the output follows this grammar (the engine's `Grammars` compiles it)
    stop_regex: list[str] = dataclasses.field(default_factory=list)  # SGLang's: stop once the output matches one
    no_stop_trim: bool = False  # SGLang's (vLLM's include_stop_str_in_output): the stop string stays in the text

    @property
    def has_penalties(self) -> bool:
        """The request takes a penalty slot (its output's token counts kept on the device)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_controls(self) -> bool:
        """Its step rows carry a logit bias or penalties (`jaxdp.engine.step.controls`)."""
        return bool(self.logit_bias) or self.has_penalties

    @property
    def wants_top(self) -> bool:
        """The step computes per-row alternatives for this request (top logprobs or chosen token ids)."""
        return self.top_logprobs > 0 or bool(self.token_ids_logprob)

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise BadRequest(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise BadRequest(f"top_k must be -1 (all) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.logprob_start_len, int) or self.logprob_start_len < -1:
            raise BadRequest(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position, got "
                             f"{self.logprob_start_len!r}")
        if self.token_ids_logprob is not None and len(self.token_ids_logprob) > MAX_LOGPROB_TOKEN_IDS:
            raise BadRequest(f"token_ids_logprob holds {len(self.token_ids_logprob)} ids, more than the "
                             f"{MAX_LOGPROB_TOKEN_IDS} allowed")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise BadRequest(f"min_new_tokens (min_tokens) must be an integer from 0 to max_new_tokens "
                             f"({self.max_new_tokens}), got {self.min_new_tokens!r}")
        if self.min_new_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise BadRequest(f"a request with min_new_tokens (min_tokens) may hold at most {MAX_MIN_TOKENS_STOP_IDS} "
                             f"stop_token_ids, got {len(self.stop_token_ids)}; send fewer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        compile_stop_regexes(self.stop_regex)
        return self.check_controls()

    def check_controls(self) -> SamplingParams:
        """The penalties, the logit bias (its keys read as integers) and the grammar; BadRequest in one sentence."""
        for name, low, high in (("frequency_penalty", -2, 2), ("presence_penalty", -2, 2)):
            x = getattr(self, name)
            if not isinstance(x, int | float) or isinstance(x, bool) or not low <= x <= high:
                raise BadRequest(f"{name} must be a number in [{low}, {high}], got {x!r}")
        r = self.repetition_penalty
        if not isinstance(r, int | float) or isinstance(r, bool) or not 0 < r <= 2:
            raise BadRequest(f"repetition_penalty must be a number in (0, 2], got {r!r}")
        if self.logit_bias:
            self.logit_bias = _checked_bias(self.logit_bias)
        g = self.grammar
        if g is not None and (not isinstance(g, GrammarSpec) or g.kind not in GRAMMAR_KINDS):
            raise BadRequest(f"a grammar's kind must be one of {', '.join(GRAMMAR_KINDS)}, got "
                             f"{getattr(g, 'kind', g)!r}")
        return self


CONTROL_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")


def with_controls(params: SamplingParams, body: dict) -> SamplingParams:
    """`params` with the sampling controls `body` sends (the same names on OpenAI's endpoints and in SGLang's
    sampling_params), checked: BadRequest in one sentence."""
    for name in CONTROL_FIELDS:
        if body.get(name) is not None:
            setattr(params, name, body[name])
    return params.check_controls()


def _checked_bias(bias) -> dict[int, float]:
    """logit_bias as {token id: bias}: at most MAX_LOGIT_BIAS entries, ids integers (JSON's string keys read as
    such), biases numbers in [-100, 100] (OpenAI's rule)."""
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object of token id: bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias holds {len(bias)} entries, more than the {MAX_LOGIT_BIAS} allowed; send fewer")
    out = {}
    for k, v in bias.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias keys must be token ids (integers), got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}")
        out[t] = float(v)
    return out


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """Where a request's KV comes from or goes under prefill/decode disaggregation (SGLang's router adds these
    fields to each request it sends to both servers): the prefill server's bootstrap endpoint and the room that
    names the request on both servers (`jaxdp.disagg`)."""

    host: str
    port: int
    room: int
    prefill_dp_rank: int | None = None  # SGLang's disagg_prefill_dp_rank: the prefill rank, when pinned


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # prompt fully in the cache, decoding
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    rank: int = -1  # its DP rank in its engine
    dp_rank: int = -1  # its rank among all the server's ranks (replicas numbered one after the other)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # prompt positions logprob_start_len.. (the first prompt token's logprob is None: nothing predicts it)
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    state: State = State.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)  # pages of the context, in order
    shared_pages: int = 0  # the first `shared_pages` pages belong to the prefix cache
    computed: int = 0  # tokens whose latent is in the cache (written by a step that was booked)
    scheduled: int = 0  # tokens whose latent a committed step writes (computed, plus steps in flight)
    row: int = -1  # its row in its rank's persistent batch while it decodes
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    retractions: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculative decoding: the next verify's drafts
    speculates: bool = True  # ... False once read in a plain stretch (no draft KV of its prompt): never drafts
    spec_verify_ct: int = 0  # verify steps this request took part in (SGLang's meta_info name)
    spec_accepted: int = 0  # draft tokens those verifies accepted
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # why an aborted request was refused
    error_status: int | None = None  # the HTTP status of that error when not a 400 (503: the engine failed)
    stop_check: Callable[[Request], bool] | None = None  # stop strings, checked by the API layer
    on_update: Callable[[Request], None] | None = None  # called after each token and at the end
    submitted: bool = False  # handed to an engine's loop (Engine.submit)
    created: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation: the request's room (jaxdp.disagg)
    penalty_slot: int = -1  # its slot of its rank's penalty state on the device while admitted (-1: none)
    grammar_future: concurrent.futures.Future | None = None  # its grammar's matcher, compiling (the engine's loop)
    matcher: Matcher | None = None  # ... once compiled: the scheduler admits it then

    @property
    def done_ids(self) -> list[int]:
        """Output tokens read back so far (negative entries, always last, are tokens still on the device)."""
        ids, k = self.output_ids, len(self.output_ids)
        while k and ids[k - 1] < 0:
            k -= 1
        return ids if k == len(ids) else ids[:k]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens whose latent must be in the cache before the next token can be computed."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state == State.FINISHED

    @property
    def prompt_logprobs_left(self) -> bool:
        """Some of its prompt logprobs are still to be computed (by the rows of its prompt from
        max(logprob_start_len - 1, 0) on)."""
        start = self.params.logprob_start_len
        return start >= 0 and len(self.input_logprobs) < len(self.prompt_ids) - start

STOP_REGEX_TOKENS = 64  # a stop_regex match is looked for in the decoded text of the last this many output tokens


def compile_stop_regexes(patterns: list[str]) -> list:
    """The stop_regex patterns compiled by RE2 (linear time whatever the pattern and the text: a hostile pattern
    cannot stall the loop that checks it); a pattern RE2 cannot read is a BadRequest."""
    options = re2.Options()
    options.log_errors = False
    out = []
    for p in patterns:
        try:
            out.append(re2.compile(p, options=options))
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise BadRequest(f"stop_regex {p!r} is not a regular expression this server reads ({why}); send an "
                             "RE2 pattern (no look-around or back-references)") from None
    return out


def stop_string_check(tokenizer, stops: list[str], regexes: list[str] = ()) -> Callable[[Request], bool]:
    """True once the decoded output contains a stop string, or one of `regexes` matches in the text of the last
    STOP_REGEX_TOKENS output tokens (the text is cut there by the API layer). A token is at least one character,
    so the last (longest stop + 8) tokens hold any stop string the newest token ends."""
    window = max([len(s) + 8 for s in stops] + ([STOP_REGEX_TOKENS] if regexes else []))
    compiled = compile_stop_regexes(list(regexes))

    def check(req: Request) -> bool:
        tail = tokenizer.decode([t for t in req.output_ids[-window:] if t >= 0])  # negative: still in flight
        return any(s in tail for s in stops) or any(r.search(tail) for r in compiled)

    return check


def new_request(rid: str, prompt_ids: list[int] | str, params: SamplingParams | None, *, tokenizer, vocab_size: int,
                check: Callable[[Request], None]) -> Request:
    """A validated request (token ids, or text when there is a tokenizer); `check` refuses what a rank can never
    serve. Raises BadRequest with what to change."""
    params = (params or SamplingParams()).validate()
    if isinstance(prompt_ids, str):
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer (tokenizer.json); send token ids instead of text")
        prompt_ids = tokenizer.encode(prompt_ids)
    if not prompt_ids:
        raise BadRequest("the prompt is empty; send at least one token")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    start = params.logprob_start_len
    if start >= len(prompt_ids):
        raise BadRequest(f"logprob_start_len {start} is past the prompt's {len(prompt_ids)} tokens; send at most "
                         f"{len(prompt_ids) - 1} (or -1 for no prompt logprobs)")
    bad = [t for t in params.token_ids_logprob or [] if not 0 <= int(t) < vocab_size]
    if bad:
        raise BadRequest(f"token_ids_logprob holds {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
    bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"logit_bias holds token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
    req = Request(rid, [int(t) for t in prompt_ids], params)
    check(req)
    if params.stop or params.stop_regex:
        if tokenizer is None:
            raise BadRequest("stop strings and stop_regex need the model's tokenizer; use stop_token_ids instead")
        req.stop_check = stop_string_check(tokenizer, params.stop, params.stop_regex)
    return req
