#!/usr/bin/env bash
# Installs every Debian package hsdp's build, tests, benchmarks and demo need.
# Idempotent: re-running it when everything is present is a quick no-op.
#   install-deps.sh               everything
#   install-deps.sh --build-only  only what `cmake --build` needs (the container images' build
#                                 stage): no PyTorch, linters, kubectl or Node
set -euo pipefail

build_only=0
[ "${1:-}" = "--build-only" ] && build_only=1

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-pthread libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus-cpp-dev nlohmann-json3-dev libcli11-dev libssl-dev
  python3
)
if ((!build_only)); then
  PACKAGES+=(
    clang-format
    python3-torch python3-grpcio
    yamllint iproute2 python3-yaml
    chromium
    # tests/sanitize.sh: GCC's ASan/UBSan/TSan runtimes; clang 14 with compiler-rt (its sanitizer
    # and libFuzzer runtimes) for the thread-safety and fuzz builds; openssl makes the TLS tests'
    # certificates.
    libasan8 libubsan1 libtsan2 clang clang-14 libclang-rt-14-dev openssl
  )
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

((build_only)) && exit 0

# kubectl renders the manifests offline (kubectl kustomize). Some machines carry an upstream
# kubectl package that conflicts with Debian's kubernetes-client; either one will do.
if ! command -v kubectl >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends kubernetes-client
fi

# Node.js (for buf lint and the manifest schema checks) may already be installed outside Debian's
# packages, and Debian's nodejs package conflicts with such an install, so only install it when no
# node is present at all.
if ! command -v npm >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi
