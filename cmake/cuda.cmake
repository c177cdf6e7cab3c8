# GPU build switches, included from the top-level CMakeLists.txt.
#
# HSDP_WITH_NCCL (AUTO|ON|OFF): build `hsdp_nccl`, the NCCL Communicator backend (with the worker,
#   HSDP_BUILD_WORKER=ON). It needs only the CUDA runtime and NCCL — not a CUDA LibTorch — so AUTO
#   turns it on wherever CUDAToolkit and libnccl are found (our CPU build machines have both), and
#   its tests skip without a device.
# HSDP_WITH_CUDA (AUTO|ON|OFF): compile the engine's CUDA paths (streams, pinned offload). AUTO turns
#   it on when the LibTorch about to be used is a CUDA build. Code guarded by it sees the compile
#   definition HSDP_WITH_CUDA=1 (every target; absent otherwise).
#
# Air-gapped builds: with HSDP_DEPS_PREFIX set (dependencies unpacked with `dpkg -x`), the CUDA
# toolkit is looked for in <prefix>/usr/local/cuda and NCCL in the layout of NVIDIA's libnccl2 /
# libnccl-dev .debs (<prefix>/usr/lib/x86_64-linux-gnu, <prefix>/usr/include) before the system.

set(HSDP_WITH_NCCL AUTO CACHE STRING "Build the NCCL communicator: AUTO (when CUDA+NCCL found), ON, OFF")
set_property(CACHE HSDP_WITH_NCCL PROPERTY STRINGS AUTO ON OFF)
set(HSDP_WITH_CUDA AUTO CACHE STRING "Build the engine's CUDA paths: AUTO (when LibTorch has CUDA), ON, OFF")
set_property(CACHE HSDP_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)

# --- CUDA toolkit + NCCL --------------------------------------------------------------------------
set(_hsdp_nccl_lib_hints "")
set(_hsdp_nccl_inc_hints "")
if(HSDP_DEPS_PREFIX)
  if(NOT CUDAToolkit_ROOT AND EXISTS "${HSDP_DEPS_PREFIX}/usr/local/cuda/bin/nvcc")
    set(CUDAToolkit_ROOT "${HSDP_DEPS_PREFIX}/usr/local/cuda")
  endif()
  list(APPEND _hsdp_nccl_lib_hints "${HSDP_DEPS_PREFIX}/usr/lib/x86_64-linux-gnu"
       "${HSDP_DEPS_PREFIX}/usr/local/cuda/lib64")
  list(APPEND _hsdp_nccl_inc_hints "${HSDP_DEPS_PREFIX}/usr/include"
       "${HSDP_DEPS_PREFIX}/usr/local/cuda/include")
endif()

if(NOT HSDP_WITH_NCCL STREQUAL "OFF" OR NOT HSDP_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
endif()

set(HSDP_NCCL_ENABLED OFF)
if(NOT HSDP_WITH_NCCL STREQUAL "OFF")
  if(CUDAToolkit_FOUND)
    # NO_DEFAULT_PATH first so a prefix (or the toolkit's own copy) wins over a stray system NCCL.
    find_library(HSDP_NCCL_LIBRARY NAMES nccl
                 HINTS ${_hsdp_nccl_lib_hints} ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
    find_library(HSDP_NCCL_LIBRARY NAMES nccl)
    find_path(HSDP_NCCL_INCLUDE_DIR nccl.h
              HINTS ${_hsdp_nccl_inc_hints} ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
    find_path(HSDP_NCCL_INCLUDE_DIR nccl.h)
  endif()
  if(CUDAToolkit_FOUND AND HSDP_NCCL_LIBRARY AND HSDP_NCCL_INCLUDE_DIR)
    set(HSDP_NCCL_ENABLED ON)
    file(STRINGS "${HSDP_NCCL_INCLUDE_DIR}/nccl.h" _hsdp_nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE "[^0-9;]" "" _hsdp_nccl_ver "${_hsdp_nccl_ver}")
    string(REPLACE ";" "." _hsdp_nccl_ver "${_hsdp_nccl_ver}")
    message(STATUS "hsdp: NCCL ${_hsdp_nccl_ver} (${HSDP_NCCL_LIBRARY}), CUDA ${CUDAToolkit_VERSION}"
                   " (${CUDAToolkit_LIBRARY_DIR}): building hsdp_nccl")
    # ncclCommInitRankConfig/ncclAvg/ncclBfloat16 need NCCL >= 2.14 (non-blocking config).
    if(_hsdp_nccl_ver VERSION_LESS 2.14)
      message(FATAL_ERROR "hsdp: NCCL ${_hsdp_nccl_ver} is too old; need >= 2.14")
    endif()
  elseif(HSDP_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "hsdp: HSDP_WITH_NCCL=ON but CUDAToolkit (found: ${CUDAToolkit_FOUND}) or "
                        "NCCL (lib: ${HSDP_NCCL_LIBRARY}, header: ${HSDP_NCCL_INCLUDE_DIR}) is missing")
  else()
    message(STATUS "hsdp: CUDA toolkit or NCCL not found: hsdp_nccl not built")
  endif()
endif()

# The hsdp_nccl target itself is defined next to its sources, in worker/comm/nccl/nccl.cmake (it
# links hsdp_comm for the shared Communicator/DeviceMesh pieces); it reads HSDP_NCCL_ENABLED,
# HSDP_NCCL_LIBRARY and HSDP_NCCL_INCLUDE_DIR from here.

# --- CUDA LibTorch detection ----------------------------------------------------------------------
# Detected from the files of the LibTorch that find_package(Torch) will pick, without calling
# find_package here: a CUDA Torch config creates imported CUDA targets without `if(NOT TARGET)`
# guards in some versions, and worker/ calls find_package(Torch) again in a child directory.
# A CUDA build ships libtorch_cuda and declares the `torch_cuda` target in Caffe2Targets.cmake.
set(HSDP_CUDA_ENABLED OFF)
if(HSDP_BUILD_WORKER AND NOT HSDP_WITH_CUDA STREQUAL "OFF")
  if(Torch_DIR)
    set(_hsdp_torch_dirs "${Torch_DIR}")
  else()
    set(_hsdp_torch_dirs "")
  endif()
  unset(HSDP_TORCH_CONFIG CACHE)  # re-resolve: CMAKE_PREFIX_PATH may point elsewhere now
  find_file(HSDP_TORCH_CONFIG TorchConfig.cmake
            HINTS ${_hsdp_torch_dirs}
            PATHS ${CMAKE_PREFIX_PATH}
            PATH_SUFFIXES Torch share/cmake/Torch lib/cmake/Torch lib/x86_64-linux-gnu/cmake/Torch
                          cmake/Torch)
  set(_hsdp_torch_has_cuda OFF)
  if(HSDP_TORCH_CONFIG)
    get_filename_component(_hsdp_torch_cmake_dir "${HSDP_TORCH_CONFIG}" DIRECTORY)
    set(_hsdp_caffe2_targets "${_hsdp_torch_cmake_dir}/../Caffe2/Caffe2Targets.cmake")
    if(EXISTS "${_hsdp_caffe2_targets}")
      file(STRINGS "${_hsdp_caffe2_targets}" _hsdp_cuda_line REGEX "add_library\\(torch_cuda ")
      if(_hsdp_cuda_line)
        set(_hsdp_torch_has_cuda ON)
      endif()
    endif()
  endif()
  if(_hsdp_torch_has_cuda AND CUDAToolkit_FOUND AND HSDP_NCCL_ENABLED)
    set(HSDP_CUDA_ENABLED ON)
  elseif(HSDP_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "hsdp: HSDP_WITH_CUDA=ON but the LibTorch found (${HSDP_TORCH_CONFIG}) has no "
                        "torch_cuda target, or the CUDA toolkit (found: ${CUDAToolkit_FOUND}) or NCCL "
                        "(enabled: ${HSDP_NCCL_ENABLED}) is missing. "
                        "Point CMAKE_PREFIX_PATH at a CUDA build, e.g. "
                        "$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')")
  endif()
  message(STATUS "hsdp: LibTorch ${HSDP_TORCH_CONFIG} CUDA=${_hsdp_torch_has_cuda}: "
                 "HSDP_WITH_CUDA resolves to ${HSDP_CUDA_ENABLED}")
endif()
if(HSDP_CUDA_ENABLED)
  add_compile_definitions(HSDP_WITH_CUDA=1)
endif()
