#!/usr/bin/env bash
# hsdp as an installed package, from a user's point of view:
#   1. `cmake --install` the build into a temporary prefix: the binaries, the libraries and the
#      public tree include/hsdp/ only, which is self-contained;
#   2. configure and build examples/resnet on its own, with find_package(hsdp) through
#      CMAKE_PREFIX_PATH (nothing of the source tree's build on its include or link path), and
#      every public header in one translation unit, whose include trace holds no protobuf header;
#   3. the installed hsdp-launch trains the resulting resnet-worker on a 2x2 mesh (--worker-binary);
#   4. the same binary's --reference run trains the same global batches in one process, and every
#      rank's loss of every step must match it within 1e-5;
#      hsdp-compare agrees (step 0 bitwise equal) and refuses a reference of other settings;
#   5. hsdp-launch refuses a bad --worker-binary in one line naming the flag.
#
# usage: install_test.sh SOURCE_DIR BUILD_DIR [CXX_COMPILER] [GENERATOR] [DEPS_PREFIX_PATH]
# Set HSDP_INSTALL_TEST_KEEP=1 to keep the scratch directory.
set -euo pipefail

src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
cxx=${3:-}
generator=${4:-Ninja}
deps_path=${5:-}

readonly steps=8
readonly tolerance=1e-5
# Small: four ranks on a shared 2-core machine.
readonly model_flags=(--seed 3 --optimizer sgd --lr 0.1 --task-option channels=8
                      --task-option blocks=3 --task-option image_size=6)
readonly worker_flags=(--microbatch-size 2 "${model_flags[@]}")

scratch=$(mktemp -d "${TMPDIR:-/tmp}/hsdp-install-test.XXXXXX")
cleanup() {
  if [[ "${HSDP_INSTALL_TEST_KEEP:-0}" == 1 || "${passed:-0}" != 1 ]]; then
    echo "install_test: scratch kept in $scratch" >&2
  else
    rm -rf "$scratch"
  fi
}
trap cleanup EXIT
fail() { echo "install_test: FAIL: $*" >&2; exit 1; }
t0=$(date +%s)

# --- 1. install -------------------------------------------------------------------------------
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" > "$scratch/install.log" \
  || { cat "$scratch/install.log" >&2; fail "cmake --install"; }
for f in bin/hsdp-coordinator bin/hsdp-worker bin/hsdpctl bin/hsdp-launch \
         lib/cmake/hsdp/hsdpConfig.cmake lib/cmake/hsdp/hsdpConfigVersion.cmake \
         lib/cmake/hsdp/hsdpTargets.cmake include/hsdp/task.h include/hsdp/unit.h \
         include/hsdp/runner.h include/hsdp/worker_main.h include/hsdp/fully_shard.h \
         include/hsdp/device_mesh.h; do
  [[ -e "$prefix/$f" ]] || fail "$f not installed"
done
# Only the public tree is installed, and it is self-contained: every "..." include it makes is
# another installed header (or Abseil's, which its API uses).
others=$(find "$prefix/include" -mindepth 1 -maxdepth 1 ! -name hsdp)
[[ -z "$others" ]] || fail "installed beside include/hsdp: $others"
! find "$prefix/include" -name '*.pb.h' | grep -q . || fail "a generated .pb.h header is installed"
grep -rhoE '^#include "[^"]+"' "$prefix/include" | sed -E 's/#include "(.*)"/\1/' | sort -u |
  while read -r inc; do
    case "$inc" in
      absl/*) continue ;;
    esac
    [[ -e "$prefix/include/$inc" ]] || fail "installed header includes $inc, which is not installed"
  done
echo "install_test: installed $(find "$prefix/include" -name '*.h' | wc -l) headers into $prefix" >&2

# --- 2. the example, out of tree --------------------------------------------------------------
example_build=$scratch/resnet-build
prefix_path="$prefix"
[[ -n "$deps_path" ]] && prefix_path="$prefix;$deps_path"
configure=(cmake -S "$src/examples/resnet" -B "$example_build" -G "$generator"
           "-DCMAKE_PREFIX_PATH=$prefix_path")
[[ -n "$cxx" ]] && configure+=("-DCMAKE_CXX_COMPILER=$cxx")
if command -v ccache > /dev/null; then
  # Paths relative to the scratch dir in the cache key: reruns hit.
  configure+=("-DCMAKE_CXX_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$scratch;CCACHE_NOHASHDIR=1;ccache")
fi
"${configure[@]}" > "$scratch/configure.log" 2>&1 \
  || { cat "$scratch/configure.log" >&2; fail "configuring examples/resnet against $prefix"; }
grep -q "hsdp_DIR:PATH=$prefix/lib/cmake/hsdp" "$example_build/CMakeCache.txt" \
  || fail "find_package(hsdp) did not pick the installed package: $(grep hsdp_DIR "$example_build/CMakeCache.txt")"
cmake --build "$example_build" > "$scratch/build.log" 2>&1 \
  || { tail -n 40 "$scratch/build.log" >&2; fail "building examples/resnet against $prefix"; }
worker=$example_build/bin/resnet-worker
[[ -x "$worker" ]] || fail "$worker was not built"
# Nothing from the source tree's build on the example's command lines.
if grep -F -- "$build" "$example_build/build.ninja" "$example_build/CMakeCache.txt" > /dev/null 2>&1; then
  fail "the out-of-tree build refers to the source tree's build directory $build"
fi
t_built=$(date +%s)

# Every public header in one translation unit, built against the installed package alone; the
# compiler's include trace (-H) holds no protobuf header.
headers_build=$scratch/public-headers-build
configure_headers=(cmake -S "$src/tests/install/public_headers" -B "$headers_build"
                   "${configure[@]:5}")
"${configure_headers[@]}" > "$scratch/headers-configure.log" 2>&1 \
  || { cat "$scratch/headers-configure.log" >&2; fail "configuring tests/install/public_headers"; }
cmake --build "$headers_build" > "$scratch/headers-build.log" 2>&1 \
  || { tail -n 40 "$scratch/headers-build.log" >&2; fail "the public headers do not compile alone"; }
opened=$(grep -cE '^\.+ ' "$scratch/headers-build.log" || true)
(( opened > 0 )) || fail "no include trace in $scratch/headers-build.log (is -H passed?)"
protobuf=$(grep -E '^\.+ .*(google/protobuf/|\.pb\.h)' "$scratch/headers-build.log" || true)
[[ -z "$protobuf" ]] \
  || fail "the public headers pull in protobuf: $(printf '%s\n' "$protobuf" | head -n 3)"

# --- 3. hsdp-launch on a 2x2 mesh -------------------------------------------------------------
run_dir=$scratch/run
"$prefix/bin/hsdp-launch" --workers 4 --mesh 2x2 --worker-binary "$worker" --steps "$steps" \
  --metrics-port -1 --run-dir "$run_dir" -- "${worker_flags[@]}" > "$scratch/launch.log" 2>&1 \
  || { tail -n 20 "$scratch/launch.log" >&2; fail "hsdp-launch --worker-binary $worker"; }
grep -q "worker $worker" "$scratch/launch.log" || fail "hsdp-launch did not run $worker"

# --- 4. the reference -------------------------------------------------------------------------
"$worker" --reference --world-size 4 --microbatches 1 --steps "$steps" \
  --report-file "$scratch/reference.jsonl" "${worker_flags[@]}" > "$scratch/reference.log" 2>&1 \
  || { cat "$scratch/reference.log" >&2; fail "resnet-worker --reference"; }
t_trained=$(date +%s)

losses() { grep -oE '"loss":[^,}]+' "$1" | cut -d: -f2; }
losses "$scratch/reference.jsonl" > "$scratch/reference.losses"
[[ $(wc -l < "$scratch/reference.losses") -eq $steps ]] \
  || fail "reference reported $(wc -l < "$scratch/reference.losses") steps, want $steps"
max_diff=0
for r in 0 1 2 3; do
  losses "$run_dir/worker-$r.jsonl" > "$scratch/rank-$r.losses"
  [[ $(wc -l < "$scratch/rank-$r.losses") -eq $steps ]] \
    || fail "rank $r reported $(wc -l < "$scratch/rank-$r.losses") steps, want $steps"
  max_diff=$(paste "$scratch/rank-$r.losses" "$scratch/reference.losses" | awk -v m="$max_diff" '
    { d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d } END { printf "%.3g", m }')
done
awk -v m="$max_diff" -v t="$tolerance" 'BEGIN { exit !(m <= t) }' \
  || { paste "$scratch"/rank-*.losses "$scratch/reference.losses" >&2
       fail "losses differ from the reference by $max_diff > $tolerance"; }
# It learns: the last reference loss is below the first.
awk 'NR == 1 { first = $1 } { last = $1 } END { exit !(last < first) }' "$scratch/reference.losses" \
  || fail "the reference loss did not go down: $(tr '\n' ' ' < "$scratch/reference.losses")"

# The installed hsdp-compare agrees, and sees step 0 bitwise equal on every rank; it refuses a
# reference of other settings, naming the setting.
"$prefix/bin/hsdp-compare" --tolerance "$tolerance" "$run_dir" "$scratch/reference.jsonl" \
  > "$scratch/compare.log" 2>&1 || { cat "$scratch/compare.log" >&2; fail "hsdp-compare"; }
grep -q "step 0 bitwise equal on every rank" "$scratch/compare.log" \
  || { cat "$scratch/compare.log" >&2; fail "hsdp-compare: step 0 not bitwise equal"; }
"$worker" --reference --world-size 4 --steps 1 --report-file "$scratch/reference-mb4.jsonl" \
  --microbatch-size 4 "${model_flags[@]}" > "$scratch/reference-mb4.log" 2>&1 \
  || { cat "$scratch/reference-mb4.log" >&2; fail "resnet-worker --reference --microbatch-size 4"; }
set +e
out=$("$prefix/bin/hsdp-compare" "$run_dir" "$scratch/reference-mb4.jsonl" 2>&1)
rc=$?
set -e
[[ $rc -eq 2 && "$out" == *"global_batch differs: the run has 8, the reference has 16"* ]] \
  || fail "hsdp-compare did not refuse a reference of another microbatch size (exit $rc): $out"
# And --reference without --world-size is refused (it would mirror one rank).
set +e
out=$("$worker" --reference --steps 1 "${worker_flags[@]}" 2>&1)
rc=$?
set -e
[[ $rc -eq 2 && "$out" == *"--reference needs --world-size"* ]] \
  || fail "--reference without --world-size: exit $rc: $out"

# --- 5. a bad --worker-binary -----------------------------------------------------------------
for bad in "$scratch/no-such-worker" "$scratch" "$scratch/install.log"; do
  set +e
  out=$("$prefix/bin/hsdp-launch" --workers 4 --mesh 2x2 --worker-binary "$bad" --steps 1 \
        --metrics-port -1 --run-dir "$scratch/bad-run" 2>&1)
  rc=$?
  set -e
  [[ $rc -ne 0 ]] || fail "hsdp-launch accepted --worker-binary $bad"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 && "$out" == *"--worker-binary $bad"* ]] \
    || fail "want one line naming --worker-binary $bad, got: $out"
done

passed=1
echo "install_test: PASS: $steps steps on 2x2, max |loss - reference| = $max_diff" \
     "(tolerance $tolerance); install+build $((t_built - t0)) s, train $((t_trained - t_built)) s," \
     "total $(( $(date +%s) - t0 )) s" >&2
