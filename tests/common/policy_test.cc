#include "common/policy.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "google/protobuf/util/message_differencer.h"

namespace hsdp {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using hsdp::v1::Policy;

UnitList Units(int layers) {
  UnitList units;
  hsdp::v1::UnitInfo root;
  root.set_name("root");
  units.push_back(root);
  for (int i = 0; i < layers; ++i) {
    hsdp::v1::UnitInfo unit;
    unit.set_name("layers." + std::to_string(i));
    units.push_back(unit);
  }
  return units;
}

TEST(PolicyParseTest, ParsesTextFormat) {
  absl::StatusOr<Policy> p = ParsePolicy(R"(
    reshard_after_forward: false
    forward_prefetch_depth: 2
    microbatches: 4
    grad_sync: GRAD_SYNC_MODE_EVERY_MICROBATCH
    overrides { unit_glob: "layers.*" reshard_after_forward: true }
  )");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->has_reshard_after_forward());
  EXPECT_FALSE(p->reshard_after_forward());
  EXPECT_EQ(p->forward_prefetch_depth(), 2);
  EXPECT_EQ(p->microbatches(), 4);
  EXPECT_EQ(p->grad_sync(), hsdp::v1::GRAD_SYNC_MODE_EVERY_MICROBATCH);
  ASSERT_EQ(p->overrides_size(), 1);
  EXPECT_EQ(p->overrides(0).unit_glob(), "layers.*");
}

TEST(PolicyParseTest, ParsesJsonBothNameStyles) {
  absl::StatusOr<Policy> p = ParsePolicy(
      R"({"reshardAfterForward": false, "backward_prefetch_depth": 3,
          "allReduce": "ALL_REDUCE_MODE_EVERY_MICROBATCH", "memoryBudgetBytes": "1000"})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->reshard_after_forward());
  EXPECT_EQ(p->backward_prefetch_depth(), 3);
  EXPECT_EQ(p->all_reduce(), hsdp::v1::ALL_REDUCE_MODE_EVERY_MICROBATCH);
  EXPECT_EQ(p->memory_budget_bytes(), 1000);
}

TEST(PolicyParseTest, EmptyTextIsEmptyPolicy) {
  absl::StatusOr<Policy> p = ParsePolicy("  \n");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->ByteSizeLong(), 0u);
}

TEST(PolicyParseTest, UnknownTextFieldNamesFieldAndLine) {
  absl::StatusOr<Policy> p =
      ParsePolicy("microbatches: 2\nprefetch_depth: 3\n");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("line 2:"), std::string::npos)
      << p.status();
  EXPECT_NE(p.status().message().find("prefetch_depth"), std::string::npos)
      << p.status();
}

TEST(PolicyParseTest, UnknownJsonFieldNamesField) {
  absl::StatusOr<Policy> p =
      ParsePolicy(R"({"microbatches": 2, "bogusField": 1})");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("bogusField"), std::string::npos)
      << p.status();
}

// Found by policy_fuzz (tests/fuzz/crashes/policy_fuzz): the text format
// takes any bytes in a string, which the JSON printer did not write back as
// they were.
TEST(PolicyParseTest, InvalidUtf8InTextStringIsRefusedByField) {
  for (const char* text :
       {"overrides { unit_glob: \"a\" }\noverrides { unit_glob: \"x\\377y\" }",
        "overrides { unit_glob: \"\\355\\240\\200\" }",  // a surrogate
        "overrides { unit_glob: \"\\300\\257\" }",       // overlong '/'
        "overrides { unit_glob: \"\\342\\202\" }"}) {    // truncated
    absl::StatusOr<Policy> p = ParsePolicy(text);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(p.status().message().find("policy.overrides["), std::string::npos)
        << p.status();
    EXPECT_NE(p.status().message().find("].unit_glob: is not valid UTF-8"),
              std::string::npos)
        << p.status();
  }
  absl::StatusOr<Policy> ok = ParsePolicy(
      "overrides { unit_glob: \"caf\\303\\251.\\360\\237\\230\\200\" }");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->overrides(0).unit_glob(), "caf\xc3\xa9.\xf0\x9f\x98\x80");
}

TEST(PolicyParseTest, MalformedInputIsInvalidArgument) {
  for (const char* text :
       {"{", R"({"microbatches": "many"})", "microbatches: [",
        "microbatches: 1.5", "grad_sync: SOMETIMES",
        R"({"gradSync": "SOMETIMES"})", "overrides { unit_glob: }",
        "reshard_after_forward: maybe"}) {
    EXPECT_EQ(ParsePolicy(text).status().code(),
              absl::StatusCode::kInvalidArgument)
        << text;
  }
}

TEST(PolicyParseTest, ReadPolicyFile) {
  EXPECT_EQ(ReadPolicyFile("/nonexistent/policy.json").status().code(),
            absl::StatusCode::kNotFound);
  const std::string path = ::testing::TempDir() + "/policy_test_file.txtpb";
  {
    std::ofstream out(path);
    out << "checkpoint_interval: 5\n";
  }
  absl::StatusOr<Policy> p = ReadPolicyFile(path);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->checkpoint_interval(), 5);
  {
    std::ofstream out(path);
    out << "checkpoint_intervals: 5\n";
  }
  p = ReadPolicyFile(path);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message().rfind(path, 0), 0u) << p.status();
  std::remove(path.c_str());
}

TEST(PolicyValidateTest, EmptyPolicyIsValid) {
  EXPECT_TRUE(ValidatePolicy(Policy(), Units(2)).ok());
  EXPECT_TRUE(ValidatePolicy(Policy(), {}).ok());
}

struct BadCase {
  const char* text;
  const char* message;
};

// Every field's bad values, each INVALID_ARGUMENT with a message naming the
// field.
TEST(PolicyValidateTest, EveryFieldsBadValues) {
  const BadCase cases[] = {
      {"forward_prefetch_depth: -1",
       "policy.forward_prefetch_depth: -1 is negative"},
      {"forward_prefetch_depth: 17",
       "policy.forward_prefetch_depth: 17 exceeds the maximum 16"},
      {"backward_prefetch_depth: -3",
       "policy.backward_prefetch_depth: -3 is negative"},
      {"backward_prefetch_depth: 100",
       "policy.backward_prefetch_depth: 100 exceeds the maximum 16"},
      {"microbatches: -1", "policy.microbatches: -1 is negative"},
      {"microbatches: 1025",
       "policy.microbatches: 1025 exceeds the maximum 1024"},
      {"grad_sync: 7", "policy.grad_sync: unknown value 7"},
      {"all_reduce: 9", "policy.all_reduce: unknown value 9"},
      {"checkpoint_interval: -5", "policy.checkpoint_interval: -5 is negative"},
      {"memory_budget_bytes: -1", "policy.memory_budget_bytes: -1 is negative"},
      {"comm_fusion_bucket_bytes: -4096",
       "policy.comm_fusion_bucket_bytes: -4096 is negative"},
      {"overrides { reshard_after_forward: false }",
       "policy.overrides[0].unit_glob: is empty"},
      {"overrides { unit_glob: \"layers.*\" reshard_after_forward: false } "
       "overrides { unit_glob: \"blocks.*\" reshard_after_backward: false }",
       "policy.overrides[1].unit_glob: \"blocks.*\" matches no unit (units: "
       "root, "
       "layers.0, layers.1)"},
      {"overrides { unit_glob: \"layers.*\" }",
       "policy.overrides[0]: override \"layers.*\" sets neither "
       "reshard_after_forward "
       "nor reshard_after_backward"},
  };
  for (const BadCase& c : cases) {
    absl::StatusOr<Policy> p = ParsePolicy(c.text);
    ASSERT_TRUE(p.ok()) << c.text << ": " << p.status();
    absl::Status s = ValidatePolicy(*p, Units(2));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_EQ(s.message(), c.message) << c.text;
  }
}

TEST(PolicyValidateTest, BoundaryValuesAreValid) {
  for (const char* text :
       {"forward_prefetch_depth: 0", "forward_prefetch_depth: 16",
        "backward_prefetch_depth: 0", "backward_prefetch_depth: 16",
        "microbatches: 0", "microbatches: 1024", "checkpoint_interval: 0",
        "memory_budget_bytes: 0", "comm_fusion_bucket_bytes: 0",
        "comm_fusion_bucket_bytes: 1099511627776",
        "grad_sync: GRAD_SYNC_MODE_UNSPECIFIED",
        "all_reduce: ALL_REDUCE_MODE_EVERY_MICROBATCH",
        "overrides { unit_glob: \"root\" reshard_after_backward: false }",
        "overrides { unit_glob: \"*\" reshard_after_forward: true }"}) {
    absl::StatusOr<Policy> p = ParsePolicy(text);
    ASSERT_TRUE(p.ok()) << text;
    EXPECT_TRUE(ValidatePolicy(*p, Units(2)).ok()) << text;
  }
}

TEST(PolicyValidateTest, GlobMatchingSkippedWithoutUnits) {
  absl::StatusOr<Policy> p = ParsePolicy(
      "overrides { unit_glob: \"nothing.*\" reshard_after_forward: false }");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(ValidatePolicy(*p, {}).ok());
  EXPECT_EQ(ValidatePolicy(*p, Units(1)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PolicyDefaultsTest, ResolvesDefaults) {
  const Policy r = ResolvePolicyDefaults(Policy());
  EXPECT_TRUE(r.reshard_after_forward());
  EXPECT_TRUE(r.reshard_after_backward());
  EXPECT_EQ(r.forward_prefetch_depth(), 1);
  EXPECT_EQ(r.backward_prefetch_depth(), 1);
  EXPECT_EQ(r.microbatches(), 1);
  EXPECT_EQ(r.grad_sync(), hsdp::v1::GRAD_SYNC_MODE_LAST_MICROBATCH);
  EXPECT_EQ(r.all_reduce(), hsdp::v1::ALL_REDUCE_MODE_LAST_MICROBATCH);

  Policy explicit_policy;
  explicit_policy.set_reshard_after_forward(false);
  explicit_policy.set_forward_prefetch_depth(0);
  explicit_policy.set_microbatches(3);
  const Policy r2 = ResolvePolicyDefaults(explicit_policy);
  EXPECT_FALSE(r2.reshard_after_forward());
  EXPECT_EQ(r2.forward_prefetch_depth(), 0);
  EXPECT_EQ(r2.microbatches(), 3);
}

TEST(PolicyDefaultsTest, LaterOverridesWin) {
  absl::StatusOr<Policy> p = ParsePolicy(R"(
    reshard_after_backward: false
    overrides { unit_glob: "layers.*" reshard_after_forward: false }
    overrides { unit_glob: "layers.1?" reshard_after_forward: true }
    overrides { unit_glob: "root" reshard_after_backward: true }
  )");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(ResolveUnitReshard(*p, "root").after_forward);
  EXPECT_FALSE(ResolveUnitReshard(*p, "root").forward_pinned);
  EXPECT_TRUE(ResolveUnitReshard(*p, "root").after_backward);
  EXPECT_FALSE(ResolveUnitReshard(*p, "layers.3").after_forward);
  EXPECT_TRUE(ResolveUnitReshard(*p, "layers.3").forward_pinned);
  EXPECT_FALSE(ResolveUnitReshard(*p, "layers.3").after_backward);
  EXPECT_TRUE(ResolveUnitReshard(*p, "layers.12").after_forward);
  EXPECT_FALSE(ResolveUnitReshard(*p, "layers.1").after_forward);
}

TEST(GlobTest, Matches) {
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("*", "layers.3"));
  EXPECT_TRUE(GlobMatch("layers.*", "layers.10"));
  EXPECT_FALSE(GlobMatch("layers.*", "root"));
  EXPECT_TRUE(GlobMatch("layers.?", "layers.3"));
  EXPECT_FALSE(GlobMatch("layers.?", "layers.30"));
  EXPECT_TRUE(GlobMatch("*.3", "layers.3"));
  EXPECT_TRUE(GlobMatch("l*s.*3", "layers.13"));
  EXPECT_FALSE(GlobMatch("l*s.*3", "layers.14"));
  EXPECT_TRUE(GlobMatch("root", "root"));
  EXPECT_FALSE(GlobMatch("root", "root2"));
  EXPECT_FALSE(GlobMatch("root?", "root"));
  EXPECT_TRUE(GlobMatch("**a**", "bab"));
  EXPECT_FALSE(GlobMatch("", "a"));
}

TEST(PolicyPrintTest, TextAndJsonRoundTrip) {
  absl::StatusOr<Policy> p = ParsePolicy(R"(
    reshard_after_forward: false
    forward_prefetch_depth: 0
    microbatches: 4
    all_reduce: ALL_REDUCE_MODE_EVERY_MICROBATCH
    checkpoint_interval: 10
    memory_budget_bytes: 123456789012
    comm_fusion_bucket_bytes: 1048576
    overrides { unit_glob: "layers.1" reshard_after_backward: false }
  )");
  ASSERT_TRUE(p.ok());
  absl::StatusOr<Policy> from_text = ParsePolicy(PolicyToText(*p));
  ASSERT_TRUE(from_text.ok()) << from_text.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*from_text, *p));
  const std::string json = PolicyToJson(*p);
  EXPECT_NE(json.find("\"forward_prefetch_depth\": 0"), std::string::npos)
      << json;
  absl::StatusOr<Policy> from_json = ParsePolicy(json);
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*from_json, *p));
  // Optional fields set to their zero value survive (presence is meaningful).
  EXPECT_TRUE(from_json->has_forward_prefetch_depth());
  EXPECT_FALSE(from_json->has_backward_prefetch_depth());
}

TEST(PolicyPrintTest, DescribeMarksDefaults) {
  absl::StatusOr<Policy> p = ParsePolicy(
      "forward_prefetch_depth: 2\n"
      "overrides { unit_glob: \"layers.*\" reshard_after_forward: false }");
  ASSERT_TRUE(p.ok());
  const std::string text = DescribePolicy(*p);
  EXPECT_NE(text.find("reshard_after_forward:   true (default)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("forward_prefetch_depth:  2\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("override layers.*: reshard_after_forward=false"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("checkpoint_interval:     never (default)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("comm_fusion_bucket_bytes: off (default)"),
            std::string::npos)
      << text;
  p->set_comm_fusion_bucket_bytes(1 << 20);
  EXPECT_NE(DescribePolicy(*p).find("comm_fusion_bucket_bytes: 1048576\n"),
            std::string::npos)
      << DescribePolicy(*p);
}

}  // namespace
}  // namespace hsdp
