# Sanitizer builds, included from the top-level CMakeLists.txt. tests/sanitize.sh drives them, one
# build directory per configuration (build-asan, build-tsan, ...).
#
# HSDP_SANITIZE: a -fsanitize= list applied to every target, compile and link, e.g.
#   "address,undefined" (ASan + UBSan; any UBSan finding aborts the test) or "thread" (TSan).
# HSDP_BUILD_FUZZ (clang only): the libFuzzer targets under tests/fuzz.
#
# Dependencies (LibTorch, gRPC, Abseil, Gloo) are Debian's, built without sanitizers: ASan and UBSan
# check our code and what it passes to them; TSan needs the annotations tests/tsan/ adds to Abseil's
# Mutex, protobuf's map fields with the library's layout (tests/tsan/protobuf_map_field_abi.h) and
# the suppressions in tests/tsan/suppressions.txt (see tests/sanitize.sh).

set(HSDP_SANITIZE "" CACHE STRING "Sanitizers for every target (-fsanitize=LIST), e.g. address,undefined or thread")
option(HSDP_BUILD_FUZZ "Build the libFuzzer targets in tests/fuzz (clang)" OFF)

if(HSDP_SANITIZE)
  add_compile_options(-fsanitize=${HSDP_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${HSDP_SANITIZE})
  if(HSDP_SANITIZE MATCHES "undefined")
    # A UBSan finding fails the test instead of printing and going on.
    add_compile_options(-fno-sanitize-recover=undefined)
    add_link_options(-fno-sanitize-recover=undefined)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12's flow analysis is confused by the sanitizers' instrumentation: std::regex and
    # std::function in libstdc++'s headers report -Wmaybe-uninitialized (GCC bug 105593 and
    # relatives) only in these builds. Kept a warning, not an error; normal builds keep it as one.
    add_compile_options(-Wno-error=maybe-uninitialized)
  endif()
  message(STATUS "hsdp: sanitizers: ${HSDP_SANITIZE}")
endif()

if(HSDP_BUILD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "hsdp: HSDP_BUILD_FUZZ needs clang (-fsanitize=fuzzer); "
                        "configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  # Coverage feedback from the code under test, not only from the fuzz targets' own files.
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()

# TSan: Abseil's Mutex/CondVar made visible to TSan (tests/tsan/absl_mutex_tsan.cc), linked as an
# object into every executable so its definitions win over the shared library's.
if(HSDP_SANITIZE MATCHES "thread")
  # Protobuf's map fields with the layout Debian's (uninstrumented) libprotobuf has: see the header.
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:CXX>:SHELL:-include ${PROJECT_SOURCE_DIR}/tests/tsan/protobuf_map_field_abi.h>")
  add_library(hsdp_tsan_absl OBJECT "${PROJECT_SOURCE_DIR}/tests/tsan/absl_mutex_tsan.cc")
  target_link_libraries(hsdp_tsan_absl PRIVATE absl::synchronization)
  function(_hsdp_link_tsan_absl_in dir)
    get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(t IN LISTS targets)
      get_target_property(type ${t} TYPE)
      if(type STREQUAL "EXECUTABLE")
        target_link_libraries(${t} PRIVATE $<TARGET_OBJECTS:hsdp_tsan_absl> ${CMAKE_DL_LIBS})
      endif()
    endforeach()
    get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
    foreach(sub IN LISTS subdirs)
      _hsdp_link_tsan_absl_in("${sub}")
    endforeach()
  endfunction()
  function(hsdp_link_tsan_absl)
    _hsdp_link_tsan_absl_in("${CMAKE_SOURCE_DIR}")
  endfunction()
  cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL hsdp_link_tsan_absl)
endif()
