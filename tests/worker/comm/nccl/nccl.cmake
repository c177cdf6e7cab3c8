# NCCL backend tests (GPU path). Included by tests/worker/comm/CMakeLists.txt, so the binaries sit in
# build/tests/worker/comm/. They build and link against the real CUDA runtime + NCCL wherever
# hsdp_nccl is built; device tests GTEST_SKIP() without a GPU. HSDP_TEST_DEVICE=cuda:N picks the
# device (default cuda:0), "cpu" skips them.
if(TARGET hsdp_nccl)
  hsdp_add_test(nccl_communicator_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator_test.cc
    LIBS hsdp_nccl absl::strings GTest::gmock
    LABELS comm
    TIMEOUT 120)
endif()

# The same tests against a host-memory fake of the CUDA runtime + NCCL (nccl_fake_runtime.cc), so
# the device tests (streams/events, non-blocking init, groups, watchdog abort, two ranks) also run
# on CPU-only machines. Compiles the backend's sources (hsdp_nccl's) again without libcudart/libnccl.
if(HSDP_NCCL_ENABLED AND TARGET hsdp_comm)
  get_target_property(_hsdp_nccl_sources hsdp_nccl SOURCES)
  add_library(hsdp_nccl_fake_runtime STATIC
    ${_hsdp_nccl_sources}
    ${CMAKE_CURRENT_LIST_DIR}/nccl_fake_runtime.cc)
  target_include_directories(hsdp_nccl_fake_runtime PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_include_directories(hsdp_nccl_fake_runtime SYSTEM PUBLIC ${HSDP_NCCL_INCLUDE_DIR}
                             ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(hsdp_nccl_fake_runtime PUBLIC hsdp_comm absl::status absl::statusor
                        absl::strings absl::synchronization absl::time Threads::Threads)
  target_compile_definitions(hsdp_nccl_fake_runtime PUBLIC HSDP_WITH_NCCL=1)
  add_executable(nccl_communicator_fake_test ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator_test.cc)
  target_link_libraries(nccl_communicator_fake_test PRIVATE hsdp_nccl_fake_runtime GTest::gmock
                        GTest::gtest GTest::gtest_main)
  gtest_discover_tests(nccl_communicator_fake_test DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT ${HSDP_TEST_DISCOVERY_TIMEOUT} TEST_PREFIX "fake_nccl."
    PROPERTIES LABELS comm TIMEOUT 120)
endif()
