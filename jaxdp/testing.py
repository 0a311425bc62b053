"""Stand-ins for tests and host-only benchmarks: parts of the product's interfaces without a model or device.

`HostOnlyRunner` has `jaxdp.parallel.step.StepRunner`'s interface as the engine uses it and returns at once, so
the engine's loop (scheduling, building the step's arrays, booking tokens) runs, and is timed, on its own."""

from __future__ import annotations

import numpy as np

from jaxdp.config import get_config
from jaxdp.layout import parse_mesh_spec


class HostOnlyRunner:
    """A stand-in for `StepRunner` whose step returns at once: every sampled token is `token`.

    It has the runner's interface as the engine uses it (config, layout, pool size, token carry, put,
    compile, run, local values, sampling), so the engine's loop runs unchanged around it."""

    def __init__(self, model: str, mesh: str, num_pages: int, page_size: int, token: int = 1):
        self.cfg, self.layout = get_config(model), parse_mesh_spec(mesh)
        self.num_pages, self.page_size, self.token_carry = num_pages, page_size, 1
        self.token, self.last_account, self.compiles = token, None, 0

    def ensure_token_carry(self, width: int) -> None:
        self.token_carry = max(self.token_carry, width)

    def put(self, x, spec=None):
        return x

    def local_values(self, x):
        return np.asarray(x)

    def compile(self, shape) -> None:
        pass

    def run(self, shape, stacked: dict, prev_tokens=None):
        return stacked["logits_idx_B"], None  # stands for the logits: one row per sequence

    def sample_tokens(self, logits_RB, *params, width: int):
        tokens = np.full((logits_RB.shape[0], width), self.token, np.int32)
        return tokens, np.zeros(tokens.shape, np.float32)

    def close(self) -> None:
        pass
