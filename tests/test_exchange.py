"""The per-step exchange between nodes, without processes: ZeroMQ and key-value-store transports over a fake
store, a silent node, a dropped connection named, forged frames refused, and the agreement's top-logprobs rule."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest

from jaxdp.engine.ipc.messages import NodeFlush, NodeMessage, encode, frame_reader
from jaxdp.engine.ipc.updates import Update
from jaxdp.engine.nodes.hosts import HostExchange, PeerFailure, StoreGather, ZmqGather
from jaxdp.parallel.agreement import Proposal


class FakeStore:
    """The distributed runtime's key-value calls the exchange uses, in one process."""

    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]

    def key_value_delete(self, key):  # a key, or a directory and everything under it
        with self.cond:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]


    def key_value_set(self, key, value):
        self.key_value_set_bytes(key, value)

    def blocking_key_value_get(self, key, timeout_ms):
        return self.blocking_key_value_get_bytes(key, timeout_ms)


def run_nodes(nodes: int, dp: int, steps: int, make_gather) -> list:
    """`nodes` threads, each a HostExchange over `make_gather(node)`, exchanging `steps` times; every
    proposal names its step and rank, every message its node and step (every 10th one is large)."""
    results = [None] * nodes

    def node(k):
        ex = HostExchange(nodes, k, dp, timeout_s=10, client=STORE, gather=make_gather(k))
        out = []
        for step in range(steps):
            local = [Proposal(0, False, False)] * dp
            for r in ex.local_ranks():
                local[r] = Proposal(10 * step + r, r % 2 == 0, True)
            out.append(ex.exchange(local, {"from": k, "step": step, "pad": "x" * (100_000 if step % 10 == 0 else 0)}))
        ex.gather.close()
        results[k] = out

    threads = [threading.Thread(target=node, args=(k,)) for k in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for step in range(steps):
        proposals = [results[k][step][0] for k in range(nodes)]
        assert all(p == proposals[0] for p in proposals)
        assert [p.rows for p in proposals[0]] == [10 * step + r for r in range(dp)]
        assert [p.is_extend for p in proposals[0]] == [r % 2 == 0 for r in range(dp)]
        for k in range(nodes):
            assert [(m["from"], m["step"]) for m in results[k][step][1]] == [(j, step) for j in range(nodes)]
    return results


STORE = FakeStore()


@pytest.mark.parametrize("nodes", [2, 4])
def test_zmq_exchange_gives_every_node_the_same_proposals_and_messages(nodes):
    prefix = f"zmq-test-{nodes}"
    run_nodes(nodes, 8, 300, lambda k: ZmqGather(nodes, k, 10, STORE, "127.0.0.1", init_timeout_s=10,
                                                 prefix=prefix))


def test_store_exchange_gives_every_node_the_same_proposals_and_deletes_old_keys():
    store, nodes = FakeStore(), 4
    run_nodes(nodes, 8, 200, lambda k: StoreGather(nodes, k, 10, store))
    # the keys of finished iterations are deleted, a directory of BLOCK at a time
    assert len(store.data) <= 2 * StoreGather.BLOCK * nodes
    assert max(frame_reader(dict)(v)[1]["step"] for v in store.data.values()) == 199


@pytest.mark.parametrize("transport", ["zmq", "store"])
def test_a_silent_node_fails_the_exchange_within_the_timeout(transport):
    store = FakeStore()
    if transport == "zmq":  # node 1 sets up its sockets, then never exchanges
        threading.Thread(target=ZmqGather, args=(2, 1, 0.5, store, "127.0.0.1"), daemon=True).start()
        gather = ZmqGather(2, 0, 0.5, store, "127.0.0.1", init_timeout_s=5)
    else:
        gather = StoreGather(2, 0, 0.5, store)
    ex = HostExchange(2, 0, 8, timeout_s=0.5, client=store, gather=gather)
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="no answer from node 1 to the step exchange #0 within"):
        ex.exchange([Proposal(0, False, False)] * 8, {})
    assert time.monotonic() - t0 < 2


def test_the_exchange_names_the_node_whose_connection_dropped():
    """After a collective fails, the message names the dead node: the one whose exchange socket disconnected."""
    store, nodes = FakeStore(), 3
    gathers = [None] * nodes

    def make(k):
        gathers[k] = ZmqGather(nodes, k, 10, store, "127.0.0.1", init_timeout_s=10, prefix="lost")

    threads = [threading.Thread(target=make, args=(k,)) for k in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    exchanges = [HostExchange(nodes, k, 6, timeout_s=10, client=store, gather=gathers[k]) for k in range(nodes)]
    threads = [threading.Thread(target=ex.exchange, args=([Proposal(0, False, False)] * 6, {})) for ex in exchanges]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert exchanges[0].lost_nodes(wait_s=0.3) == []
    gathers[2].close()  # node 2 dies
    assert exchanges[0].lost_nodes(wait_s=5) == [2]
    assert exchanges[1].lost_nodes(wait_s=5) == [2]
    for g in gathers[:2]:
        g.close()


class _Boom:
    def __reduce__(self):  # what a forged pickle frame would carry: pickle imports and calls os.system

        return os.system, ("touch /tmp/jaxdp-exchange-pwned",)


def test_an_exchange_frame_that_is_not_the_exchanges_is_refused_not_run():
    """The exchange reads typed frames (`jaxdp.engine.ipc.messages`): a good one arrives whole, and a pickled frame
    (which would import and call os.system), an unknown field's wrong type or a short proposal list is a
    PeerFailure in one sentence, and nothing in it runs."""

    def gather_with(payload: bytes):
        return lambda mine, timeout_s=None: [mine, payload]

    ex = HostExchange(2, 0, 8, timeout_s=1, client=FakeStore(), gather=gather_with(b""))
    update = Update("r", [1, 2], [], [[(5, -0.1)]], 0, None, None, None, [], None)
    flush = NodeFlush(1, range(4, 8), True, 16)
    good = NodeMessage(updates=[update], flushed=[(7, flush)])
    ex.gather = gather_with(encode(([Proposal(3, True, True)] * 4, good)))
    full, messages = ex.exchange([Proposal(0, False, False)] * 8, NodeMessage())
    assert full[4:] == [Proposal(3, True, True)] * 4 and messages[1].updates == [update]
    assert messages[1].flushed == [(7, flush)] and messages[1].flushed[0][1].ranks == range(4, 8)
    forged = [pickle.dumps(([Proposal(0, False, False)] * 4, {"x": _Boom()})),  # not MessagePack at all
              encode(([Proposal(0, False, False)] * 4, {"abort": "not a list"})),  # a field of the wrong type
              encode(([Proposal(0, False, False)] * 3, NodeMessage()))]  # 3 proposals for 4 ranks
    for frame in forged:
        ex.gather = gather_with(frame)
        with pytest.raises(PeerFailure, match=r"^node 1 sent (a message that is not the exchange's|3 proposals)"):
            ex.exchange([Proposal(0, False, False)] * 8, NodeMessage())
    assert not os.path.exists("/tmp/jaxdp-exchange-pwned")


def test_every_node_computes_top_logprobs_when_any_rank_asks():
    """The top logprobs are computed over every node's logits in one collective, so "a request asks for them"
    is part of the agreement (a node that skipped it while another ran it would hang the collective)."""
    from jaxdp.parallel.agreement import agree_on_step

    quiet = [Proposal(2, False, True)] * 8
    assert not agree_on_step(quiet).any_top
    asks = list(quiet)
    asks[6] = Proposal(2, False, True, top=True)  # a rank of node 1
    assert agree_on_step(asks).any_top
    asks[6] = Proposal(0, False, False, top=True)  # an idle rank's request is not in this step
    assert not agree_on_step(asks).any_top
