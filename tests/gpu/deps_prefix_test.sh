#!/usr/bin/env bash
# Offline check of the HSDP_DEPS_PREFIX wiring (top-level CMakeLists.txt + cmake/cuda.cmake).
# Lays out a prefix the way `dpkg -x` of NVIDIA's libnccl2/libnccl-dev .debs and a CUDA toolkit
# would (usr/include/nccl.h, usr/lib/x86_64-linux-gnu/libnccl.so, usr/local/cuda), configures the
# project against it (worker and bench off: only the CMake logic is under test) and asserts NCCL
# and the toolkit were taken from the prefix rather than from the system's /usr/local/cuda.
# No network, no package manager. Usage: deps_prefix_test.sh SOURCE_DIR
set -euo pipefail
src="${1:?usage: deps_prefix_test.sh SOURCE_DIR}"
cuda="${CUDA_HOME:-/usr/local/cuda}"
if [[ ! -f "$cuda/include/nccl.h" ]]; then
  echo "SKIP: no CUDA toolkit with NCCL at $cuda"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
mkdir -p "$prefix/usr/include" "$prefix/usr/lib/x86_64-linux-gnu" "$prefix/usr/local"
cp "$cuda/include/nccl.h" "$prefix/usr/include/"
nccl_lib=$(find -L "$cuda/lib64" "$cuda/lib" -maxdepth 1 -name 'libnccl.so*' 2>/dev/null | head -1)
ln -s "$(readlink -f "$nccl_lib")" "$prefix/usr/lib/x86_64-linux-gnu/libnccl.so"
# The toolkit is linked, not copied (gigabytes); FindCUDAToolkit must still be pointed at it.
ln -s "$(readlink -f "$cuda")" "$prefix/usr/local/cuda"

if ! cmake -S "$src" -B "$work/build" -G Ninja -DHSDP_BUILD_WORKER=OFF -DHSDP_BUILD_BENCH=OFF \
    -DHSDP_DEPS_PREFIX="$prefix" >"$work/log" 2>&1; then
  cat "$work/log"
  echo "FAIL: configure with HSDP_DEPS_PREFIX=$prefix failed"
  exit 1
fi
cache_get() { sed -n "s|^$1:[A-Z]*=||p" "$work/build/CMakeCache.txt"; }
fail=0
expect_in_prefix() {
  local name=$1 value
  value=$(cache_get "$name")
  if [[ "$value" == "$prefix"/* ]]; then
    echo "ok: $name=$value"
  else
    echo "FAIL: $name='$value' is not under the prefix $prefix"
    fail=1
  fi
}
expect_in_prefix HSDP_NCCL_LIBRARY
expect_in_prefix HSDP_NCCL_INCLUDE_DIR
expect_in_prefix CUDAToolkit_NVCC_EXECUTABLE
expect_in_prefix CUDA_CUDART
grep -q "hsdp: NCCL .*($prefix/" "$work/log" || { echo "FAIL: configure did not report the prefix NCCL"; fail=1; }
# And without the prefix, the same checkout finds the system copy (the test can tell them apart).
cmake -S "$src" -B "$work/build-sys" -G Ninja -DHSDP_BUILD_WORKER=OFF -DHSDP_BUILD_BENCH=OFF >/dev/null
sys_nccl=$(sed -n 's|^HSDP_NCCL_LIBRARY:[A-Z]*=||p' "$work/build-sys/CMakeCache.txt")
if [[ "$sys_nccl" == "$prefix"/* || -z "$sys_nccl" ]]; then
  echo "FAIL: without HSDP_DEPS_PREFIX NCCL resolved to '$sys_nccl'"
  fail=1
fi
exit $fail
