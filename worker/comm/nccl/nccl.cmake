# The NCCL backend (GPU path). Included by worker/comm/CMakeLists.txt; the switches and the CUDA/NCCL
# discovery live in cmake/cuda.cmake. Compiles and links wherever CUDAToolkit + NCCL are found,
# GPU or not: it needs neither a device nor a CUDA build of LibTorch. The tests compile the same
# SOURCES again against a fake runtime (tests/worker/comm/nccl/nccl.cmake).
if(HSDP_NCCL_ENABLED)
  add_library(hsdp_nccl
    ${CMAKE_CURRENT_LIST_DIR}/nccl_comm_state.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator.cc
    ${CMAKE_CURRENT_LIST_DIR}/nccl_errors.cc
  )
  target_include_directories(hsdp_nccl PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_include_directories(hsdp_nccl SYSTEM PUBLIC ${HSDP_NCCL_INCLUDE_DIR})
  target_link_libraries(hsdp_nccl
    PUBLIC
      hsdp_comm
      CUDA::cudart
      ${HSDP_NCCL_LIBRARY}
      absl::status
      absl::statusor
      absl::time
    PRIVATE
      absl::strings
      absl::synchronization
      Threads::Threads
  )
  target_compile_definitions(hsdp_nccl PUBLIC HSDP_WITH_NCCL=1)
endif()
