#!/usr/bin/env bash
# Sets up everything, builds, and runs the whole test suite.
#   deploy/test.sh                 # all tests
#   HSDP_CTEST_ARGS="-LE slow" deploy/test.sh   # the fast set only
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD_DIR="${HSDP_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja
cmake --build "$BUILD_DIR" -j "$(nproc)"
# shellcheck disable=SC2086
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" ${HSDP_CTEST_ARGS:-}
