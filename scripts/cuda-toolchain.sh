#!/usr/bin/env bash
# Installs a CUDA 13.0 toolchain from NVIDIA's Python wheels into a cache folder and prints the
# environment `cargo build --release --features cuda` needs, for machines with no CUDA toolkit
# (and possibly no GPU). Use:
#
#   eval "$(scripts/cuda-toolchain.sh)"            # CUDA_COMPUTE_CAP=90 unless already set
#   cargo build --release --features cuda
#
# What it sets up under $CUDA_TOOLCHAIN_DIR (default ~/.cache/llama-relay/cuda-13.0):
# - nvcc (with NVVM's cicc), the C runtime headers, CCCL, cudart, NVRTC, cuBLAS and cuRAND from
#   the wheels, pinned to CUDA 13.0 (what the GPU machines' images carry; cudarc 0.19 knows it);
# - unversioned `libX.so` links the linker looks for (the wheels ship only `libX.so.N`);
# - a stub `libcuda.so` (soname `libcuda.so.1`) in `lib/stubs`, generated from the driver API
#   functions cudarc declares: the driver library comes with the NVIDIA driver, never in a wheel,
#   and the build only needs something to link against. Every stub answers
#   CUDA_ERROR_STUB_LIBRARY; on a machine with a driver the real `libcuda.so.1` is loaded instead.
#
# CUDA_COMPUTE_CAP must be explicit: there is no GPU to ask. Build for the GPU that will run it:
# candle's quantized matmul kernels are compiled to machine code for that capability alone (90
# becomes sm_90a, Hopper: H100/H200; 80 is Ampere: A100), the rest to PTX for it. Progress goes
# to stderr; stdout is only the `export` lines.
set -euo pipefail

DIR=${CUDA_TOOLCHAIN_DIR:-$HOME/.cache/llama-relay/cuda-13.0}
CAP=${CUDA_COMPUTE_CAP:-90}
PY=${PYTHON:-python3}
WHEELS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-runtime==13.0.88
  nvidia-cuda-nvrtc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cublas==13.1.0.3
  nvidia-curand==10.4.0.35
)
STAMP="$DIR/.installed-$(printf '%s\n' "${WHEELS[@]}" | sha256sum | cut -c1-16)"
ROOT="$DIR/site/nvidia/cu13"

if [ ! -e "$STAMP" ]; then
  echo "cuda-toolchain: installing ${WHEELS[*]} into $DIR" >&2
  rm -rf "$DIR/site"
  mkdir -p "$DIR"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$DIR/site" "${WHEELS[@]}" >&2

  # Unversioned names for the linker.
  for lib in cudart nvrtc cublas cublasLt curand; do
    real=$(cd "$ROOT/lib" && ls "lib$lib.so."* | grep -v builtins | grep -v '\.alt\.' | sort | head -n1)
    ln -sf "$real" "$ROOT/lib/lib$lib.so"
  done

  # The driver stub: one function per driver API name cudarc declares.
  SYS=$(cargo metadata --format-version 1 --features cuda 2>/dev/null |
    "$PY" -c 'import json,sys; m=json.load(sys.stdin); print(next(p["manifest_path"] for p in m["packages"] if p["name"]=="cudarc"))' |
    xargs dirname)/src/driver/sys/mod.rs
  mkdir -p "$ROOT/lib/stubs"
  grep -oE 'load::<_F>\("cu[A-Za-z0-9_]+"\)' "$SYS" | sed -E 's/.*"(cu[A-Za-z0-9_]+)".*/\1/' | sort -u |
    awk '{ printf "int %s(void) { return 34; /* CUDA_ERROR_STUB_LIBRARY */ }\n", $1 }' >"$ROOT/lib/stubs/libcuda-stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/libcuda-stub.c"
  # For running a cuda build where there is no driver at all (CI): put lib/stubs on
  # LD_LIBRARY_PATH there only. Never where a driver is: the stub would shadow it.
  ln -sf libcuda.so "$ROOT/lib/stubs/libcuda.so.1"
  touch "$STAMP"
fi

echo "cuda-toolchain: nvcc $("$ROOT/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), compute capability $CAP" >&2
cat <<EOF
export CUDA_HOME="$ROOT"
export CUDA_PATH="$ROOT"
export PATH="$ROOT/bin:\$PATH"
export NVCC_APPEND_FLAGS="-I$ROOT/include/cccl"
export CUDA_COMPUTE_CAP="$CAP"
export LIBRARY_PATH="$ROOT/lib:$ROOT/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$ROOT/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
