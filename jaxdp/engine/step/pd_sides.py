"""An engine's side of prefill/decode disaggregation (`--disaggregation-mode`): the schedulers' policy
(`jaxdp.engine.sched.policy.Disagg`, given to each rank's Scheduler at construction) wired to `jaxdp.disagg`'s two
ends.

- **prefill**: a request comes with its bootstrap room (SGLang's router adds it) and asks for one token: its
  prompt is read as usual (chunked, prefix cache, DP attention, the delayer); when it finishes, its KV is
  read from its pages and offered under its room before the pages go back (`PrefillSide.hand_off`), or the
  room is announced as refused when it ended otherwise.
- **decode**: a request with a room waits on its rank until pages for its prompt are free (with its output's
  reservation, as a prompt would be admitted), then a worker thread fetches its KV (`DecodeSide.fetch`);
  the loop writes the KV into the pool between steps and the request decodes from the prefill server's first
  token, without a prompt step. A failed hand-off ends the request with its one sentence, its pages freed.
- **several nodes** (either side): each node hands over its own ranks' KV through its own transfer server; a
  prefill server's bootstrap endpoint runs on node 0, which learns the other nodes' rooms from the node exchange.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import msgspec

from jaxdp.disagg.handoff import DecodeSide, HandoffError, PrefillSide, model_fingerprint
from jaxdp.disagg.kv import KVFormat, read_request_kv, write_request_kv
from jaxdp.disagg.kv_stats import RankKV
from jaxdp.engine.ipc.messages import RoomOutcome
from jaxdp.engine.options import DisaggConfig
from jaxdp.engine.sched.request import Request
from jaxdp.engine.sched.scheduler import Scheduler

log = logging.getLogger("jaxdp.engine")

CHUNK_TOKENS = 256  # tokens per transferred chunk (jaxdp.disagg.kv): one compiled gather and scatter


class PrefillMode:
    """On several nodes every node reads its own ranks' prompts and offers their KV on its own transfer server;
    node 0 alone runs the bootstrap endpoint, so another node's rooms go out in its next message of the node
    exchange (`rooms_out`, as `RoomOutcome`s naming that node's transfer server) and node 0 publishes them
    (`rooms_in`). Node 0's board then counts every rank's offers in flight (`remote_state`)."""

    def __init__(self, cfg: DisaggConfig, runner, dp: int, local_ranks: range, node_rank: int):
        self.runner = runner
        fmt = KVFormat.of(runner.cache, CHUNK_TOKENS)
        self._outbox: list[RoomOutcome] = []  # the other nodes: rooms for node 0's bootstrap endpoint
        dcp = getattr(runner, "dcp_size", 1)  # (a split pool: docs/dcp.md)
        self.side = PrefillSide(fmt, dp, cfg.model, backend=cfg.backend, host=cfg.host,
                                bootstrap_port=cfg.bootstrap_port, offer_timeout_s=cfg.timeout_s,
                                publish=None if node_rank == 0 else self._to_node_0, dcp_size=dcp)
        self.stats = [RankKV() for _ in range(dp)]
        for rank in local_ranks:  # compiled at start-up (for each rank's devices), never while serving
            jax.block_until_ready(read_request_kv(runner.cache, rank, [0], 1, fmt, dcp=dcp))

    # ---- the schedulers' policy (jaxdp.engine.sched.policy.Disagg) -------------------------------------
    def reads_elsewhere(self, req: Request) -> bool:
        return False

    def fetch(self, rank: int, req: Request) -> None:
        raise AssertionError("a prefill server reads every prompt itself")

    def state(self, rank: int, kv_waiting: list[Request]) -> dict:
        inflight, dropped = self.side.board.inflight(rank)
        return self.stats[rank].state("prefill", inflight=inflight, dropped=dropped)

    def finished(self, rank: int, req: Request, reason: str) -> None:
        """A request with a room finished, its pages still held: its KV is offered under its room, or the room
        is refused when it ended otherwise (or before its prompt was read)."""
        if req.bootstrap is None:
            return
        room = req.bootstrap.room
        if reason in ("stop", "length") and req.output_ids and req.pages and req.computed >= len(req.prompt_ids):
            lp = req.output_logprobs[0] if req.output_logprobs else 0.0
            t0 = time.perf_counter()
            self.side.hand_off(self.runner.cache, room, rank, req.pages, len(req.prompt_ids), req.output_ids[0], lp)
            self.stats[rank].offered(self.side.fmt.nbytes(len(req.prompt_ids)), time.perf_counter() - t0)
        else:
            self.side.refuse(room, req.error or f"the prefill server ended the request ({reason}) before its KV "
                                                f"was ready")

    # ---- the engine's --------------------------------------------------------------------------------

    def _to_node_0(self, room: int, outcome: dict) -> None:
        self._outbox.append(RoomOutcome(room=int(room), **outcome))  # (the engine loop's thread, as rooms_out)

    def rooms_out(self) -> list[RoomOutcome]:
        """Another node: the rooms settled since its last message, for node 0's bootstrap endpoint."""
        out, self._outbox = self._outbox, []
        return out

    def rooms_in(self, rooms: list[RoomOutcome]) -> None:
        """Node 0: another node's rooms, published on the bootstrap endpoint."""
        for r in rooms:
            self.side.board.publish(r.room, {k: v for k, v in msgspec.structs.asdict(r).items() if k != "room"})

    def remote_state(self, rank: int, state: dict) -> dict:
        """Node 0: another node's rank's figures, with its offers in flight as node 0's board counts them (the
        decode servers tell node 0's bootstrap endpoint when they take a room's KV)."""
        if "disagg" not in state:
            return state
        inflight, dropped = self.side.board.inflight(rank)
        return {**state, "disagg": {**state["disagg"], "inflight": inflight, "dropped": dropped}}

    def engine_failed(self, req: Request, message: str) -> None:
        """The engine stopped serving (another node died or stalled): the decode side need not wait for the room
        (node 0's board; another node's outbox goes nowhere, harmlessly)."""
        if req.bootstrap is not None:
            self.side.refuse(req.bootstrap.room, f"the prefill server stopped serving: {message}")

    def close(self) -> None:
        self.side.close()


class DecodeMode:
    """On several nodes every node allocates, pulls and writes the KV of its own ranks' requests (their pages
    are in its devices' pool shards); nothing of it crosses the node exchange but the requests and their tokens."""

    def __init__(self, cfg: DisaggConfig, runner, dp: int, post, local_ranks: range):
        """post(("kv", (req, future))): puts an arrival into the engine's inbox (thread-safe)."""
        self.runner, self.post = runner, post
        dcp = getattr(runner, "dcp_size", 1)  # (a split pool: each device writes its own tokens, docs/dcp.md)
        self.side = DecodeSide(KVFormat.of(runner.cache, CHUNK_TOKENS), cfg.model, backend=cfg.backend,
                               host=cfg.host, timeout_s=cfg.timeout_s, dcp_size=dcp)
        self.workers = ThreadPoolExecutor(max_workers=32, thread_name_prefix="jaxdp-kv")
        self.stats = [RankKV() for _ in range(dp)]
        self.transferred_bytes = 0
        self.transfer_seconds = 0.0
        fmt = self.side.fmt  # the write compiled at start-up for each rank's devices, never while serving: zeros
        for rank in local_ranks:  # into page 0 (free at start)
            zeros = [{k: jnp.zeros(s.shape, s.dtype, device=s.sharding) for k, s in chunk.items()}
                     for chunk in fmt.specs(1, jax.sharding.SingleDeviceSharding(self._device(rank)))]
            runner.cache = write_request_kv(runner.cache, rank, [0], 1, fmt, zeros, dcp=dcp)
        jax.block_until_ready(runner.cache)

    # ---- the schedulers' policy (jaxdp.engine.sched.policy.Disagg) -------------------------------------
    def reads_elsewhere(self, req: Request) -> bool:
        return req.bootstrap is not None

    def state(self, rank: int, kv_waiting: list[Request]) -> dict:
        travelling = sum(bool(r.pages) for r in kv_waiting)
        return self.stats[rank].state("decode", prealloc=len(kv_waiting) - travelling, transfer=travelling)

    def finished(self, rank: int, req: Request, reason: str) -> None:
        pass  # (its pages go back to the pool as any request's)

    def _device(self, rank: int):
        x = next(iter(self.runner.cache.values()))
        return next(s.device for s in x.addressable_shards if (s.index[0].start or 0) <= rank < (s.index[0].stop or
                                                                                                 x.shape[0]))

    def fetch(self, rank: int, req: Request) -> None:
        """Its pages are held: a worker thread pulls its KV; the arrival goes to the engine's inbox."""
        b = req.bootstrap
        fut = self.workers.submit(self.side.fetch, b.host, b.port, b.room, len(req.prompt_ids), self._device(rank))
        fut.add_done_callback(lambda f: self.post(("kv", (req, f))))

    # ---- the engine's --------------------------------------------------------------------------------
    def arrived(self, sched: Scheduler, req: Request, fut: Future, now: float) -> None:
        """On the loop, between steps: the request's KV into the pool and the request into its rank's (`sched`'s)
        batch."""
        if req.finished:  # aborted while its KV travelled: its pages are back already
            return
        try:
            arrived = fut.result()
        except HandoffError as e:
            stats = self.stats[req.rank]
            if e.stage == "transfer":
                stats.transfer_failed += 1
            else:
                stats.bootstrap_failed += 1
            req.error, req.error_status = str(e), 503  # (the prefill side failed it: a router may retry elsewhere)
            log.warning("request %s: %s", req.rid, e)
            sched.finish(req, "abort", now)
            return
        self.runner.cache = self.side.write(self.runner.cache, req.rank, req.pages, arrived)
        self.transferred_bytes += arrived.nbytes
        self.transfer_seconds += arrived.seconds
        self.stats[req.rank].pulled(arrived.nbytes, arrived.pull_s, arrived.bootstrap_s)
        sched.join_prefilled(req, arrived.first_token, arrived.first_logprob, time.perf_counter())

    def rooms_out(self) -> list[RoomOutcome]:
        return []  # (rooms are the prefill side's)

    def rooms_in(self, rooms: list[RoomOutcome]) -> None:
        pass

    def remote_state(self, rank: int, state: dict) -> dict:
        return state  # (another node's decode ranks report their own queues and pulls)

    def engine_failed(self, req: Request, message: str) -> None:
        pass  # (the engine ended the request; its pages go with the engine)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.side.close()


def make_disagg(cfg: DisaggConfig | None, runner, dp: int, post, local_ranks: range | None = None,
                node_rank: int = 0) -> PrefillMode | DecodeMode | None:
    """The side `cfg` asks for over `dp` ranks, built before the schedulers (each is given it as its policy);
    `local_ranks`: the ranks this node schedules (default: all); `node_rank`: this node's (0: one node)."""
    if cfg is None:
        return None
    if not cfg.model:  # both servers must serve one model: its architecture, as config.json would say it
        cfg = dataclasses.replace(cfg, model=model_fingerprint(dataclasses.asdict(runner.cfg)))
    local_ranks = range(dp) if local_ranks is None else local_ranks
    if cfg.mode == "prefill":
        return PrefillMode(cfg, runner, dp, local_ranks, node_rank)
    if cfg.mode == "decode":
        return DecodeMode(cfg, runner, dp, post, local_ranks)
    raise ValueError(f"--disaggregation-mode {cfg.mode!r} is not prefill or decode")
