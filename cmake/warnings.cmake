# Compiler warnings for hsdp's own code, included from the top-level CMakeLists.txt.
#
# hsdp_warnings (INTERFACE) carries the flags. hsdp_apply_warnings() (deferred to the end of the
# top-level configure) links it PRIVATE into every library and executable defined under the source
# tree, so a target added later is covered without an edit here. Dependencies' headers stay out of
# it: imported targets (torch, gloo, gRPC, protobuf, Abseil, GTest) give SYSTEM include directories,
# and the generated protobuf/gRPC sources (hsdp_proto, hsdp_grpc) compile without the flags.
#
# HSDP_WERROR (default ON) turns the warnings into errors. A build on a newer compiler that warns
# about something new can go on with -DHSDP_WERROR=OFF.
#
# With clang, HSDP_THREAD_SAFETY (default ON) adds -Wthread-safety as an error: it checks the
# ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations (GCC ignores them).

option(HSDP_WERROR "Treat compiler warnings in hsdp's own code as errors" ON)
option(HSDP_THREAD_SAFETY "clang only: check Abseil lock annotations (-Wthread-safety) as errors" ON)

add_library(hsdp_warnings INTERFACE)
target_compile_options(hsdp_warnings INTERFACE
  -Wall
  -Wextra
  # A class with virtual functions deleted through a base pointer must have a virtual destructor.
  -Wnon-virtual-dtor
  # A derived method hiding (not overriding) a base overload is almost always a typo.
  -Woverloaded-virtual
  # printf-style format strings checked even when passed through.
  -Wformat=2
  # Variable-length arrays are not C++.
  -Wvla)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(hsdp_warnings INTERFACE
    # `if (a) .. else if (a)` and `x && x`-style slips.
    -Wduplicated-cond
    -Wlogical-op)
endif()
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  if(HSDP_THREAD_SAFETY)
    target_compile_options(hsdp_warnings INTERFACE -Wthread-safety -Werror=thread-safety)
  endif()
endif()
if(HSDP_WERROR)
  target_compile_options(hsdp_warnings INTERFACE -Werror)
endif()

# Targets compiled without the warning flags: generated protobuf/gRPC code, which is not ours to
# change.
set(HSDP_WARNINGS_EXEMPT hsdp_proto hsdp_grpc)

# Links hsdp_warnings into every compiled target defined in `dir` and below.
function(_hsdp_apply_warnings_in dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    if(NOT type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY|EXECUTABLE)$")
      continue()
    endif()
    if(t IN_LIST HSDP_WARNINGS_EXEMPT)
      continue()
    endif()
    # BUILD_INTERFACE: a static library's private links are part of its exported link interface
    # (cmake/install.cmake), and the flags are for our build only.
    target_link_libraries(${t} PRIVATE $<BUILD_INTERFACE:hsdp_warnings>)
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _hsdp_apply_warnings_in("${sub}")
  endforeach()
endfunction()

function(hsdp_apply_warnings)
  _hsdp_apply_warnings_in("${CMAKE_SOURCE_DIR}")
endfunction()
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL hsdp_apply_warnings)
