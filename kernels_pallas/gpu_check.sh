#!/usr/bin/env bash
# One prepared check of the Pallas kernels on a GPU machine, run from anywhere:
#   bash kernels_pallas/gpu_check.sh
# 1. makes sure JAX sees a GPU (installs jax[cuda12] at the installed jax version if not; on a machine
#    without internet, point JAX_CUDA_WHEELS at a folder of wheels);
# 2. runs the kernel tests compiled by Triton, not interpreted (JAXDP_PALLAS_INTERPRET=0);
# 3. runs the bench (BENCH_ARGS, default "--preset full") beside the XLA path.
# Everything lands in $OUT (default ./kernel_gpu_check): tests.txt, bench.txt, bench.json, bench.md and
# kernels_gpu_section.md, a block ready to paste into docs/kernels.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/kernel_gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python}"
BENCH_ARGS="${BENCH_ARGS:---preset full}"

has_gpu() {
  env -u JAX_PLATFORMS "$PY" -c \
    "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" >/dev/null 2>&1
}

if ! has_gpu; then
  version="$("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 0.10.2)"
  echo "JAX sees no GPU; installing jax[cuda12]==$version" | tee "$OUT_DIR/install.txt"
  if [ -n "${JAX_CUDA_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$JAX_CUDA_WHEELS" "jax[cuda12]==$version" \
      >>"$OUT_DIR/install.txt" 2>&1
  else
    "$PY" -m pip install -q "jax[cuda12]==$version" >>"$OUT_DIR/install.txt" 2>&1
  fi
  if ! has_gpu; then
    echo "Still no GPU backend after installing jax[cuda12]: see $OUT_DIR/install.txt and nvidia-smi." >&2
    exit 2
  fi
fi

"$PY" -c "import pytest, numpy" 2>/dev/null || "$PY" -m pip install -q pytest numpy >>"$OUT_DIR/install.txt" 2>&1

export JAX_PLATFORMS=cuda JAXDP_PALLAS_INTERPRET=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT_DIR/gpu.txt" 2>&1
device="$(head -n1 "$OUT_DIR/gpu.txt")"

"$PY" -m pytest tests/test_kernels_mla.py tests/test_kernels_nvfp4.py -q -rs -p no:cacheprovider \
  2>&1 | tee "$OUT_DIR/tests.txt"
tests_rc=${PIPESTATUS[0]}

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
"$PY" -m kernels_pallas.bench $BENCH_ARGS --json "$OUT_DIR/bench.json" --markdown "$OUT_DIR/bench.md" \
  2>&1 | tee "$OUT_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}

{
  echo "### GPU run ($(date -u +%Y-%m-%d), $device)"
  echo
  echo "Kernel tests compiled by Triton (\`JAX_PLATFORMS=cuda JAXDP_PALLAS_INTERPRET=0\`): $(tail -n1 "$OUT_DIR/tests.txt")"
  echo
  if [ -f "$OUT_DIR/bench.md" ]; then cat "$OUT_DIR/bench.md"; else echo "The bench failed (exit $bench_rc); see bench.txt."; fi
} >"$OUT_DIR/kernels_gpu_section.md"
echo "wrote $OUT_DIR/kernels_gpu_section.md (tests exit $tests_rc, bench exit $bench_rc)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
