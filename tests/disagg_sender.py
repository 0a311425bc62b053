"""The prefill side of tests/test_disagg_kv.py, in a process of its own: a dp=2 x tp=2 pool on 4 host devices
holding known values, one request's KV read from rank 1's pages and offered through JAX's transfer server
under a bootstrap room, the room published on the bootstrap endpoint. Prints the endpoint's port, then
waits for stdin to close. argv: port, room, mode ("ok": as described; "big": offers 512 MiB instead)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.disagg.bootstrap import BootstrapServer, PrefillInfo, RoomBoard
from jaxdp.disagg.kv import KVFormat, read_request_kv
from jaxdp.disagg.transfer import JaxTransport

PAGES, N_TOKENS, RANK, CHUNK = [7, 2, 9], 21, 1, 16


def pool_values():
    """The sender's pool: entry -> [dp=2, layers, pages=12, page_size=8, width]; known values."""
    rng = np.random.default_rng(7)
    return {"dense": rng.normal(size=(2, 1, 12, 8, 20)).astype(np.float32),
            "moe": rng.normal(size=(2, 2, 12, 8, 20)).astype(np.float32)}


def main():
    port, room, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 4)  # (before the backend starts; the test's process imports this file too)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cache = {k: jax.device_put(v, NamedSharding(mesh, P("dp"))) for k, v in pool_values().items()}
    fmt = KVFormat.of(cache, CHUNK)
    transport = JaxTransport()
    board = RoomBoard()
    server = BootstrapServer(PrefillInfo("test-model", fmt.to_json(), 2, transport.name, transport.address()),
                             board, "127.0.0.1", port)
    if mode == "big":
        arrays = [jnp.ones((128, 1024, 1024), jnp.float32)]
    else:
        arrays = read_request_kv(cache, RANK, PAGES, N_TOKENS, fmt)
    jax.block_until_ready(arrays)
    transport.offer(room, arrays, timeout_s=60)
    board.publish(room, {"status": "ready", "rank": RANK, "n_tokens": N_TOKENS, "first_token": 42,
                         "first_logprob": -0.5})
    print(port, flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    main()
