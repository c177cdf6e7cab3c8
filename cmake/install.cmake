# `cmake --install` rules, included at the end of the top-level CMakeLists.txt (after every target
# exists).
#
# Installs under CMAKE_INSTALL_PREFIX:
#   bin/      hsdp-coordinator, hsdp-worker, hsdpctl, hsdp-launch, hsdp-ckpt, hsdp-compare,
#             hsdp-relay (hsdp-launch finds the coordinator next to itself; --worker-binary
#             launches a user's worker instead)
#   include/  the public headers, include/hsdp/ of the source tree and nothing else
#   lib/      the static libraries, and lib/cmake/hsdp/ with hsdpConfig.cmake,
#             hsdpConfigVersion.cmake and hsdpTargets.cmake
#
# Exported targets (namespace hsdp::), also defined as ALIAS targets in-tree so the same
# CMakeLists (examples/) builds in-tree and against the installed package:
#   hsdp::worker  the public worker API and runner (hsdp/task.h, hsdp/runner.h, hsdp/worker_main.h)
#   hsdp::models  the built-in GPT tasks (hsdp/models/)
#   hsdp::fsdp    the sharding engine (hsdp/fully_shard.h)
#   hsdp::comm    communicators and the device mesh (hsdp/device_mesh.h)
#   hsdp::common, hsdp::proto, hsdp::grpc, hsdp::agent, hsdp::ckpt (and hsdp::nccl when built):
#                 what the above link; a user links hsdp::worker (or hsdp::fsdp for the bare engine).
# The libraries are static: a static library's private dependencies are part of its link
# interface, so each of them is exported too, and the config finds the external ones (Torch, gRPC,
# protobuf, Abseil, Gloo, CLI11, CUDA for hsdp::nccl) with find_dependency.

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(HSDP_PACKAGE_VERSION 0.1.0)
set(HSDP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/hsdp")

# target:export-name
set(_hsdp_exports
  hsdp_proto:proto
  hsdp_grpc:grpc
  hsdp_common:common)
if(HSDP_BUILD_WORKER)
  list(APPEND _hsdp_exports
    hsdp_comm:comm
    hsdp_fsdp:fsdp
    hsdp_agent:agent
    hsdp_ckpt:ckpt
    hsdp_train:worker
    hsdp_models:models)
  if(TARGET hsdp_nccl)
    list(APPEND _hsdp_exports hsdp_nccl:nccl)
  endif()
endif()

# Source-tree include directories only make sense in the build tree: wrap them in BUILD_INTERFACE
# and point installed consumers at include/.
function(_hsdp_export_includes target)
  get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
  set(out "")
  if(dirs)
    foreach(d IN LISTS dirs)
      if(d MATCHES "^\\$<" OR NOT IS_ABSOLUTE "${d}")
        list(APPEND out "${d}")
      elseif(d MATCHES "^${PROJECT_SOURCE_DIR}(/|$)" OR d MATCHES "^${PROJECT_BINARY_DIR}(/|$)")
        list(APPEND out "$<BUILD_INTERFACE:${d}>")
      else()
        list(APPEND out "${d}")  # a dependency's directory (NCCL's include dir)
      endif()
    endforeach()
  endif()
  list(APPEND out "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
  set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${out}")
endfunction()

set(_hsdp_export_targets "")
foreach(pair IN LISTS _hsdp_exports)
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 target)
  list(GET pair 1 name)
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  add_library(hsdp::${name} ALIAS ${target})
  _hsdp_export_includes(${target})
  list(APPEND _hsdp_export_targets ${target})
endforeach()

install(TARGETS ${_hsdp_export_targets}
  EXPORT hsdpTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(_hsdp_binaries hsdp-coordinator hsdpctl)
if(HSDP_BUILD_WORKER)
  list(APPEND _hsdp_binaries hsdp-worker hsdp-launch hsdp-ckpt hsdp-compare hsdp-relay)
endif()
# Shared libraries linked from outside the system's directories (e.g. NCCL under /usr/local/cuda)
# stay findable from the installed binaries.
set_target_properties(${_hsdp_binaries} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ${_hsdp_binaries} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# --- headers -------------------------------------------------------------------------------------
# Exactly the public tree, include/hsdp/: what a user includes, protobuf-free, with internals
# forward-declared. tests/install/install_test.sh checks that it is self-contained and pulls in no
# protobuf header.
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/hsdp"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.h")

# --- package config ------------------------------------------------------------------------------
# CLI11's target is imported in worker/train only (not visible here): ask hsdp_train whether it
# links it.
set(HSDP_CONFIG_NEEDS_CLI11 OFF)
if(TARGET hsdp_train)
  get_target_property(_hsdp_train_links hsdp_train LINK_LIBRARIES)
  if("CLI11::CLI11" IN_LIST _hsdp_train_links)
    set(HSDP_CONFIG_NEEDS_CLI11 ON)
  endif()
endif()
set(HSDP_CONFIG_NEEDS_CUDA OFF)
if(TARGET hsdp_nccl)
  set(HSDP_CONFIG_NEEDS_CUDA ON)
endif()
set(HSDP_CONFIG_HAS_WORKER ${HSDP_BUILD_WORKER})

install(EXPORT hsdpTargets
  NAMESPACE hsdp::
  DESTINATION "${HSDP_INSTALL_CMAKEDIR}")
configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/hsdpConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/hsdpConfig.cmake"
  INSTALL_DESTINATION "${HSDP_INSTALL_CMAKEDIR}"
  PATH_VARS CMAKE_INSTALL_BINDIR CMAKE_INSTALL_INCLUDEDIR)
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/hsdpConfigVersion.cmake"
  VERSION ${HSDP_PACKAGE_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  "${PROJECT_BINARY_DIR}/hsdpConfig.cmake"
  "${PROJECT_BINARY_DIR}/hsdpConfigVersion.cmake"
  DESTINATION "${HSDP_INSTALL_CMAKEDIR}")
