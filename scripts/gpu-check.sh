#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU: builds with `--features cuda`, runs the GPU
# tests (tests/integration/gpu.rs: the tiny Llama 3 models on cuda:0 against transformers'
# references and the CPU F32 path), the engine bench on cuda:0 (quantized weights as stored and
# dequantized to F32), one layer's attention alone and the serving bench at 1, 16 and 64 users
# on the default model, each step limited to GPU_CHECK_STEP_S seconds (240), and writes a report:
#
#   scripts/gpu-check.sh [REPORT_DIR]          # default target/gpu-check
#
# Without nvcc on the PATH it installs the toolchain from NVIDIA's wheels (scripts/cuda-toolchain.sh,
# needs the Python package registry). CUDA_COMPUTE_CAP defaults to the GPU's own (nvidia-smi).
#
# Where the GPU machine has no Rust toolchain or no network, build on another machine and copy the
# binaries over: `GPU_CHECK_PREBUILT=DIR` skips the build and runs DIR/llama-relay,
# DIR/llama-relay-bench (the load generator), DIR/integration (the integration test binary) and
# DIR/engine (the engine bench binary); see docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-target/gpu-check}
mkdir -p "$OUT"
REPORT="$OUT/report.md"
LOG="$OUT/log.txt"
: >"$LOG"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU answers (nvidia-smi -L failed); nothing to check" >&2
  exit 2
fi
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n1)
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '.')
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$CAP}
echo "gpu-check: $GPU, compute capability $CUDA_COMPUTE_CAP" | tee -a "$LOG"
# On a GPU machine a GPU test that finds no device fails instead of skipping.
export LLAMA_RELAY_REQUIRE_GPU=1

if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  BIN="$GPU_CHECK_PREBUILT/llama-relay"
  BENCH="$GPU_CHECK_PREBUILT/llama-relay-bench"
  TESTS="$GPU_CHECK_PREBUILT/integration"
  ENGINE="$GPU_CHECK_PREBUILT/engine"
  BUILD_S=prebuilt
  for f in "$BIN" "$BENCH" "$TESTS" "$ENGINE"; do
    [ -x "$f" ] || { echo "gpu-check: $f is missing or not executable" >&2; exit 2; }
  done
else
  if ! command -v nvcc >/dev/null 2>&1; then
    eval "$(scripts/cuda-toolchain.sh)"
  fi
  start=$(date +%s)
  cargo build --release --features cuda --bin llama-relay --bin llama-relay-bench --test integration --bench engine 2>&1 | tee -a "$LOG" | grep -E '^(error|warning: unused)' || true
  BUILD_S="$(($(date +%s) - start)) s"
  BIN=target/release/llama-relay
  BENCH=target/release/llama-relay-bench
  TESTS=$(ls -t target/release/deps/integration-* | grep -v '\.d$' | head -n1)
  ENGINE=$(ls -t target/release/deps/engine-* | grep -v '\.d$' | head -n1)
fi

# CUDA's libraries where such machines keep them (the toolkit, or the wheels beside PyTorch).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
  [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH
if ldd "$BIN" | grep -q 'not found'; then
  echo "gpu-check: $BIN misses libraries:" >&2
  ldd "$BIN" | grep 'not found' >&2
  exit 2
fi

# Each step gets at most GPU_CHECK_STEP_S seconds (default 240): on a device lent for minutes, one
# step that hangs or crawls must not take the others' time. A step cut short says so in the report.
STEP_S=${GPU_CHECK_STEP_S:-240}
limited() {
  local rc=0
  timeout -k 5 "$STEP_S" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu-check: timed out after $STEP_S s: ${*##*/}"
  fi
  return "$rc"
}

section() { printf '\n## %s\n\n```\n' "$1" >>"$REPORT"; }
endsection() { printf '```\n' >>"$REPORT"; }

# step PATTERN CMD...: runs CMD (limited), its whole output into the log and the lines matching
# PATTERN into the report; a step that fails adds its exit status and why (a panic's message, or
# the first error line) and marks the check failed.
step() {
  local pattern=$1 out rc=0 why
  shift
  out=$(mktemp)
  limited "$@" >"$out" 2>&1 || rc=$?
  cat "$out" >>"$LOG"
  grep -E "$pattern|^gpu-check:" "$out" >>"$REPORT" || true
  if [ "$rc" -ne 0 ]; then
    why=$(grep -m1 -A1 'panicked at' "$out" | sed -n 2p || true)
    [ -n "$why" ] || why=$(grep -m1 -iE 'error|invalid|gpu-check:' "$out" || true)
    echo "step failed (exit $rc): $why" >>"$REPORT"
    status=1
  fi
  rm -f "$out"
}

{
  echo "# GPU check"
  echo
  echo "- GPU: $GPU"
  echo "- compute capability built for: $CUDA_COMPUTE_CAP"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- build: $BUILD_S"
} >"$REPORT"

status=0
section "GPU tests (gpu_*, against the references and the CPU F32 path)"
# --nocapture: a test that skips says so only on its output, which passing tests otherwise hide.
step '^test |test result|skipped' "$TESTS" gpu_ --test-threads 1 --nocapture
grep -q 'test result: ok' "$REPORT" || status=1
if grep -q 'skipped' "$LOG"; then
  echo "gpu-check: GPU tests skipped (see above): no GPU result" >>"$REPORT"
  status=1
fi
endsection

# Quantized weights as stored (candle's CUDA quantized matmul) against dequantized to F32
# (cuBLAS): engine.weights picks the faster for the GPU from these.
for w in keep f32; do
  section "Engine bench on cuda:0 (default model, F16 KV, weights $w)"
  step 'tok/s|ms|model|RSS' "$ENGINE" --device cuda:0 --weights $w --reps 5
  endsection
done

# One layer's attention alone (the generic path: decodes in padded groups, chunks alone): where
# a paged-attention kernel would pay.
section "Attention on cuda:0, one layer (decodes after 1,000 positions; a 256-token chunk)"
for n in 1 16 64; do
  step '^attention' "$ENGINE" --device cuda:0 --attention $n --context 1000 --reps 3
done
step '^attention' "$ENGINE" --device cuda:0 --attention 1 --chunk 256 --context 1000 --reps 3
endsection

section "Serving bench on cuda:0 (1, 16, 64 users; 100-word prompts, 64 new tokens)"
LLAMA_RELAY__ENGINE__DEVICE=cuda:0 LLAMA_RELAY__SCHEDULER__MAX_RUNNING=64 \
  step 'users|tok/s|TTFT' "$BENCH" throughput --users 1,16,64
endsection

echo "gpu-check: report in $REPORT (full log $LOG), status $status" >&2
cat "$REPORT"
exit $status
