"""The one interface of an engine to its users: `EngineClient`.

The server (`jaxdp.api.replicas.ReplicaSet`, the endpoints, the monitor, the metrics) holds EngineClients and
never knows where the engine runs: `jaxdp.Engine` in this process, or `jaxdp.engine.ipc.remote.RemoteEngine`, the
stand-in for an engine in a process of its own. Both are built on `ClientBase`: what an engine says of itself
once (`EngineFacts`, the same message the engine process sends when it is ready) and the one way a request is
made and checked against the engine's admission rule (`jaxdp.engine.sched.scheduler.check_admission` on the
scheduler's config and the runner's pool), so a request is refused in the server's process exactly as the
engine would refuse it. (Node 0's stand-ins for the other nodes' ranks sit inside an Engine, behind
`jaxdp.engine.nodes.link.Nodes`.)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from jaxdp.engine.ipc.messages import EngineFacts, NodeFlush
from jaxdp.engine.sched.controller import Controller
from jaxdp.engine.sched.delayer import PrefillDelayer
from jaxdp.engine.sched.request import BadRequest, Bootstrap, Request, SamplingParams, new_request
from jaxdp.engine.sched.scheduler import check_admission
from jaxdp.engine.step.step_stats import StepStats


class EngineFailed(Exception):
    """The engine cannot serve any more (another node or its process died); the message says what happened
    (HTTP 503)."""


@dataclasses.dataclass
class DelayerCounters:
    """The prefill delayer's counters as /metrics reads them (`jaxdp.engine.sched.delayer.PrefillDelayer` has them)."""

    wait_passes: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@runtime_checkable
class EngineClient(Protocol):
    """What the server uses of an engine, wherever it runs."""

    facts: EngineFacts  # layout, options, buckets, model, context, ranks, the admission rule's inputs
    tokenizer: Any
    failed: str | None  # why it stopped serving (then every request gets a 503)
    stats: StepStats  # step records and counters (the engine's own, or the ones its process reported)
    delayer: DelayerCounters | PrefillDelayer | None  # --enable-prefill-delayer's counters (wait_passes, outcomes)

    @property
    def compiles(self) -> int:
        """XLA compilations in the engine's process."""

    @property
    def is_running(self) -> bool:
        """Its loop is alive and serving (what /health reports)."""

    def make_request(self, prompt_ids: list[int] | str, params: SamplingParams | None = None, *,
                     rid: str | None = None, rank: int | None = None, bootstrap: Bootstrap | None = None
                     ) -> Request: ...

    def submit(self, req: Request) -> Request: ...

    def abort(self, rid: str) -> None: ...

    def stream(self, req: Request) -> AsyncIterator[Request]: ...

    def rank_state(self, rank: int) -> dict: ...

    def flush_cache(self) -> list[NodeFlush] | None: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...


class ClientBase:
    """What every EngineClient shares: its facts' figures by name, and making a request. A subclass sets
    `facts`, `tokenizer` and `failed`, then calls `_init_intake`."""

    facts: EngineFacts
    tokenizer: Any
    failed: str | None
    accepts_grammars: bool = False  # the engine was given a grammar backend (`jaxdp.engine.sched.request.Grammars`)

    def _init_intake(self) -> None:
        """The facts' figures by the names the server reads, and the intake's controller and request ids."""
        f = self.facts
        self.layout, self.cfg, self.buckets, self.model_cfg = f.layout, f.cfg, f.buckets, f.model_cfg
        self.context_len, self.local_ranks, self.compiles_at_warmup = f.context_len, f.local_ranks, f.compiles_at_warmup
        self.controller = Controller(f.layout.dp, f.cfg.load_balance_method)  # (a server's ReplicaSet pins ranks
        self._ids = itertools.count()  # itself: this one then counts nothing)

    def make_request(self, prompt_ids: list[int] | str, params: SamplingParams | None = None, *,
                     rid: str | None = None, rank: int | None = None, bootstrap: Bootstrap | None = None) -> Request:
        """A validated request (token ids, or text when the model has a tokenizer) on a rank: `rank`, or the
        controller's choice (then it counts in the controller's ledger; a caller that pins ranks, such as
        the server's ReplicaSet, keeps its own); raises BadRequest. `bootstrap`: its room under prefill/decode
        disaggregation (a prefill server reads its prompt and one token, on the rank its room names)."""
        if self.failed:
            raise EngineFailed(self.failed)
        f = self.facts
        rid = rid or f"req-{next(self._ids)}"
        self.controller.check_rid(rid)
        mode = f.cfg.disaggregation.mode if f.cfg.disaggregation is not None else None
        check_bootstrap(mode, bootstrap)
        if mode == "prefill":  # (SGLang's prefill server: the first token, then the KV goes to the decode server)
            params = dataclasses.replace(params or SamplingParams(), max_new_tokens=1)
            if rank is None:  # (a server's ReplicaSet chooses among all its replicas' ranks itself)
                rank = prefill_rank(bootstrap, f.layout.dp)
        if f.cfg.speculative is not None and params is not None and (params.wants_top or params.logprob_start_len >= 0):
            raise BadRequest("this server decodes speculatively (--speculative-algorithm), which does not compute "
                             "top logprobs or prompt logprobs; ask for return_logprob alone, or use a server "
                             "without speculative decoding")
        if params is not None:
            check_controls(params, self.accepts_grammars)
        req = new_request(rid, prompt_ids, params, tokenizer=self.tokenizer, vocab_size=f.model_cfg.vocab_size,
                          check=lambda r: check_admission(f.sched_cfg, f.num_pages, f.page_size, r))
        req.bootstrap = bootstrap
        req.rank = req.dp_rank = self.controller.choose(rank)
        if rank is None:
            self.controller.add(req, req.rank)
        return req


def check_controls(params: SamplingParams, grammars: bool) -> None:
    """The sampling controls a request asks for against what the server serves them with; BadRequest in one
    sentence. A speculating server's verify applies min_tokens, the penalties, logit_bias and a grammar as plain
    decoding does (`jaxdp.engine.step.controls.prepare_verify`, `jaxdp.engine.step.spec.verify_bitmask`).
    Disaggregation takes them all: the prefill server samples the first token with them, the decode server starts
    each request's penalty slot and matcher from its prompt and that token."""
    if params.grammar is not None and not grammars:
        raise BadRequest("this server serves no grammars (--grammar-backend none, or a backend that cannot read its "
                         "tokenizer: its start-up log says which); leave response_format, json_schema, regex and ebnf "
                         "out, or start it with --grammar-backend llguidance (the default) or xgrammar")


def check_bootstrap(mode: str | None, bootstrap: Bootstrap | None) -> None:
    """A request's bootstrap fields against the server's disaggregation mode; BadRequest in one sentence."""
    if mode is None and bootstrap is not None:
        raise BadRequest("this server does not run --disaggregation-mode; send the request without bootstrap_host, "
                         "bootstrap_port and bootstrap_room, or start it with --disaggregation-mode prefill|decode")
    if mode is not None and bootstrap is None:
        raise BadRequest(f"this server runs --disaggregation-mode {mode}: send requests through SGLang's router "
                         "(python -m sglang_router.launch_router --pd-disaggregation), which adds bootstrap_host, "
                         "bootstrap_port and bootstrap_room")


def prefill_rank(bootstrap: Bootstrap, dp: int) -> int:
    """The prefill rank of a request under disaggregation, as SGLang picks it: the pinned
    disagg_prefill_dp_rank, or its bootstrap room modulo the DP size."""
    if bootstrap.prefill_dp_rank is not None:
        if not 0 <= bootstrap.prefill_dp_rank < dp:
            raise BadRequest(f"disagg_prefill_dp_rank {bootstrap.prefill_dp_rank} is not a rank of this prefill "
                             f"server (0..{dp - 1})")
        return bootstrap.prefill_dp_rank
    return bootstrap.room % dp

