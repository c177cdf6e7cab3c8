#!/usr/bin/env bash
# Checks cmake/cuda.cmake's HSDP_WITH_CUDA=AUTO detection offline: a probe project includes it
# against two fake LibTorch installs — one whose Caffe2Targets.cmake declares `torch_cuda` (a CUDA
# build, as in PyTorch's torch/share/cmake) and one that does not (Debian's CPU build) — and reads
# what it resolved to. Also: HSDP_WITH_CUDA=ON against the CPU one must fail with a clear message.
# Usage: torch_cuda_detect_test.sh SOURCE_DIR
set -euo pipefail
src="${1:?usage: torch_cuda_detect_test.sh SOURCE_DIR}"
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "SKIP: no CUDA toolkit (the detection also requires one)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fake_torch() {  # DIR WITH_CUDA
  mkdir -p "$1/share/cmake/Torch" "$1/share/cmake/Caffe2"
  echo 'message(FATAL_ERROR "the probe must not call find_package(Torch)")' \
    >"$1/share/cmake/Torch/TorchConfig.cmake"
  {
    echo 'add_library(torch_cpu SHARED IMPORTED)'
    [[ "$2" == 1 ]] && echo 'add_library(torch_cuda SHARED IMPORTED)'
    echo 'add_library(torch SHARED IMPORTED)'
  } >"$1/share/cmake/Caffe2/Caffe2Targets.cmake"
}
fake_torch "$work/torch-cuda" 1
fake_torch "$work/torch-cpu" 0

mkdir -p "$work/probe"
cat >"$work/probe/CMakeLists.txt" <<PROBE
cmake_minimum_required(VERSION 3.22)
project(probe LANGUAGES CXX)
set(HSDP_BUILD_WORKER ON)
include("$src/cmake/cuda.cmake")
file(WRITE "\${CMAKE_BINARY_DIR}/resolved" "\${HSDP_CUDA_ENABLED}")
PROBE

fail=0
resolve() {  # NAME TORCH_DIR [extra cmake args...]
  local name=$1 torch=$2; shift 2
  cmake -S "$work/probe" -B "$work/build-$name" -DCMAKE_PREFIX_PATH="$torch/share/cmake" "$@" \
    >"$work/$name.log" 2>&1
}
resolve cuda "$work/torch-cuda"
resolve cpu "$work/torch-cpu"
[[ "$(cat "$work/build-cuda/resolved")" == ON ]] && echo "ok: CUDA LibTorch -> ON" ||
  { echo "FAIL: CUDA LibTorch resolved to $(cat "$work/build-cuda/resolved")"; fail=1; }
[[ "$(cat "$work/build-cpu/resolved")" == OFF ]] && echo "ok: CPU LibTorch -> OFF" ||
  { echo "FAIL: CPU LibTorch resolved to $(cat "$work/build-cpu/resolved")"; fail=1; }
if resolve forced "$work/torch-cpu" -DHSDP_WITH_CUDA=ON; then
  echo "FAIL: HSDP_WITH_CUDA=ON against a CPU LibTorch configured"; fail=1
elif tr -s " \n" "  " <"$work/forced.log" | grep -q "has no torch_cuda target"; then
  echo "ok: HSDP_WITH_CUDA=ON against a CPU LibTorch is a clear configure error"
else
  echo "FAIL: unexpected error:"; cat "$work/forced.log"; fail=1
fi
exit $fail
