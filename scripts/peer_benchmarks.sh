#!/usr/bin/env bash
# SGLang's own benchmark client (`python -m sglang.bench_serving`, sglang 0.5.23) and genai-bench 0.0.5, run
# unchanged against `python -m jaxdp.serve --mesh dp=8` serving the embedded default model on 8 host CPU devices.
#
# Each client lives in a venv of its own (created when absent, from the pinned lists in scripts/peer_clients/,
# installed with --no-deps), so the project's environment is not touched. Everything runs offline: the
# prompts are random token ids or small local files, the tokenizer is the default model's directory.
# Each run must report every request completed and none failed; the script exits non-zero otherwise.
#
#   scripts/peer_benchmarks.sh            # results and logs in a fresh temporary folder (printed)
#
# Environment: PEER_OUT (results folder), PEER_SGLANG_VENV, PEER_GENAI_VENV (venv paths; default under
# ~/.cache/jaxdp-peer-clients), PEER_PORT (server port; default a free one), PYTHON (the project's python).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/jaxdp-peer-clients"
VENV_SGL="${PEER_SGLANG_VENV:-$CACHE/sglang-bench}"
VENV_GENAI="${PEER_GENAI_VENV:-$CACHE/genai-bench}"
OUT="${PEER_OUT:-$(mktemp -d -t jaxdp-peer-XXXXXX)}"
MODEL="$ROOT/jaxdp/assets/default-model"
PORT="${PEER_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "peer benchmarks: results and logs in $OUT"

# ---- the clients' venvs ---------------------------------------------------------------------------------------
make_venv() {  # DIR REQUIREMENTS
    local dir="$1" req="$2" stamp
    stamp="$(sha256sum "$req" | cut -c1-16)"
    if [[ -f "$dir/.jaxdp-$stamp" ]]; then return; fi
    echo "creating $dir from $(basename "$req") (a few minutes the first time)"
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install --quiet --no-deps -r "$req" >"$OUT/pip-$(basename "$req" .txt).log" 2>&1 \
        || { tail -20 "$OUT/pip-$(basename "$req" .txt).log"; return 1; }
    touch "$dir/.jaxdp-$stamp"
}
make_venv "$VENV_SGL" "$ROOT/scripts/peer_clients/sglang-bench.txt"
make_venv "$VENV_GENAI" "$ROOT/scripts/peer_clients/genai-bench.txt"

# ---- the server -----------------------------------------------------------------------------------------------
SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
}
trap stop_server EXIT
(cd "$ROOT" && exec "$PY" -m jaxdp.serve --mesh dp=8 --port "$PORT") >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
for i in $(seq 600); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then tail -30 "$OUT/server.log"; echo "the server exited"; exit 1; fi
    if curl -sf "$URL/health" >/dev/null; then break; fi
    if [[ $i == 600 ]]; then tail -30 "$OUT/server.log"; echo "the server did not come up in 300 s"; exit 1; fi
    sleep 0.5
done
echo "server up at $URL"

# ---- local data -----------------------------------------------------------------------------------------------
# Arithmetic prompts the default model answers ("37+48=" -> "85"): a ShareGPT-format file for bench_serving and
# one prompt a line for genai-bench.
"$PY" - "$OUT" <<'EOF'
import json, random, sys
rng = random.Random(0)
pairs = [(a, b) for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(64))]
with open(f"{sys.argv[1]}/arith_sharegpt.json", "w") as f:
    json.dump([{"conversations": [{"from": "human", "value": f"{a}+{b}="}, {"from": "gpt", "value": str(a + b)}]}
               for a, b in pairs], f)
with open(f"{sys.argv[1]}/arith.txt", "w") as f:
    f.write("".join(f"{a}+{b}=\n" for a, b in pairs))
EOF

# ---- sglang.bench_serving ------------------------------------------------------------------------------------
FAILED=0
bench_serving() {  # NAME ARGS...
    local name="$1"; shift
    echo "== sglang.bench_serving $name: $*"
    if ! "$VENV_SGL/bin/python" -m sglang.bench_serving --base-url "$URL" --num-prompts 16 \
            --output-file "$OUT/bench_serving_$name.jsonl" --output-details --disable-tqdm "$@" \
            >"$OUT/bench_serving_$name.log" 2>&1; then
        tail -30 "$OUT/bench_serving_$name.log"; echo "FAILED: bench_serving $name exited non-zero"; FAILED=1; return
    fi
    grep -E "^(Backend|Successful requests|Benchmark duration|Total (input|generated) tokens|Request throughput|\
Output token throughput|Mean (E2E Latency|TTFT|ITL)|Median TTFT)" "$OUT/bench_serving_$name.log" | sed 's/^/   /'
    "$PY" - "$OUT/bench_serving_$name.jsonl" <<'EOF' || FAILED=1
import json, sys
r = [json.loads(line) for line in open(sys.argv[1])][-1]
errors = [e for e in r.get("errors", []) if e]
ok = r["completed"] == len(r["output_lens"]) > 0 and not errors
print(f"   completed {r['completed']} of {len(r['output_lens'])}, failed {len(errors)}" + ("" if ok else "  FAILED"))
for e in errors[:3]:
    print("   error:", e[-300:])
sys.exit(0 if ok else 1)
EOF
}
# --dataset-name random samples its token ids from ShareGPT text: the local file stands in for the download
RANDOM_TEXT=(--dataset-name random --dataset-path "$OUT/arith_sharegpt.json" --random-input-len 16 --random-output-len 8)
RANDOM_IDS=(--dataset-name random-ids --random-input-len 16 --random-output-len 8)
# no --tokenizer: bench_serving reads tokenizer_path from /model_info
bench_serving sglang --backend sglang "${RANDOM_TEXT[@]}"
bench_serving sglang-oai --backend sglang-oai --tokenizer "$MODEL" "${RANDOM_TEXT[@]}"
bench_serving sglang-oai-chat --backend sglang-oai-chat --tokenizer "$MODEL" "${RANDOM_TEXT[@]}"
bench_serving vllm --backend vllm --tokenizer "$MODEL" "${RANDOM_TEXT[@]}"
bench_serving sharegpt --backend sglang --tokenizer "$MODEL" --dataset-name sharegpt \
    --dataset-path "$OUT/arith_sharegpt.json" --disable-ignore-eos
bench_serving chat-nostream --backend sglang-oai-chat --tokenizer "$MODEL" --disable-stream "${RANDOM_IDS[@]}"

# ---- genai-bench ----------------------------------------------------------------------------------------------
genai_bench() {  # NAME BACKEND SCENARIO ARGS...
    local name="$1" backend="$2" scenario="$3"; shift 3
    echo "== genai-bench $name: --api-backend $backend --traffic-scenario $scenario $*"
    rm -rf "$OUT/genai_$name"
    # genai-bench wants --api-backend before --api-key
    if ! (cd "$OUT" && "$VENV_GENAI/bin/genai-bench" benchmark --api-backend "$backend" --api-base "$URL" \
            --api-key none \
            --api-model-name default-model --model-tokenizer "$MODEL" --task text-to-text \
            --traffic-scenario "$scenario" --num-concurrency 4 --max-requests-per-run 16 --max-time-per-run 2 \
            --server-engine SGLang --experiment-base-dir "$OUT/genai_$name" --log-dir "$OUT/genai_$name/logs" \
            "$@") >"$OUT/genai_$name.log" 2>&1; then
        tail -30 "$OUT/genai_$name/logs/genai_bench.log" 2>/dev/null || tail -30 "$OUT/genai_$name.log"
        echo "FAILED: genai-bench $name exited non-zero"; FAILED=1; return
    fi
    "$PY" - "$OUT/genai_$name" <<'EOF' || FAILED=1
import glob, json, sys
runs = [f for f in glob.glob(f"{sys.argv[1]}/*/*.json") if not f.endswith("experiment_metadata.json")]
ok = bool(runs)
for f in runs:
    a = json.load(open(f))["aggregated_metrics"]
    s = a["stats"]
    good = a["num_completed_requests"] > 0 and a["num_error_requests"] == 0
    ok &= good
    print(f"   {a['scenario']} concurrency {a['num_concurrency']}: completed {a['num_completed_requests']}, "
          f"errors {a['num_error_requests']}, {a['requests_per_second']:.2f} req/s, "
          f"TTFT mean {s['ttft']['mean']:.3f} s, e2e mean {s['e2e_latency']['mean']:.3f} s, "
          f"output {a['mean_output_throughput_tokens_per_s']:.1f} tok/s" + ("" if good else "  FAILED"))
sys.exit(0 if ok else 1)
EOF
}
# the sglang backend adds ignore_eos, so every request streams max_tokens tokens
genai_bench sglang sglang "D(16,8)"
# the plain OpenAI backend (no ignore_eos): prompts the model answers, so no answer is empty
genai_bench openai openai "D(6,4)" --dataset-path "$OUT/arith.txt"

stop_server
if [[ $FAILED != 0 ]]; then echo "peer benchmarks FAILED (logs in $OUT)"; exit 1; fi
echo "peer benchmarks passed: sglang.bench_serving (6 runs) and genai-bench (2 runs) against jaxdp"
