"""A request's KV from one server's pool into another's (`jaxdp.disagg`): read at the prefill rank's pages,
offered through JAX's transfer server, announced on the bootstrap endpoint, fetched by another process and
written at the decode rank's pages of a pool with another page size and layout; and the failures: a sender
that dies mid-transfer, a room nobody offers, a decode pool of another format."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxdp.disagg.bootstrap import BootstrapClient
from jaxdp.disagg.handoff import DecodeSide, HandoffError
from jaxdp.disagg.kv import KVFormat, read_request_kv, write_request_kv
from jaxdp.disagg.transfer import TRANSPORTS, JaxTransport, TransferError, advertised, make_transport
from jaxdp.net import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import disagg_sender as sender  # noqa: E402


def _start_sender(mode: str, room: int, backend: str = "jax"):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "disagg_sender.py"), str(port), str(room), mode,
                             backend],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    while line and not line.strip().isdigit():  # (NIXL logs its start on stdout)
        line = proc.stdout.readline()
    assert line.strip() == str(port), f"the sender did not start: {line!r}"
    return proc, port


def _decode_pool(mesh, page_size=4, pages=20):
    """The receiver: dp=2 x tp=2 (of this process's 8 host devices), page size 4 (the sender's is 8)."""
    sharding = NamedSharding(mesh, P("dp"))
    return {"dense": jax.device_put(np.zeros((2, 1, pages, page_size, 20), np.float32), sharding),
            "moe": jax.device_put(np.zeros((2, 2, pages, page_size, 20), np.float32), sharding)}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[4:8])


NIXL = pytest.mark.skipif("nixl" not in TRANSPORTS, reason="NIXL is not installed: the test extra's nixl-cu12 "
                          "(pip install -e '.[test]') runs this on the CPU")


@pytest.mark.parametrize("page_size, backend", [(4, "jax"), (32, "jax"), pytest.param(4, "nixl", marks=NIXL)],
                         ids=["pages-of-4", "pages-of-32-per-token", "nixl"])
def test_a_request_kv_moves_between_pools_of_different_page_sizes(mesh, page_size, backend):
    """The sender's pages hold 8 tokens, its chunks 16: pages of 4 take whole pages per copy, pages of 32
    (more than a chunk) one token per copy; through JAX's transfer server, and through NIXL where installed."""
    room = (1 << 63) - 12345 + page_size  # the router's rooms are 63-bit
    proc, port = _start_sender("ok", room, backend)
    cache = _decode_pool(mesh, page_size)
    rank = 0  # the sender's rank 1 lands on this server's rank 0
    side = DecodeSide(KVFormat.of(cache, 1), sender.MODEL, backend=backend)
    try:
        device = next(s.device for s in cache["moe"].addressable_shards if s.index[0].start in (0, None))
        arrived = side.fetch("127.0.0.1", port, room, sender.N_TOKENS, device)
        assert (arrived.first_token, arrived.first_logprob, arrived.n_tokens) == (42, -0.5, sender.N_TOKENS)
        pages = [3, 0, 11, 5, 8, 13][: -(-arrived.n_tokens // page_size)]
        new = side.write(cache, rank, pages, arrived)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    n = arrived.n_tokens
    for name, values in sender.pool_values().items():
        got = np.asarray(new[name])
        want_rows = values[sender.RANK]  # [layers, pages, 8, width]
        for t in range(n):
            src = want_rows[:, sender.PAGES[t // 8], t % 8]
            np.testing.assert_array_equal(got[rank, :, pages[t // page_size], t % page_size], src)
        written = np.zeros(got.shape, bool)
        written[rank, :, pages] = True  # (a last page is written whole: its slots past n are the request's)
        assert (got[~written] == 0).all(), "the write touched slots outside the request's pages"
        # every device of the rank's group holds the same pool (replicated over tp)
        for shard in new[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data)[0], got[shard.index[0].start or 0])


@pytest.mark.parametrize("mode, fingerprint, n_tokens, words", [
    ("refuse", sender.MODEL, sender.N_TOKENS, "the prompt has 9000 tokens"),
    ("silent", sender.MODEL, sender.N_TOKENS, "did not finish bootstrap room 7 within 2 s"),
    ("ok", "another-model", sender.N_TOKENS, "serves another model than this decode server"),
    ("ok", sender.MODEL, sender.N_TOKENS + 1, "read 21 prompt tokens for bootstrap room 7 but this server has 22"),
], ids=["refused", "never-ready", "another-model", "another-length"])
def test_a_hand_off_that_cannot_happen_is_one_sentence(mesh, mode, fingerprint, n_tokens, words):
    proc, port = _start_sender(mode, 7)
    side = DecodeSide(KVFormat.of(_decode_pool(mesh), 1), fingerprint, timeout_s=2)
    try:
        with pytest.raises(HandoffError) as e:
            side.fetch("127.0.0.1", port, 7, n_tokens, jax.devices()[4])
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_sender_that_dies_mid_transfer_fails_the_fetch_in_one_sentence(mesh):
    room = 99
    proc, port = _start_sender("big", room)
    try:
        info = BootstrapClient().info("127.0.0.1", port)
        assert BootstrapClient().room("127.0.0.1", port, room, wait_s=10)["status"] == "ready"
        transport = JaxTransport(jax.devices()[4])
        import threading
        threading.Timer(0.15, proc.kill).start()
        spec = [jax.ShapeDtypeStruct((128, 1024, 1024), np.float32, sharding=SingleDeviceSharding(jax.devices()[4]))]
        with pytest.raises(TransferError, match="failed in transfer") as e:
            transport.fetch(info.address, room, spec, timeout_s=30)
        assert "\n" not in str(e.value)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # the endpoint is gone with it: waiting on a room ends in a sentence, not a hang
    outcome = BootstrapClient(timeout_s=2).room("127.0.0.1", port, room, wait_s=1)
    assert outcome["status"] == "failed" and "stopped answering" in outcome["error"]


def test_nobody_at_the_bootstrap_and_a_pool_of_another_format_are_sentences(mesh):
    with pytest.raises(ConnectionError, match="no prefill server answers at bootstrap"):
        BootstrapClient(timeout_s=1).info("127.0.0.1", free_port())
    cache = _decode_pool(mesh)
    fmt = KVFormat.of(cache, 16)
    other = KVFormat.of({"dense": cache["dense"], "moe": cache["dense"]}, 16)
    why = fmt.mismatch(other)
    assert why and "differs from the decode server's" in why and "\n" not in why
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend 'mooncake' is not available here;"):
        make_transport("mooncake")


def test_a_decode_server_of_another_transfer_backend_is_one_sentence(mesh):
    proc, port = _start_sender("ok", 8)
    side = DecodeSide(KVFormat.of(_decode_pool(mesh), 1), sender.MODEL, backend="jax")
    side.transport.name = "nixl"  # (as a decode server started with --disaggregation-transfer-backend nixl)
    try:
        with pytest.raises(HandoffError, match="hands KV over with --disaggregation-transfer-backend jax, this "
                                               "decode server with nixl; give both the same"):
            side.fetch("127.0.0.1", port, 8, sender.N_TOKENS, jax.devices()[4])
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_transfer_server_on_a_wildcard_host_gives_an_address_others_can_reach():
    """`--host 0.0.0.0` (every node of a server of several, usually): the published address is this machine's,
    never the wildcard a decode node cannot connect to; a concrete host is kept as it is."""
    import socket

    me = socket.gethostbyname(socket.gethostname())
    assert advertised("0.0.0.0:5000") == advertised("[::]:5000") == f"{me}:5000"
    assert advertised("10.0.0.2:7") == "10.0.0.2:7" and advertised("[fd00::1]:7") == "[fd00::1]:7"
    transport = JaxTransport(host="0.0.0.0")
    assert transport.address().startswith(f"{me}:") and not transport.address().startswith("0.0.0.0")


def _split_expected(values_LTW: np.ndarray, pages: list[int], page_size: int, dcp: int, tp: int, shape) -> np.ndarray:
    """A split pool's one rank [tp, L, P, page_size / dcp, W] holding the tokens values_LTW at `pages`, as
    `jaxdp.parallel.dcp` lays them out (token p on the devices of DCP rank p mod dcp, at local index p // dcp)."""
    out = np.zeros(shape, values_LTW.dtype)
    for t in range(values_LTW.shape[1]):
        for device in range(tp):
            if t % dcp == device % dcp:
                out[device, :, pages[t // page_size], t % page_size // dcp] = values_LTW[:, t]
    return out


@pytest.mark.parametrize("chunk, page_in, dcp_in, page_out, dcp_out", [
    (16, 8, 1, 8, 4),  # an unsplit pool into dcp 4 (whole local pages a copy)
    (10, 4, 1, 8, 4),  # ... chunks of 10: chunks starting off a multiple of 4 (one token a copy)
    (16, 4, 1, 8, 2),  # into two subgroups of dcp 2 (tp 4): each subgroup holds the whole sequence
    (16, 8, 4, 4, 1),  # a split pool (dcp 4) read into an unsplit one
    (9, 8, 2, 12, 4),  # split to split, another N and page size, chunks off the page and DCP grids
], ids=["whole-to-dcp4", "chunk10-to-dcp4", "to-dcp2-of-tp4", "dcp4-to-whole", "dcp2-to-dcp4"])
def test_kv_moves_into_and_out_of_a_split_pool(chunk, page_in, dcp_in, page_out, dcp_out):
    """`--dcp-size` on either side (issue 48): a request's KV read from one pool, split or not, and written into
    another, value for value where `jaxdp.parallel.dcp` puts each token, every other slot untouched."""
    def mesh_of(devices, dp, tp):
        return jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)

    L, W, P_in, P_out, n = 2, 6, 12, 10, 37
    rng = np.random.default_rng(0)
    pages_in = [5, 1, 9, 3, 0, 7, 11, 2, 4, 6][: -(-n // page_in)]
    pages_out = [4, 8, 0, 6, 2, 9, 1, 3, 5, 7][: -(-n // page_out)]
    values = rng.standard_normal((L, n, W)).astype(np.float32)  # the request's tokens
    src_mesh = mesh_of(jax.devices()[:4], 1, 4)  # the prefill side: dp=1,tp=4; the decode side dp=2,tp=2 or tp=4
    dst_mesh = mesh_of(jax.devices()[4:8], 2, 2) if dcp_out == 1 else mesh_of(jax.devices()[4:8], 1, 4)
    # the prefill side's pool (rank 0) with the request's tokens at pages_in, as the step would have written them
    if dcp_in == 1:
        pool = np.zeros((1, L, P_in, page_in, W), np.float32)
        for t in range(n):
            pool[0, :, pages_in[t // page_in], t % page_in] = values[:, t]
        src = jax.device_put(pool, NamedSharding(src_mesh, P("dp")))
    else:
        pool = _split_expected(values, pages_in, page_in, dcp_in, 4, (4, L, P_in, page_in // dcp_in, W))[None]
        src = jax.device_put(pool, NamedSharding(src_mesh, P("dp", "tp")))
    cache_in = {"moe": src}
    fmt = KVFormat.of(cache_in, chunk)
    chunks = read_request_kv(cache_in, 0, pages_in, n, fmt, dcp=dcp_in)
    got_chunks = np.concatenate([np.asarray(c["moe"]) for c in chunks], axis=1)[:, :n]
    np.testing.assert_array_equal(got_chunks, values)  # (the chunks are token-major whatever the pool)
    rank = 1 if dcp_out == 1 else 0
    if dcp_out == 1:
        dst = jax.device_put(np.zeros((2, L, P_out, page_out, W), np.float32), NamedSharding(dst_mesh, P("dp")))
    else:
        dst = jax.device_put(np.zeros((1, 4, L, P_out, page_out // dcp_out, W), np.float32),
                             NamedSharding(dst_mesh, P("dp", "tp")))
    assert KVFormat.of({"moe": dst}, chunk) == fmt  # (a split pool's format is the unsplit one's)
    new = np.asarray(write_request_kv({"moe": dst}, rank, pages_out, n, fmt, chunks, dcp=dcp_out)["moe"])
    if dcp_out == 1:
        for t in range(n):
            np.testing.assert_array_equal(new[rank, :, pages_out[t // page_out], t % page_out], values[:, t])
        assert (new[1 - rank] == 0).all()
        return
    want = _split_expected(values, pages_out, page_out, dcp_out, 4, new.shape[1:])
    live = np.zeros(new.shape[1:], bool)  # the slots of the request's tokens (a last page's others: its own)
    for t in range(n):
        for device in range(4):
            if t % dcp_out == device % dcp_out:
                live[device, :, pages_out[t // page_out], t % page_out // dcp_out] = True
    np.testing.assert_array_equal(new[0][live], want[live])
    untouched = np.ones(new.shape[1:], bool)
    untouched[:, :, pages_out] = False
    assert (new[0][untouched] == 0).all(), "the write touched slots outside the request's pages"
