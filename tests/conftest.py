"""Tests run on the CPU with 8 host devices; the flag must be set before JAX is imported."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# jaxdp's cache (the machine's measured roofline figures that one_batch prints) apart from the user's: figures
# measured under the suite's load must not be what benchmarks read later
os.environ.setdefault("JAXDP_CACHE", tempfile.mkdtemp(prefix="jaxdp-test-cache-"))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def blocked_prompt_path():
    """Every prompt step in blocks (`jaxdp.model.mla_prompt.attend_blocked`), however small: the test steps are
    small enough to run in one piece otherwise (`DENSE_MAX_SCORES`), so the modules that compare against
    transformers and the single device take this fixture to check the form real sizes run."""
    from jaxdp.model import mla_prompt as prefill

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill, "DENSE_MAX_SCORES", -1)
        yield
