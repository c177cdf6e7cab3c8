#!/usr/bin/env bash
# Sanitizer, thread-safety and fuzz builds of hsdp, each in its own build directory.
#
#   tests/sanitize.sh CONFIG...     CONFIG: asan | tsan | thread-safety | fuzz | all
#
#   asan           GCC, ASan + UBSan (-fsanitize=address,undefined; any UBSan finding aborts),
#                  the whole tree but the benchmarks in build-asan, then the fast test set
#                  (ctest -LE slow). On a 2-core machine running other builds: build about
#                  22 minutes with some objects in ccache, 39.5 from cold; tests about 4.5
#                  minutes at -j2 (docs/testing.md, "Sanitizers"); .ci/run runs it after
#                  ./deploy/test.sh.
#   asan-coordinator
#                  the same over the torch-free half only (-DHSDP_BUILD_WORKER=OFF: coordinator,
#                  common, hsdpctl, fuzz replays) in build-asan-coordinator: a quicker check.
#   tsan           GCC, TSan, the whole tree but the benchmarks in build-tsan, then the
#                  coordinator (with its e2e tests of the real hsdp-coordinator and hsdpctl),
#                  agent, communicator, engine (multi-rank), checkpoint and model tests: labels
#                  coordinator|comm|fsdp|worker|tsan, not slow (about 3.5 minutes at -j2; cold
#                  build about 16 minutes on a 2-core machine running other builds). Abseil's
#                  Mutex is annotated for TSan by tests/tsan/absl_mutex_tsan.cc (tested by
#                  absl_mutex_tsan_test); protobuf's map fields keep the uninstrumented library's
#                  layout (tests/tsan/protobuf_map_field_abi.h); interceptor calls made by the
#                  uninstrumented libraries themselves are not checked
#                  (ignore_noninstrumented_modules=1); the rest of what is suppressed, and why,
#                  is in tests/tsan/suppressions.txt. Reports of every process, spawned ones
#                  included, go to build-tsan/tsan-reports/; any report fails the run.
#   thread-safety  clang, -Wthread-safety as errors over every target (build-thread-safety):
#                  checks the ABSL_GUARDED_BY / ABSL_*_LOCKS_REQUIRED annotations, and clang's
#                  -Wall -Wextra as errors. Compile only; every finding is listed (ninja -k 0).
#                  From cold: about 45 minutes on a 2-core machine running other builds (the
#                  LibTorch TUs dominate).
#   fuzz           clang, libFuzzer + ASan + UBSan, the fuzz targets of tests/fuzz (build-fuzz),
#                  each run for FUZZ_SECONDS (default 60) from its seed corpus: cold build about
#                  6.5 minutes on a 2-core machine, then FUZZ_SECONDS per target (4 targets). A
#                  crash input is kept in build-fuzz/artifacts/<target>/ and the run fails; fix it
#                  and copy the input into tests/fuzz/crashes/<target>/, where the fuzz_replay
#                  tests replay it.
#   all            all of the above, in that order.
#
# Environment: HSDP_SANITIZE_JOBS (build and test parallelism, default nproc), FUZZ_SECONDS,
# HSDP_SANITIZE_CTEST_ARGS (extra ctest arguments, e.g. "-R Kv").
# Each configuration prints how long its build and its tests took.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
jobs="${HSDP_SANITIZE_JOBS:-$(nproc)}"
fuzz_seconds="${FUZZ_SECONDS:-60}"

usage() {
  sed -n '2,/^set -euo pipefail/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
[ $# -ge 1 ] || usage

timed() {
  local what="$1"
  shift
  local start=$SECONDS rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "sanitize: $what took $((SECONDS - start)) s"
  else
    echo "sanitize: $what FAILED after $((SECONDS - start)) s"
  fi
  return "$rc"
}

configure() {
  local dir="$1"
  shift
  mkdir -p "$root/$dir"
  cmake -S "$root" -B "$root/$dir" -G Ninja "$@" >"$root/$dir/configure.log" 2>&1 || {
    cat "$root/$dir/configure.log"
    return 1
  }
}

# ASan + UBSan build in $1 (extra cmake arguments after it), then its fast test set.
asan_build_and_test() {
  local dir="$1"
  shift
  configure "$dir" -DCMAKE_CXX_COMPILER=g++ -DHSDP_SANITIZE=address,undefined "$@"
  timed "$dir build" cmake --build "$dir" -j "$jobs"
  # Leaks: checked (LeakSanitizer), with the few one-time allocations of the dependencies that
  # live until exit suppressed in tests/sanitize/lsan.supp. Stack use after return is checked too.
  # shellcheck disable=SC2086
  timed "$dir tests (ctest -LE slow)" env \
    ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1" \
    LSAN_OPTIONS="suppressions=$root/tests/sanitize/lsan.supp:print_suppressions=0" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/tests/sanitize/ubsan.supp" \
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE slow ${HSDP_SANITIZE_CTEST_ARGS:-}
}

# Benchmarks are not in the fast set: not built (as in tsan).
run_asan() { asan_build_and_test build-asan -DHSDP_BUILD_BENCH=OFF; }

# The torch-free half (coordinator, common, hsdpctl, the fuzz replays): about 11 minutes on 2
# cores.
run_asan_coordinator() {
  asan_build_and_test build-asan-coordinator -DHSDP_BUILD_WORKER=OFF -DHSDP_BUILD_BENCH=OFF
}

run_tsan() {
  configure build-tsan -DCMAKE_CXX_COMPILER=g++ -DHSDP_SANITIZE=thread -DHSDP_BUILD_BENCH=OFF
  timed "tsan build" cmake --build build-tsan -j "$jobs"
  # TSan's shadow memory needs the address layout it was built for: without ASLR it always gets
  # it (newer kernels randomise mmap bases more than GCC 12's TSan runtime allows).
  local norandom=()
  if command -v setarch >/dev/null; then norandom=(setarch "$(uname -m)" -R); fi
  # Every report goes to a file (log_path): those of the processes the tests spawn (the real
  # hsdp-coordinator and hsdpctl, the rank and peer processes) too, whose stderr a test may not
  # show. Any report fails the run, even one in a child whose test passed.
  local reports="$root/build-tsan/tsan-reports"
  rm -rf "$reports"
  mkdir -p "$reports"
  local rc=0
  # shellcheck disable=SC2086
  timed "tsan tests" env \
    TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:log_path=$reports/report:suppressions=$root/tests/tsan/suppressions.txt" \
    "${norandom[@]}" \
    ctest --test-dir build-tsan --output-on-failure -j "$jobs" \
    -L 'coordinator|comm|fsdp|worker|tsan' -LE 'slow' ${HSDP_SANITIZE_CTEST_ARGS:-} || rc=$?
  if compgen -G "$reports/report.*" >/dev/null; then
    cat "$reports"/report.*
    echo "sanitize: TSan reports above (files in $reports)"
    rc=1
  fi
  return "$rc"
}

run_thread_safety() {
  configure build-thread-safety -DCMAKE_CXX_COMPILER=clang++ -DHSDP_THREAD_SAFETY=ON
  # -k 0: every finding in one run, not only the first failing file's.
  timed "thread-safety build (clang -Wthread-safety -Werror)" \
    cmake --build build-thread-safety -j "$jobs" -- -k 0
}

run_fuzz() {
  configure build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DHSDP_BUILD_WORKER=OFF -DHSDP_BUILD_BENCH=OFF \
    -DHSDP_BUILD_FUZZ=ON -DHSDP_SANITIZE=address,undefined
  local targets=(policy_fuzz job_file_fuzz coordinator_service_fuzz checkpoint_metadata_fuzz)
  timed "fuzz build" cmake --build build-fuzz -j "$jobs" --target "${targets[@]}"
  local failed=0 t
  for t in "${targets[@]}"; do
    local work="$root/build-fuzz/corpus/$t" artifacts="$root/build-fuzz/artifacts/$t"
    mkdir -p "$work" "$artifacts"
    echo "sanitize: fuzzing $t for ${fuzz_seconds} s"
    # New inputs go to the work corpus (first directory); the seeds in the tree stay as they are.
    # -close_fd_mask=3: the targets' own stdout/stderr (usage errors, printed configs) is noise.
    if ASAN_OPTIONS="abort_on_error=1:detect_leaks=1" \
      UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
      "$root/build-fuzz/fuzz/$t" -max_total_time="$fuzz_seconds" -print_final_stats=1 \
      -close_fd_mask=3 -timeout=10 -rss_limit_mb=4096 -artifact_prefix="$artifacts/" \
      "$work" "$root/tests/fuzz/corpus/$t" >"$root/build-fuzz/$t.log" 2>&1; then
      local runs speed
      runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$root/build-fuzz/$t.log")
      speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$root/build-fuzz/$t.log")
      echo "sanitize: $t: ${runs:-?} runs, ${speed:-?} exec/s, no crash"
    else
      failed=1
      tail -40 "$root/build-fuzz/$t.log"
      echo "sanitize: $t FOUND A CRASH: input in $artifacts/ (log build-fuzz/$t.log);" \
        "fix it and add the input to tests/fuzz/crashes/$t/"
    fi
  done
  return "$failed"
}

configs=()
for c in "$@"; do
  case "$c" in
  asan | asan-coordinator | tsan | thread-safety | fuzz) configs+=("$c") ;;
  all) configs+=(asan tsan thread-safety fuzz) ;;
  -h | --help) usage ;;
  *)
    echo "sanitize: unknown configuration '$c'" >&2
    usage
    ;;
  esac
done
for c in "${configs[@]}"; do
  echo "sanitize: === $c ==="
  timed "$c (total)" "run_${c//-/_}"
done
