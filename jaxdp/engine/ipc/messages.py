"""Every message that crosses a socket, as typed structs, and the one codec that carries them (msgspec's
MessagePack): the engine process's sockets (`jaxdp.engine.ipc.process`, `.remote`) and the node exchange
(`jaxdp.engine.nodes.hosts`, `.nodes`). A message is read into its declared type or refused: a frame that is not
MessagePack, names an unknown kind, or has a field of the wrong type is a `WireError` in one sentence (the
caller says which peer sent it), never a half-read message, and nothing in a frame is ever imported or run.

- The engine process: the server starts it with one `EngineStart` on its stdin (where its sockets are, and the
  checked config it builds the engines from); then the server sends `Command`s (`Submit`, `Abort`, `Ask`, `Shutdown`);
  the child sends `Event`s (`Ready` once, `StepDone` after every step that changed something, and the answers
  `States`, `Flushed`, `CallFailed`).
- The node exchange: each iteration every node sends one frame, its ranks' `Proposal`s and a `NodeMessage`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Literal, TypeVar

import msgspec

from jaxdp.config import ModelConfig
from jaxdp.engine.ipc.updates import SentRequest, Update
from jaxdp.engine.options import EngineConfig
from jaxdp.engine.sched.scheduler import SchedulerConfig
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.step_stats import StepRecord
from jaxdp.layout import Layout
from jaxdp.parallel.agreement import Proposal

RankState = dict[str, Any]  # a rank's figures (`Scheduler.state`): plain numbers by name


class WireError(ValueError):
    """A frame that is not one of the messages it should be; the message says what was wrong with it."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, range) and obj.step == 1:
        return (obj.start, obj.stop)
    raise NotImplementedError(f"a {type(obj).__name__} is not part of jaxdp's messages")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is range:
        start, stop = obj
        return range(start, stop)
    raise NotImplementedError(f"a {kind.__name__} is not part of jaxdp's messages")


def encode(msg: Any) -> bytes:
    """A message as bytes (thread-safe)."""
    return msgspec.msgpack.encode(msg, enc_hook=_enc_hook)


class Reader:
    """Reads frames of one declared type; anything else is a WireError naming what was wrong."""

    def __init__(self, kind: Any):
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)

    def __call__(self, raw: bytes) -> Any:
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, ValueError, TypeError) as e:  # ValidationError is a DecodeError
            raise WireError(str(e).splitlines()[0][:160] if str(e) else type(e).__name__) from None


# ---- what an engine says of itself once (the engine process's `Ready`; an EngineClient's facts) ----------------
class EngineFacts(msgspec.Struct, frozen=True):
    """What a client of an engine knows of it without asking: its layout, options, compiled buckets, model,
    context, ranks, and its admission rule's inputs (the scheduler's config and the runner's pool)."""

    layout: Layout
    cfg: EngineConfig
    buckets: Buckets
    model_cfg: ModelConfig
    context_len: int
    local_ranks: range
    sched_cfg: SchedulerConfig
    num_pages: int
    page_size: int
    compiles_at_warmup: int
    empty_states: dict[int, RankState]  # its ranks' figures before any request (a client shows them once it died)


# ---- the node exchange -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodeFlush:
    """What a prefix-cache flush did on one node's ranks."""

    node: int
    ranks: range
    flushed: bool
    freed_tokens: int = 0  # cached tokens whose pages went back to the pools
    reason: str | None = None  # why not flushed
    states: dict[int, RankState] = dataclasses.field(default_factory=dict)  # its ranks' figures right after

    def describe(self) -> str:
        where = f"node {self.node} (rank{'s' if len(self.ranks) > 1 else ''} {_span(self.ranks)})"
        if self.flushed:
            return f"{where}: flushed, {self.freed_tokens} cached tokens freed"
        return f"{where}: not flushed, {self.reason}"


def _span(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


class RoomOutcome(msgspec.Struct, omit_defaults=True, frozen=True):
    """Prefill/decode disaggregation on several nodes: a bootstrap room's outcome on the node whose rank read its
    prompt, for node 0's bootstrap endpoint (`jaxdp.disagg.bootstrap`; the same fields as its JSON answer)."""

    room: int
    status: Literal["ready", "failed"]
    rank: int = 0
    n_tokens: int = 0
    first_token: int = 0
    first_logprob: float = 0.0
    address: str = ""  # the transfer server that offers its KV: the node whose rank read the prompt
    ticket: dict[str, int | str] | None = None  # what the transport's reader needs besides the address (NIXL's)
    error: str | None = None  # failed: the sentence the decode side ends the request with


class NodeMessage(msgspec.Struct, omit_defaults=True):
    """What one node tells the others in an iteration, besides its ranks' proposals."""

    # node 0 -> the others: requests for their ranks, aborts, prefix-cache flushes to do, "stop"
    new: list[SentRequest] = []
    abort: list[str] = []
    flush: list[int] = []
    stop: bool = False
    experts: list[str] = []  # expert-distribution recorder actions, every node carrying them out after this exchange
    # the others -> node 0: their requests' progress, flush answers, their ranks' figures (now and then)
    updates: list[Update] = []
    flushed: list[tuple[int, NodeFlush]] = []
    states: dict[int, RankState] | None = None
    rooms: list[RoomOutcome] = []  # prefill/decode disaggregation: its ranks' rooms, for node 0's bootstrap endpoint
    # every node: the prefill delayer's numbers of its ranks (`jaxdp.engine.sched.delayer`), when it is on
    prefill_delayer: list[tuple[bool, bool]] | None = None  # (prompt ready, under the watermark) per rank


def frame_reader(message_kind: Any) -> Reader:
    """The node exchange's frames: a node's ranks' proposals and its message (of the type this node sends)."""
    return Reader(tuple[list[Proposal], message_kind])


# ---- the engine process: the server's commands ---------------------------------------------------------------
ConfigT = TypeVar("ConfigT")


class EngineStart(msgspec.Struct, Generic[ConfigT], frozen=True):
    """The server's first and only words on its engine process's stdin: the sockets to connect to, the server's pid
    (the child ends once that is no longer its parent), and the checked config it builds the engines from (the
    server's `jaxdp.serve_config.ServeConfig`; the child reads it as `EngineStart[ServeConfig]`)."""

    commands: str
    events: str
    parent: int
    config: ConfigT


class Submit(msgspec.Struct, tag=True, array_like=True):
    engine: int
    request: SentRequest


class Abort(msgspec.Struct, tag=True, array_like=True):
    engine: int
    rid: str


class Ask(msgspec.Struct, tag=True, array_like=True):
    """A rare question about an engine: "rank_states" (every rank's figures, answered by `States`),
    "flush_cache" (a prefix-cache flush, answered by `Flushed`) or an expert-distribution recorder action
    ("expert_record_start", "_stop", "_dump", answered by `ExpertRecord`)."""

    call: int
    engine: int
    question: Literal["rank_states", "flush_cache", "expert_record_start", "expert_record_stop",
                      "expert_record_dump"]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = Submit | Abort | Ask | Shutdown


# ---- the engine process: the child's events -----------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    engines: list[EngineFacts]


class Counters(msgspec.Struct, array_like=True, frozen=True):
    """The child's slow counters, a few times a second: its compiles, its prefill delayer's passes."""

    compiles: int
    delayer_wait_passes: int | None = None
    delayer_outcomes: dict[str, int] | None = None


class StepDone(msgspec.Struct, tag=True, array_like=True):
    """After a step of an engine: its requests' updates, its new step records, its counters, its failure."""

    engine: int
    updates: list[Update]
    records: list[StepRecord]
    steps: int
    compiles_in_steps: int
    failed: str | None
    counters: Counters | None


class States(msgspec.Struct, tag=True, array_like=True):
    call: int
    states: dict[int, RankState]


class Flushed(msgspec.Struct, tag=True, array_like=True):
    call: int
    reports: list[NodeFlush] | None  # None: not every node answered


class ExpertRecord(msgspec.Struct, tag=True, array_like=True):
    """What an expert-recorder action did (`jaxdp.eplb.distribution.RecordOutcome`): refused (`error`, one sentence),
    or for a dump the tokens routed [devices][layers][experts], the steps, each layer's balancedness (EP)."""

    call: int
    error: str | None = None
    per_device: list[list[list[int]]] | None = None
    steps: int = 0
    balancedness: list[float] | None = None


class CallFailed(msgspec.Struct, tag=True, array_like=True):
    call: int
    error: str


Event = Ready | StepDone | States | Flushed | ExpertRecord | CallFailed
