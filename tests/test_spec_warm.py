"""Start-up runs every compiled step once on padding (`jaxdp.engine.setup.run_idle`): an executable's first run
costs far more than the next ones on XLA:CPU (50-250 ms more for a speculative step of the default model), which
the first request whose batch takes a shape paid while serving (docs/speculative.md). The idle runs write nothing
a request can read: the pool comes out of start-up as it went in."""

import jax
import numpy as np
import pytest

from tests.test_spec_decode import GREEDY, engine, prompts, rigged, runner_for


@pytest.fixture(scope="module")
def runner():
    return runner_for(rigged(), "dp=2")


def pool_snapshot(runner) -> dict[str, np.ndarray]:
    return {k: np.asarray(jax.device_get(v)) for k, v in runner.cache.items()}


def ran_shapes(runner, monkeypatch) -> list:
    """Record the shape of every step the runner runs (a plain step's `run`, a speculative step's `executable`)."""
    shapes = []
    run, executable = runner.run, runner.executable

    def run_w(shape, *a, **kw):
        shapes.append(shape)
        return run(shape, *a, **kw)

    def executable_w(shape):
        shapes.append(shape)
        return executable(shape)

    monkeypatch.setattr(runner, "run", run_w)
    monkeypatch.setattr(runner, "executable", executable_w)
    return shapes


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_start_up_runs_every_step_once_and_leaves_the_pool_as_it_was(runner, spec, monkeypatch):
    """A plain engine fills part of the pool first (real latents, and draft KV when speculating); a new engine on
    the same runner then starts up: every shape it compiled ran exactly once, and every entry of the pool (main
    latents and draft KV) is bit for bit what it was."""
    first = engine(runner, spec, disable_cuda_graph=True)
    done = first.generate(prompts(6, 4), GREEDY)
    assert all(len(r.output_ids) == GREEDY.max_new_tokens for r in done)
    before = pool_snapshot(runner)
    assert any(np.any(v != 0) for v in before.values())  # (something to keep)
    shapes = ran_shapes(runner, monkeypatch)
    e = engine(runner, spec, extend_buckets=[16, 32], max_running_requests=8)
    compiled = e.buckets.shapes()
    assert sorted(map(repr, shapes)) == sorted(map(repr, compiled)), (len(shapes), len(compiled))
    after = pool_snapshot(runner)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # and it serves as before: the same greedy tokens as the engine that did not run its steps at start-up
    again = e.generate(prompts(6, 4), GREEDY)
    assert [r.output_ids for r in again] == [r.output_ids for r in done]
    assert e.stats.compiles_in_steps == 0
