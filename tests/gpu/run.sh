#!/usr/bin/env bash
# GPU check for the hsdp CUDA/NCCL path. Run on a machine with an NVIDIA GPU and a CUDA build of
# PyTorch in `python3`; budget: about 8 minutes of GPU time (build included, on 16 cores).
#
#   1. configures against the LibTorch inside that PyTorch (torch.utils.cmake_prefix_path) with
#      -DHSDP_WITH_CUDA=ON -DHSDP_WITH_NCCL=ON, linking the NCCL that PyTorch itself loads (one
#      libnccl.so.2 per process), and builds only what the check needs;
#   2. runs on cuda:0 at world size 1 (NCCL refuses two ranks on one GPU): the NCCL communicator
#      tests (all of them, plus the 2-rank ones where >= 2 GPUs exist) and the engine-on-CUDA tests
#      (parity against a single-process reference on the GPU, bf16, pinned-memory offload);
#   3. benchmarks a ~1B-parameter GPT (gpt-1b, bf16 params / fp32 reduce): our engine vs plain
#      unsharded LibTorch vs PyTorch FSDP2 (fully_shard, same shape and batch), step time, peak
#      memory, TFLOP/s, and ratios from this one run (bench/gpu/compare.py).
#
# Usage: tests/gpu/run.sh [--deps-dir DIR] [--skip-bench] [--skip-tests]
#   --deps-dir DIR  .deb files from tests/gpu/deps_bundle.sh, for a machine without the Debian -dev
#                   packages and without a package registry: unpacked with `dpkg -x` into
#                   $BUILD/deps and used as HSDP_DEPS_PREFIX.
# Environment: HSDP_GPU_BUILD_DIR (default build-gpu-check), HSDP_GPU_OUT (logs + JSON; default
#   $BUILD/gpu-check), HSDP_BENCH_MODEL (gpt-1b), HSDP_BENCH_BATCH (8), HSDP_BENCH_STEPS (10),
#   HSDP_BENCH_WARMUP (3), HSDP_TEST_DEVICE (cuda:0), JOBS (nproc).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${HSDP_GPU_BUILD_DIR:-$root/build-gpu-check}
out=${HSDP_GPU_OUT:-$build/gpu-check}
model=${HSDP_BENCH_MODEL:-gpt-1b}
batch=${HSDP_BENCH_BATCH:-8}
steps=${HSDP_BENCH_STEPS:-10}
warmup=${HSDP_BENCH_WARMUP:-3}
device=${HSDP_TEST_DEVICE:-cuda:0}
jobs=${JOBS:-$(nproc)}
deps_dir=""
run_bench=1
run_tests=1
while (($#)); do
  case "$1" in
    --deps-dir) deps_dir=$(cd "$2" && pwd); shift 2 ;;
    --skip-bench) run_bench=0; shift ;;
    --skip-tests) run_tests=0; shift ;;
    *) echo "run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
start_s=$SECONDS
log() { echo "[gpu-check +$((SECONDS - start_s))s] $*"; }
mkdir -p "$build" "$out"

# ---- 0. The machine -----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
fi
read -r torch_version torch_cuda torch_abi torch_prefix < <(python3 - <<'EOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("run.sh: python3's torch %s sees no CUDA device" % torch.__version__)
print(torch.__version__, torch.version.cuda, int(torch._C._GLIBCXX_USE_CXX11_ABI),
      torch.utils.cmake_prefix_path)
EOF
)
[[ -n "${torch_prefix:-}" ]] || { echo "run.sh: no usable CUDA PyTorch in python3" >&2; exit 1; }
log "PyTorch $torch_version (CUDA $torch_cuda), LibTorch at $torch_prefix"
if [[ "$torch_abi" != 1 ]]; then
  # Debian's absl/protobuf/gRPC/GoogleTest use the C++11 std::string ABI; a pre-cxx11-ABI LibTorch
  # (pip wheels before 2.7) would fail at link time with std::__cxx11 mismatches.
  echo "run.sh: this PyTorch's LibTorch uses the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0);" \
       "use PyTorch >= 2.7 or a cxx11-ABI LibTorch" >&2
  exit 1
fi

# NCCL: the copy PyTorch loads (pip's nvidia-nccl-cu*), so only one libnccl.so.2 is in the process.
nccl_args=()
nccl_dir=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
if [[ -n "$nccl_dir" && -f "$nccl_dir/include/nccl.h" ]]; then
  nccl_lib=$(ls "$nccl_dir"/lib/libnccl.so* | head -1)
  nccl_args=(-DHSDP_NCCL_LIBRARY="$nccl_lib" -DHSDP_NCCL_INCLUDE_DIR="$nccl_dir/include")
  log "NCCL from PyTorch's wheel: $nccl_lib"
fi

prefix_args=()
if [[ -n "$deps_dir" ]]; then
  prefix="$build/deps"
  if [[ ! -f "$prefix/.unpacked" ]]; then
    log "unpacking $(ls "$deps_dir"/*.deb | wc -l) .debs into $prefix"
    rm -rf "$prefix" && mkdir -p "$prefix"
    for f in "$deps_dir"/*.deb; do dpkg -x "$f" "$prefix"; done
    touch "$prefix/.unpacked"
  fi
  prefix_args=(-DHSDP_DEPS_PREFIX="$prefix")
  # protoc and grpc_cpp_plugin run during the build and need the prefix's shared libraries.
  export PATH="$prefix/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# ---- 1. Configure + build -----------------------------------------------------------------------
log "configure"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DHSDP_WITH_CUDA=ON -DHSDP_WITH_NCCL=ON \
  "${nccl_args[@]}" "${prefix_args[@]}" >"$out/configure.log" 2>&1 ||
  { tail -40 "$out/configure.log"; exit 1; }
grep -E '^-- hsdp:' "$out/configure.log" || true
targets=(nccl_communicator_test engine_cuda_test gpt_gpu_bench)
log "build ${targets[*]} (-j$jobs)"
ninja -C "$build" -j"$jobs" "${targets[@]}" >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
log "built"

# ---- 2. Tests on the GPU ------------------------------------------------------------------------
status=0
if ((run_tests)); then
  export HSDP_TEST_DEVICE="$device"
  for t in tests/worker/comm/nccl_communicator_test tests/gpu/engine_cuda_test; do
    log "$t on $device"
    "$build/$t" --gtest_brief=1 2>&1 | tee "$out/$(basename "$t").log" | tail -25 || status=1
  done
fi

# ---- 3. Benchmark -------------------------------------------------------------------------------
if ((run_bench)); then
  common=(--model "$model" --batch "$batch" --steps "$steps" --warmup "$warmup")
  for impl in engine plain; do
    log "bench: $impl ($model, batch $batch, bf16)"
    "$build/bench/gpu/gpt_gpu_bench" --impl "$impl" --device "$device" "${common[@]}" \
      --json-out "$out/bench_$impl.json" 2>&1 | tail -3 || status=1
  done
  log "bench: fsdp2 ($model, batch $batch, bf16)"
  python3 "$root/bench/gpu/fsdp2_gpt_bench.py" --device "$device" "${common[@]}" \
    --json-out "$out/bench_fsdp2.json" 2>&1 | tail -3 || status=1
  python3 "$root/bench/gpu/compare.py" "$out/bench_engine.json" "$out/bench_plain.json" \
    "$out/bench_fsdp2.json" | tee "$out/bench_summary.txt" || status=1
fi
log "done (status $status); logs and JSON in $out"
exit $status
