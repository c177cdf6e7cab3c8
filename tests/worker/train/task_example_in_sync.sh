#!/usr/bin/env bash
# The usage example in include/hsdp/task.h and the code tests/worker/train/task_example_test.cc
# compiles are the same lines: the comment cannot rot.
#   task_example_in_sync.sh SOURCE_DIR
set -euo pipefail
src="$1"
from_header=$(sed -n '/^\/\/   class BlockImpl/,/^\/\/ clang-format on/p' "$src/include/hsdp/task.h" |
  sed '$d' | sed -e 's|^//   ||' -e 's|^//$||')
from_test=$(sed -n '/^\/\/ BEGIN task.h example/,/^\/\/ END task.h example/p' \
  "$src/tests/worker/train/task_example_test.cc" | sed '1d;$d')
if [ -z "$from_header" ] || [ "$from_header" != "$from_test" ]; then
  echo "include/hsdp/task.h's example differs from tests/worker/train/task_example_test.cc:"
  diff <(echo "$from_header") <(echo "$from_test") || true
  exit 1
fi
echo "task.h example: $(echo "$from_header" | wc -l) lines, the same as the compiled test"
