// Helpers shared by the coordinator-core unit tests.
#ifndef HSDP_TESTS_COORDINATOR_CORE_TEST_UTIL_H_
#define HSDP_TESTS_COORDINATOR_CORE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/policy.h"
#include "common/units.h"

namespace hsdp::coordinator::testing {

// "root" with `root_bytes`, then "layers.i" with layer_bytes[i]; param_count =
// bytes / 4.
inline UnitList MakeUnits(int64_t root_bytes,
                          const std::vector<int64_t>& layer_bytes) {
  UnitList units;
  auto add = [&](const std::string& name, int64_t bytes) {
    hsdp::v1::UnitInfo unit;
    unit.set_name(name);
    unit.set_param_count(bytes / 4);
    unit.set_param_bytes(bytes);
    units.push_back(unit);
  };
  add("root", root_bytes);
  for (size_t i = 0; i < layer_bytes.size(); ++i) {
    add("layers." + std::to_string(i), layer_bytes[i]);
  }
  return units;
}

// root + `layers` equal layers of 400 bytes.
inline UnitList MakeUnits(int layers) {
  return MakeUnits(1000, std::vector<int64_t>(layers, 400));
}

// Parses a test policy (text or JSON); a parse error fails the test and yields
// {}.
inline hsdp::v1::Policy P(const char* text) {
  absl::StatusOr<hsdp::v1::Policy> p = ParsePolicy(text);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : hsdp::v1::Policy();
}

// A fresh empty directory under the test temp dir, unique per test.
inline std::string FreshDir(const std::string& name) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      ("hsdp_core_" + std::string(info->test_suite_name()) + "_" +
       info->name() + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

}  // namespace hsdp::coordinator::testing

#endif  // HSDP_TESTS_COORDINATOR_CORE_TEST_UTIL_H_
