# NCCL backend tests (GPU path). Included by tests/worker/comm/CMakeLists.txt. They build and link
# against the real CUDA runtime + NCCL wherever hsdp_nccl is built; device tests GTEST_SKIP()
# without a GPU. HSDP_TEST_DEVICE=cuda:N picks the device (default cuda:0), "cpu" skips them.
if(TARGET hsdp_nccl)
  hsdp_add_test(nccl_communicator_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator_test.cc
    LIBS hsdp_nccl absl::strings GTest::gmock
    LABELS comm gpu
    TIMEOUT 120)
endif()
