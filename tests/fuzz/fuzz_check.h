// FUZZ_CHECK(cond): an invariant the fuzz targets assert. A violation prints
// the condition and aborts, which libFuzzer (and the replay tests) report as a
// crash with the input that caused it.
#ifndef HSDP_TESTS_FUZZ_FUZZ_CHECK_H_
#define HSDP_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                               \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, \
                   __LINE__, #cond);                                   \
      std::abort();                                                    \
    }                                                                  \
  } while (false)

#endif  // HSDP_TESTS_FUZZ_FUZZ_CHECK_H_
