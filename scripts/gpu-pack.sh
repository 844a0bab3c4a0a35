#!/usr/bin/env bash
# Builds the `cuda` binaries here (no GPU needed) and packs them, with the default model, for a
# GPU machine that has no Rust toolchain and no network (this workplace's device machines): the
# files land in `.gpu/` in pieces small enough to travel one per call. docs/gpu.md has the calls.
#
#   CUDA_COMPUTE_CAP=90 scripts/gpu-pack.sh      # 90: H100/H200 (the default); 80: A100
#
# .gpu/bin.tar.xz     llama-relay, llama-relay-bench, integration (the test binary), engine (the engine bench),
#                     stripped; the test binary reads its fixtures from this checkout's path, so
#                     the GPU machine links the path to its copy (docs/gpu.md)
# .gpu/model.part-*   the default model's GGUF in 30 MB pieces (`cat` them back)
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
eval "$(scripts/cuda-toolchain.sh)"
# Its own target folder: the CPU build in target/release stays as it is.
T=target/cuda
CARGO_TARGET_DIR=$T cargo build --release --features cuda --bin llama-relay --bin llama-relay-bench --test integration --bench engine
newest() { ls -t $T/release/deps/"$1"-* | grep -vE '\.(d|rlib|rmeta)$' | head -n1; }
rm -rf .gpu && mkdir -p .gpu/bin
cp $T/release/llama-relay .gpu/bin/llama-relay
cp $T/release/llama-relay-bench .gpu/bin/llama-relay-bench
cp "$(newest integration)" .gpu/bin/integration
cp "$(newest engine)" .gpu/bin/engine
strip .gpu/bin/*
tar -C .gpu -cf - bin | xz -T0 -6 >.gpu/bin.tar.xz
rm -rf .gpu/bin
# Where the server keeps the default model (src/default_model.rs: cache_dir).
cache=${LLAMA_RELAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-relay}
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "gpu-pack: no default model at $model: start the server once" >&2; exit 1; }
split -b 30M "$model" .gpu/model.part-
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
ls -la .gpu
