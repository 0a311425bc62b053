#!/usr/bin/env bash
# One prepared session on a GPU machine (the device tool's H200): what the CPU machine cannot show.
# Superseded by `python -m jaxdp.bench.gpu --deadline-s 500` (docs/h200.md) for its words, kernels and decode
# stages (its tests and trace stages); kept for `smoke` and the kernel bench's full grid (`bench`).
#   bash benchmarks/gpu_session.sh     # outputs in $OUT (default ./gpu_session); DEADLINE_S (default 400);
#                                      # STAGES: which stages, in this order (default: all)
# Stages, each cut to the time left before the deadline:
#   smoke    a step at tiny width: does jaxdp run on this machine's JAX at all
#   words    tests/test_kernels_words.py compiled by Triton: 2-4 GiB one-byte operands (kernels_pallas/words.py)
#   kernels  the Pallas kernel tests compiled by Triton (JAXDP_PALLAS_INTERPRET=0) against their references
#   decode   `one_batch` at DeepSeek-V3's width (5 layers: 3 dense + 2 MoE of 256 experts, block FP8, bf16
#            activations, one GPU), decode at batch 32, 1 and 256, each against the floor at the bandwidth
#            measured there (`jaxdp.bench.roofline`)
#            (DECODE_BATCHES, default "32 1 256"; KERNEL_TESTS: the kernel tests' ids, default their three files)
#   bench    the kernel bench (kernels_pallas.bench, BENCH_KERNELS, default mla,nvfp4) beside the XLA path
# It uses the JAX installed there (the H200 image has jax 0.11 with CUDA 13; the project pins 0.10, whose CUDA
# wheels are too large to carry), so `smoke` is also a check of the next JAX.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_session}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
export JAXDP_CACHE="$OUT_DIR/cache"
PY="${PYTHON:-python3}"
STAGES=" ${STAGES:-smoke words kernels decode bench} "
END=$(( $(date +%s) + ${DEADLINE_S:-400} ))
log="$OUT_DIR/session.txt"

stage() {  # stage NAME MAX_S CMD...: run CMD for at most MAX_S seconds and what is left before the deadline
  local name=$1 max=$2
  shift 2
  local left=$(( END - $(date +%s) - 5 ))
  local t=$(( max < left ? max : left ))
  if (( t < 15 )); then echo "== $name: skipped, no time left" | tee -a "$log"; return 1; fi
  echo "== $name (at most ${t} s)" | tee -a "$log"
  local t0=$SECONDS
  timeout "$t" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( SECONDS - t0 )) s" | tee -a "$log"
  return "$rc"
}
want() { [[ "$STAGES" == *" $1 "* ]]; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PY" -c "import jax, flax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$log"

TRITON=(env JAX_PLATFORMS=cuda JAXDP_PALLAS_INTERPRET=0 "$PY" -m pytest -q -rs -p no:cacheprovider)
ONE=("$PY" -m jaxdp.one_batch --model-path deepseek-v3 --num-layers 5 --quantization fp8 --dtype bfloat16
     --input-len 64 --output-len 16)
want smoke && stage smoke 120 "$PY" -m jaxdp.one_batch --model-path deepseek-v3 --width tiny --num-layers 5 \
  --quantization fp8 --dtype bfloat16 --batch-size 4 --output-len 4
want words && stage "words (Triton)" 150 "${TRITON[@]}" tests/test_kernels_words.py
# shellcheck disable=SC2086  # KERNEL_TESTS is a list of test ids
want kernels && stage "kernel tests (Triton)" 150 "${TRITON[@]}" \
  ${KERNEL_TESTS:-tests/test_kernels_mla.py tests/test_kernels_nvfp4.py tests/test_kernels_fp8.py}
if want decode; then
  stage "machine" 60 "$PY" -m jaxdp.bench.roofline --refresh
  for b in ${DECODE_BATCHES:-32 1 256}; do stage "decode batch $b" 120 "${ONE[@]}" --batch-size "$b"; done
fi
want bench && stage "kernel bench" 200 "$PY" -m kernels_pallas.bench --preset full --iters 10 \
  --kernels "${BENCH_KERNELS:-mla,nvfp4}" --json "$OUT_DIR/kernel_bench.json" --markdown "$OUT_DIR/kernel_bench.md"
echo "done at $(date -u)" | tee -a "$log"
