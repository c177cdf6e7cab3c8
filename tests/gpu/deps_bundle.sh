#!/usr/bin/env bash
# Collects the .deb files of the C++ build dependencies into OUTDIR, for a machine without a package
# registry (air-gapped GPU clusters, the project's GPU check machine). Run it where apt works
# (Debian 12); there: tests/gpu/run.sh --deps-dir OUTDIR unpacks them with `dpkg -x` into a prefix
# and configures with -DHSDP_DEPS_PREFIX=<prefix> (see worker/comm/README-gpu.md).
#
# Copies from the local apt cache first and `apt-get download`s the rest (--offline: cache only).
# The list is explicit (dev packages + the shared libraries they link), not a computed closure:
# base-system libraries (libc6, libstdc++6, zlib1g, libssl3) are assumed present on the target.
#
# Usage: tests/gpu/deps_bundle.sh [--offline] OUTDIR
set -euo pipefail

offline=0
if [[ "${1:-}" == "--offline" ]]; then offline=1; shift; fi
out="${1:?usage: deps_bundle.sh [--offline] OUTDIR}"
packages=(
  # build: headers, static libs, CMake configs, code generators
  libabsl-dev libgloo-dev libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler libgtest-dev libgmock-dev googletest libbenchmark-dev prometheus-cpp-dev
  libcivetweb-dev nlohmann-json3-dev libcli11-dev libc-ares-dev libre2-dev libssl-dev zlib1g-dev
  libgoogle-glog-dev libgflags-dev libunwind-dev  # worker/train includes <glog/logging.h>
  # the shared libraries those link
  libabsl20220623 libgloo0 libgrpc++1.51 libgrpc29 libprotobuf32 libprotoc32 libprotobuf-lite32
  libre2-9 libc-ares2 libbenchmark1debian libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0
  libprometheus-cpp-push1.0 libcivetweb1 libibverbs1 libnl-3-200 libnl-route-3-200
  libhiredis0.14
  libgoogle-glog0v6 libgflags2.2 libunwind8
)
cache="${HSDP_APT_CACHE:-/var/cache/apt/archives}"
mkdir -p "$out"
missing=()
for pkg in "${packages[@]}"; do
  found=$(ls "$cache/${pkg}_"*.deb 2>/dev/null | sort -V | tail -1 || true)
  if [[ -n "$found" ]]; then cp -n "$found" "$out/"; else missing+=("$pkg"); fi
done
if ((${#missing[@]})); then
  if ((offline)); then
    echo "deps_bundle: not in $cache (--offline): ${missing[*]}" >&2
    exit 1
  fi
  (cd "$out" && apt-get download "${missing[@]}")
fi
echo "deps_bundle: ${#packages[@]} packages in $out ($(du -sh "$out" | cut -f1))"
