"""`python -m jaxdp.serve`: the OpenAI-compatible and SGLang-native HTTP server (FastAPI + uvicorn).

    python -m jaxdp.serve --mesh dp=8                         # the embedded default model, 8 attention-DP ranks
    python -m jaxdp.serve --model-path DIR --tp-size 8 --attn-dp-size 8 --port 30000
    python -m jaxdp.serve --model-path DIR --dp-size 2 --load-balance-method total_tokens   # two replicas
    python -m jaxdp.serve --mesh dp=16 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:5000  # on node 0,
    python -m jaxdp.serve --mesh dp=16 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000  # on node 1

KV pool per rank: --max-total-tokens N gives it N tokens. Otherwise, on a GPU, every device may hold
--mem-fraction-static of its memory (JAX's bytes_limit) for weights and KV cache: the pool is what that
leaves after the weights (measured with memory_stats once they are sharded), the rest of the memory is
for activations. On a CPU, where memory_stats is unavailable, the pool is --mem-fraction-static x 256 MiB
per rank. --replica-num-pages A,B,... sizes each replica's pool on its own (to reproduce unequal
replicas). User errors (bad flags, a model that does not fit, a port in use) end in one line
`error: ...` and exit status 2.
"""

# The flags of `python -m jaxdp.serve` (SGLang's names where SGLang has the flag) in one parser; the docstring above
# is its --help (description and epilog). `jaxdp.serve_config.serve_config` checks them into one `ServeConfig`;
# docs/api.md lists them (tests/test_api_flags_doc.py checks the page against this parser).

from __future__ import annotations

import argparse

from jaxdp.api.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from jaxdp.cache import cache_dir
from jaxdp.engine.sched.controller import METHODS
from jaxdp.eplb.distribution import DISPATCH_ALGORITHMS
from jaxdp.layout import add_layout_args
from jaxdp.ops.registry import ATTENTION_BACKENDS, FP8_GEMM_BACKENDS, MOE_RUNNER_BACKENDS


def build_parser() -> argparse.ArgumentParser:
    """The flags (SGLang's names where SGLang has the flag); `serve_config` checks them."""
    ap = argparse.ArgumentParser(prog="python -m jaxdp.serve", formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    g = ap.add_argument_group("model")
    g.add_argument("--model-path", default=None, metavar="PATH",
                   help="checkpoint directory or preset (tiny, deepseek-v3, glm-5); default: the embedded model")
    g.add_argument("--tokenizer-path", default=None, metavar="DIR",
                   help="directory with tokenizer.json (default: --model-path)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: requests send input_ids and answers carry output_ids (text requests: 400)")
    g.add_argument("--served-model-name", default=None, metavar="NAME", help="the model name /v1/models reports")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights and activations (auto: bfloat16 on a GPU, float32 on a CPU)")
    g.add_argument("--context-length", type=int, default=None, metavar="N",
                   help="longest prompt + output (default: the model's)")
    g.add_argument("--random-seed", type=int, default=0, metavar="N", help="weights of a preset, and unseeded sampling")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="MLA decode: Pallas kernel, jaxdp's native CPU kernel or XLA (default: pallas on a GPU, "
                        "native on a CPU where it is built, else xla; docs/kernels.md)")
    g.add_argument("--moe-runner-backend", choices=MOE_RUNNER_BACKENDS, default=None,
                   help="routed experts' grouped matmul: xla (lax.ragged_dot, which XLA expands per expert), "
                        "blocked (by blocks of rows, not expanded) or pallas (NVFP4's kernel, blocked for bf16 and "
                        "FP8 experts) or auto (few rows gather their chosen experts, many run blocked) "
                        "or native (jaxdp's CPU kernels) (default: pallas on a GPU, auto on a CPU)")
    g.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="R",
                   help="moe=ep: R redundant expert slots (E + R over the devices), hot experts held several times "
                        "(docs/eplb.md)")
    g.add_argument("--init-expert-location", default=None, metavar="PATH",
                   help="moe=ep: the expert placement to start from, a JSON or .npz file holding a map "
                        "(physical_to_logical_map) or a recorded load (logical_count) (default: the EPLB "
                        "algorithm's placement of a uniform load)")
    g.add_argument("--ep-dispatch-algorithm", choices=DISPATCH_ALGORITHMS, default="static",
                   help="moe=ep with redundant experts: how a (row, choice) picks one of its expert's replicas: "
                        "static (by row and choice) or dynamic (each step, the split keeping the devices' loads "
                        "even; docs/eplb.md)")
    g.add_argument("--expert-distribution-recorder-mode", default=None, metavar="MODE",
                   help="stat: count the tokens routed to each MoE layer's experts on the devices, for "
                        "/start_expert_distribution_record and its family and /metrics' balancedness (docs/eplb.md)")
    g.add_argument("--enable-eplb", action="store_true",
                   help="moe=ep with --ep-num-redundant-experts: a new expert placement every "
                        "--eplb-rebalance-num-iterations steps from the tokens routed, the weights moved between "
                        "steps (docs/eplb.md)")
    g.add_argument("--eplb-rebalance-num-iterations", type=int, default=None, metavar="N",
                   help="--enable-eplb: steps between two rebalances (default 1000)")
    g.add_argument("--eplb-rebalance-layers-per-chunk", type=int, default=None, metavar="C",
                   help="--enable-eplb: MoE layers moved between two steps (default: all of them)")
    g.add_argument("--fp8-gemm-backend", choices=FP8_GEMM_BACKENDS, default=None,
                   help="the layers' projection GEMMs (block-FP8 or plain weights read in place): pallas, native "
                        "(jaxdp's CPU kernels) or xla (the layer dequantized, then XLA's dot) (default: pallas on a "
                        "GPU, native on a CPU, each where the shape fits, else xla; docs/kernels.md)")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels: a request's tokens and logprobs do not depend on what shares its "
                        "steps, its rank, its chunking or a prefix-cache hit (a CPU's native kernels; "
                        "docs/determinism.md)")
    g.add_argument("--dcp-size", type=int, default=1, metavar="N",
                   help="decode context parallelism: each attention group's KV pool split token-wise over N of its tp "
                        "devices (N divides tp), so the group holds N times the tokens (docs/dcp.md)")
    g.add_argument("--quantization", choices=["nvfp4", "fp8"], default=None,
                   help="nvfp4: the routed experts in NVFP4 (a ModelOpt NVFP4 checkpoint turns this on by itself); "
                        "fp8: the layers' weights in block FP8 (a block-FP8 checkpoint stays FP8 by itself)")
    g.add_argument("--index-key-dtype", choices=["auto", "fp8"], default="auto",
                   help="DSA models (GLM-5, DeepSeek-V3.2): the indexer's cached keys in the KV cache's dtype, or fp8 "
                        "(e4m3 plus one fp32 scale per 128 values: 132 bytes a token for GLM-5, as SGLang holds them)")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="read tool calls in chat outputs, in this model family's format (SGLang's names: "
                        f"{', '.join(TOOL_CALL_PARSER_NAMES)}); docs/api.md")
    g.add_argument("--grammar-backend", default=None, metavar="NAME",
                   help="structured outputs' grammar library (SGLang's names): llguidance, xgrammar (pip install "
                        "xgrammar) or none (default: llguidance)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the reasoning off chat outputs as reasoning_content (SGLang's names: "
                        f"{', '.join(REASONING_PARSER_NAMES)}); docs/api.md")
    g = ap.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=30000, metavar="N", help="port (default 30000)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="every endpoint but /health needs 'Authorization: Bearer KEY'")
    g.add_argument("--max-request-bytes", type=int, default=16 * 2**20, metavar="N",
                   help="largest request body; a larger one gets a 413 before it is read (default 16 MiB)")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests waiting for a rank, all ranks together; beyond it a 503 with Retry-After")
    g.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="a request still running after this many seconds ends with an error (default: none)")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, new requests get a 503 and those in flight may finish within this many "
                        "seconds; the rest then end with an error (default 30)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--decode-log-interval", type=int, default=40, metavar="STEPS",
                   help="a Decode batch log line per rank every this many decode steps")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine (its loop and the devices) in a process of its own, as SGLang's scheduler "
                        "and vLLM's engine core do: HTTP, tokenization and streaming then take no CPU or "
                        "interpreter lock from the loop. The default on one node; --no-engine-process keeps it in "
                        "the server's process, as node 0 of several always does")
    g.add_argument("--engine-child", action="store_true",  # the server's engine process: its config comes on stdin
                   help=argparse.SUPPRESS)
    g = ap.add_argument_group("memory and scheduling")
    g.add_argument("--mem-fraction-static", type=float, default=0.88, metavar="F",
                   help="share of device memory for weights + KV cache (see the pool sizing above)")
    g.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                   help="KV pool tokens per rank (overrides the above)")
    g.add_argument("--replica-num-pages", default=None, metavar="A,B,...",
                   help="KV pool pages per replica of --dp-size (unequal pools, for experiments)")
    g.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per KV page")
    g.add_argument("--chunked-prefill-size", type=int, default=256, metavar="N",
                   help="prompt tokens per step, all ranks together (divided among attention-DP ranks)")
    g.add_argument("--max-running-requests", type=int, default=64, metavar="N",
                   help="requests running at once, all ranks together (divided among attention-DP ranks)")
    g.add_argument("--schedule-conservativeness", type=float, default=1.0, metavar="F",
                   help="reservation for future tokens at admission (x0.3 under attention DP)")
    g.add_argument("--load-balance-method", choices=METHODS, default="round_robin",
                   help="which rank (or replica) a new request goes to")
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each step's tokens back before planning the next (the overlap is off anyway when "
                        "speculating)")
    g.add_argument("--enable-two-batch-overlap", action="store_true",
                   help="split a step into two micro-batches when every rank can, so that one's expert dispatch and "
                        "combine run during the other's compute; on a GPU it adds XLA's latency-hiding scheduler "
                        "and no combining of collectives to `XLA_FLAGS`, unless set (docs/tbo.md)")
    g.add_argument("--tbo-token-distribution-threshold", type=float, default=0.48,
                   help="with --enable-two-batch-overlap: the smallest share of a prompt step's tokens either "
                        "micro-batch may hold (a rank whose split is more uneven runs the step whole)")
    g.add_argument("--enable-mixed-chunk", action="store_true",
                   help="a rank reading a prompt carries its own decoding requests in the same step")
    g.add_argument("--enable-prefill-delayer", action="store_true",
                   help="a rank with a prompt waits until every rank has one (at most the passes below)")
    g.add_argument("--prefill-delayer-max-delay-passes", type=int, default=None, metavar="N",
                   help="passes of the loop a prompt waits at most (default 30)")
    g.add_argument("--prefill-delayer-token-usage-low-watermark", type=float, default=None, metavar="F",
                   help="no wait while a rank with a prompt uses less than this share of its KV pool")
    g = ap.add_argument_group("prefill/decode disaggregation (behind SGLang's router: --pd-disaggregation)")
    g.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="prefill: read prompts and hand their KV to a decode server; decode: take it and decode")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, metavar="PORT",
                   help="prefill: the port of its bootstrap endpoint (give it to the router after the URL)")
    g.add_argument("--disaggregation-transfer-backend", default="jax", metavar="NAME",
                   help="the KV transfer library: jax (JAX's transfer server)")
    g.add_argument("--disaggregation-timeout", type=float, default=60.0, metavar="S",
                   help="decode: the longest a request waits for its KV; prefill: how long an offered KV is kept")
    g = ap.add_argument_group("speculative decoding (the checkpoint's MTP layer drafts)")
    g.add_argument("--speculative-algorithm", default=None, metavar="NAME",
                   help="EAGLE or NEXTN: draft with the model's MTP layer, verify with the model")
    g.add_argument("--speculative-num-steps", type=int, default=None, metavar="N",
                   help="draft steps a verify checks (3)")
    g.add_argument("--speculative-eagle-topk", type=int, default=None, metavar="K", help="drafts per step: 1 (a chain)")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                   help="rows a verify reads per request: the steps + 1 (4)")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="vLLM's: speculation is off while more than N requests are held (running or waiting, all "
                        "ranks); it resumes as they finish (default: never)")
    g = ap.add_argument_group("compiled steps (CUDA graphs)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="BS",
                   help="largest decode bucket per rank (SGLang's list up to it; default: the per-rank batch)")
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="BS",
                   help="the decode buckets per rank, explicitly")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="compile each step shape on first use instead of all at start-up")
    g.add_argument("--compilation-cache-dir", default=str(cache_dir() / "xla"), metavar="DIR",
                   help="JAX's persistent compilation cache ('' to disable; default: under JAXDP_CACHE, else "
                        "~/.cache/jaxdp)")
    g = ap.add_argument_group("several nodes (one model world; serve/README.md)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes the mesh spans (default 1)")
    g.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="this node (0 runs the HTTP API; the others run their ranks' loops and /health)")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's address for JAX's distributed runtime, the same on every node ([::1]:5000 "
                        "for IPv6)")
    g.add_argument("--dist-timeout", type=float, default=60.0, metavar="S",
                   help="a node that does not answer a step for this long is declared dead (default 60)")
    g.add_argument("--dist-init-timeout", type=float, default=600.0, metavar="S",
                   help="how long nodes wait for each other at start-up, compiles included (default 600)")
    add_layout_args(ap)
    return ap
