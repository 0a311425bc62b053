"""The prefill side of tests/test_disagg_kv.py, in a process of its own: a dp=2 x tp=2 pool on 4 host devices
holding known values and a `PrefillSide` (transfer server and bootstrap endpoint). Prints the endpoint's port
once the room is settled, then waits for stdin to close. argv: port, room, mode: "ok" hands one request's KV
over from rank 1's pages; "refuse" announces the room as refused; "silent" never announces it; "big" offers
512 MiB under the room instead (for killing the process mid-transfer). An optional 4th argument names the
transfer backend (default jax)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.disagg.handoff import PrefillSide
from jaxdp.disagg.kv import KVFormat

PAGES, N_TOKENS, RANK, CHUNK, MODEL = [7, 2, 9], 21, 1, 16, "test-model"


def pool_values():
    """The sender's pool: entry -> [dp=2, layers, pages=12, page_size=8, width]; known values."""
    rng = np.random.default_rng(7)
    return {"dense": rng.normal(size=(2, 1, 12, 8, 20)).astype(np.float32),
            "moe": rng.normal(size=(2, 2, 12, 8, 20)).astype(np.float32)}


def main():
    port, room, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    backend = sys.argv[4] if len(sys.argv) > 4 else "jax"
    jax.config.update("jax_num_cpu_devices", 4)  # (before the backend starts; the test's process imports this file too)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cache = {k: jax.device_put(v, NamedSharding(mesh, P("dp"))) for k, v in pool_values().items()}
    side = PrefillSide(KVFormat.of(cache, CHUNK), 2, MODEL, backend=backend, bootstrap_port=port, offer_timeout_s=60)
    if mode == "ok":
        side.hand_off(cache, room, RANK, PAGES, N_TOKENS, 42, -0.5)
    elif mode == "refuse":
        side.refuse(room, "the prompt has 9000 tokens but a rank holds at most 4096; shorten the prompt")
    elif mode == "big":
        big = [jnp.ones((128, 1024, 1024), jnp.float32)]
        jax.block_until_ready(big)
        side.transport.offer(room, big, 60)
        side.board.publish(room, {"status": "ready"})
    print(port, flush=True)
    sys.stdin.read()
    side.close()


if __name__ == "__main__":
    main()
