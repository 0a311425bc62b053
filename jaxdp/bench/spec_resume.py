"""Acceptance after speculation resumes (docs/experiments.md, recipes; run from the repository root with
PYTHONPATH=$PWD: `python benchmarks/results/recipes-resume-accept.py 32 16`): the default model, dp=1, N long-skill problems at once; speculating
always, and switched off above K running requests (shallow steps, then verifies again as the batch shrinks)."""
import os, sys, time, json
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.environ.get("PYTHONPATH", os.getcwd()))
import numpy as np
from jaxdp.engine.engine import Engine
from jaxdp.engine.options import EngineConfig, SpeculativeConfig
from jaxdp.engine.request import SamplingParams
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import LONG, sample_problem

N, K = int(sys.argv[1]), int(sys.argv[2])
tok = Tokenizer.from_dir(default_model_path())
rng = np.random.default_rng(0)
batch = [tok.encode(sample_problem(rng, LONG[i % 2], held_out=True).prompt) for i in range(N)]
params = SamplingParams(max_new_tokens=72, temperature=0.0)
out = {}
for name, off in (("always", None), (f"off above {K}", K)):
    cfg = EngineConfig(max_running_requests=N, chunked_prefill_size=1024,
                       speculative=SpeculativeConfig(disable_by_batch_size=off), disable_cuda_graph=True)
    e = Engine("default", "dp=1", cfg)
    t0 = time.time()
    reqs = e.generate(batch, params)
    dt = time.time() - t0
    kinds = [r.kind for r in e.pipeline.stats.records]
    ver = sum(r.spec_verify_ct for r in reqs)
    acc = sum(r.spec_accepted for r in reqs)
    # requests still running when speculation resumed: those whose verifies came after shallow steps
    out[name] = {"accept_length": 1 + acc / ver if ver else 0, "verifies": ver, "steps": {k: kinds.count(k) for k in set(kinds)},
                 "tokens": [r.output_ids for r in reqs], "per_request": [(r.spec_verify_ct, r.spec_accepted) for r in reqs],
                 "seconds": dt}
    print(name, {k: v for k, v in out[name].items() if k not in ("tokens", "per_request")}, flush=True)
    e.shutdown()
same = out["always"]["tokens"] == out[f"off above {K}"]["tokens"]
print("same tokens:", same)
# the requests that verified after shallow steps: compare their accept length with the same requests' always
a, b = out["always"]["per_request"], out[f"off above {K}"]["per_request"]
resumed = [i for i, (v, _) in enumerate(b) if v > 0]
va, aa = sum(a[i][0] for i in resumed), sum(a[i][1] for i in resumed)
vb, ab = sum(b[i][0] for i in resumed), sum(b[i][1] for i in resumed)
print(f"resumed requests {len(resumed)}: always {1 + aa / va:.3f} ({va} verifies), off-above {1 + ab / vb:.3f} ({vb} verifies)")
