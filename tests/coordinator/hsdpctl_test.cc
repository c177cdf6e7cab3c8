// hsdpctl end to end: the real hsdpctl binary against a real hsdp-coordinator
// process.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/service_test_util.h"
#include "tests/coordinator/subprocess.h"

namespace hsdp::testing {
namespace {

constexpr char kJob[] = "job-ctl";
constexpr char kToken[] = "ctl-token";
constexpr int kLayers = 3;

class HsdpctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_file_ = dir_.Write("token", std::string(kToken) + "\n");
    coordinator_ = std::make_unique<CoordinatorProcess>(
        HSDP_COORDINATOR_BIN,
        std::vector<std::string>{"--job-id", kJob, "--world-size", "2",
                                 "--mesh", "1x2", "--control-token-file",
                                 token_file_});
    ASSERT_FALSE(coordinator_->address().empty())
        << coordinator_->process().err();
    worker_ =
        hsdp::v1::CoordinatorService::NewStub(Connect(coordinator_->address()));
  }

  // Runs hsdpctl with the coordinator address and token, then `args`.
  RunResult Ctl(std::vector<std::string> args, bool with_token = true) {
    std::vector<std::string> argv = {HSDPCTL_BIN, "--coordinator",
                                     coordinator_->address()};
    if (with_token) {
      argv.push_back("--token-file");
      argv.push_back(token_file_);
    }
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv);
  }

  // Two workers join; rank 0 fetches and both report steps [0, steps).
  void RunWorkers(int steps) {
    for (int r = 0; r < 2; ++r) {
      hsdp::v1::JoinResponse joined;
      ASSERT_TRUE(
          worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, r), &joined).ok());
    }
    for (int s = 0; s < steps; ++s) {
      hsdp::v1::GetScheduleRequest get;
      get.set_job_id(kJob);
      get.set_step(s);
      hsdp::v1::GetScheduleResponse schedule;
      ASSERT_TRUE(worker_->GetSchedule(Ctx().get(), get, &schedule).ok());
      for (int r = 0; r < 2; ++r) {
        hsdp::v1::ReportStepRequest report;
        report.set_job_id(kJob);
        report.mutable_report()->set_rank(r);
        report.mutable_report()->set_step(s);
        report.mutable_report()->set_loss(3.25);
        report.mutable_report()->set_step_seconds(0.5);
        report.mutable_report()->set_peak_memory_bytes(3 << 20);
        hsdp::v1::ReportStepResponse ignored;
        ASSERT_TRUE(worker_->ReportStep(Ctx().get(), report, &ignored).ok());
      }
    }
  }

  TempDir dir_;
  std::string token_file_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<hsdp::v1::CoordinatorService::Stub> worker_;
};

TEST_F(HsdpctlTest, StatusAndWorkersAsTablesAndJson) {
  RunWorkers(2);
  RunResult r = Ctl({"status"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("job              job-ctl"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("state            RUNNING"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("world            2 (mesh 1x2)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("sealed step      1"), std::string::npos) << r.out;
  // The two workers report hosts of their own (host-0, host-1), so the one
  // shard group spans hosts.
  EXPECT_NE(r.out.find("topology         shard group 0 spans hosts host-0, "
                       "host-1 (its all-gathers cross the host link)"),
            std::string::npos)
      << r.out;

  r = Ctl({"--json", "status"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"job_id\":\"job-ctl\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"state\":\"JOB_STATE_RUNNING\""), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\"unit_count\":4"), std::string::npos) << r.out;

  r = Ctl({"workers"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("WORKER  RANK  STATE  GEN  ROLE   HOST    DEVICE", 0),
            0u)
      << r.out;
  EXPECT_NE(r.out.find("2       1     ALIVE  0    train  host-1  cpu"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("joined@g0 member@g0:r1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3.2500"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3.0MiB"), std::string::npos) << r.out;

  // Global flags may follow the subcommand too.
  r = Ctl({"workers", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"hostname\":\"host-0\""), std::string::npos) << r.out;
}

TEST_F(HsdpctlTest, PolicySetFromFlagsAndFileAndRefusals) {
  RunWorkers(1);
  // The contract's example error, verbatim, and nothing changed.
  RunResult r = Ctl({"policy", "set", "--forward-prefetch", "-1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "hsdpctl: policy set: INVALID_ARGUMENT: "
            "policy.forward_prefetch_depth: -1 is "
            "negative\n");
  r = Ctl({"--json", "policy", "get"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"policy_version\":\"1\""), std::string::npos) << r.out;

  // Flags: an override on layers.* (the rest of the current policy kept).
  r = Ctl({"policy", "set", "--reshard-after-forward=false", "--units",
           "layers.*"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "policy version 2 applies from step 1\n");
  r = Ctl(
      {"policy", "set", "--backward-prefetch", "2", "--grad-sync", "every"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"policy", "get"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("policy version 3, effective from step 1"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("layers.*"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("backward_prefetch_depth: 2"), std::string::npos)
      << r.out;
  // Comm fusion: set, shown, and a negative bucket refused by name.
  r = Ctl({"policy", "set", "--comm-fusion-bucket", "-1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "hsdpctl: policy set: INVALID_ARGUMENT: "
            "policy.comm_fusion_bucket_bytes: -1 is negative\n");
  r = Ctl({"policy", "set", "--comm-fusion-bucket", "1048576"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"policy", "get"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("comm_fusion_bucket_bytes: 1048576"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("policy version 4"), std::string::npos) << r.out;
  // Hierarchical reshard: a bad boolean is refused naming the flag (nothing
  // sent), a good one set and shown.
  r = Ctl({"policy", "set", "--reshard-within-host", "maybe"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--reshard-within-host: 'maybe' is not a boolean"),
            std::string::npos)
      << r.err;
  r = Ctl({"policy", "set", "--reshard-within-host=true"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"policy", "get"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("reshard_after_forward_within_host: true"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("comm_fusion_bucket_bytes: 1048576"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("policy version 5"), std::string::npos) << r.out;

  // A file (text format) replaces the policy.
  const std::string file =
      dir_.Write("p.txt", "forward_prefetch_depth: 2\nmicrobatches: 4\n");
  r = Ctl({"--json", "policy", "set", "--file", file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"policy_version\":\"6\""), std::string::npos) << r.out;

  // Refusals change nothing: unknown field, glob matching no unit, malformed
  // file, bad bool.
  const std::string unknown =
      dir_.Write("u.json", R"({"forwardPrefetchDepth": 1, "nope": 2})");
  r = Ctl({"policy", "set", "--file", unknown});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: policy set: INVALID_ARGUMENT: ", 0), 0u)
      << r.err;
  EXPECT_NE(r.err.find("nope"), std::string::npos) << r.err;
  r = Ctl({"policy", "set", "--reshard-after-backward=false", "--units",
           "blocks.*"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: policy set: INVALID_ARGUMENT: ", 0), 0u)
      << r.err;
  const std::string malformed =
      dir_.Write("m.txt", "forward_prefetch_depth: {\n");
  r = Ctl({"policy", "set", "--file", malformed});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1)
      << "one line: " << r.err;
  r = Ctl({"policy", "set", "--reshard-after-forward=maybe"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("'maybe' is not a boolean"), std::string::npos) << r.err;
  r = Ctl({"--json", "policy", "get"});
  EXPECT_NE(r.out.find("\"policy_version\":\"6\""), std::string::npos) << r.out;
}

TEST_F(HsdpctlTest, ScheduleCheckpointAndDrain) {
  RunWorkers(1);
  RunResult r = Ctl({"schedule", "--step", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("step 0  policy version 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("UNIT  NAME      RESHARD_FWD"), std::string::npos)
      << r.out;
  // No comm fusion in the default policy: every unit alone.
  EXPECT_NE(r.out.find("BWD_PREFETCH  FUSION_GROUP\n"), std::string::npos)
      << r.out;
  // The planner's root rule and execution-order prefetch: the root stays
  // unsharded and prefetches the last block in backward; nobody prefetches
  // the root.
  EXPECT_NE(
      r.out.find("0     root      no           no           1             3"),
      std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find("1     layers.0  yes          yes          2             -"
                 "             -\n"),
      std::string::npos)
      << r.out;
  r = Ctl({"schedule", "--step", "7"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: schedule: NOT_FOUND: ", 0), 0u) << r.err;

  r = Ctl({"checkpoint"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "checkpoint scheduled after step 1\n");
  r = Ctl({"drain"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "draining: last step 1\n");
  r = Ctl({"status"});
  EXPECT_NE(r.out.find("DRAINING"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("drain step       1"), std::string::npos) << r.out;
}

TEST_F(HsdpctlTest, EvictShowsInWorkersAndStatus) {
  RunWorkers(1);
  RunResult r = Ctl({"evict", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            "worker 2 evicted: generation 0 ends at the next step boundary "
            "without it\n");
  r = Ctl({"workers"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("2       1     EVICTED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("member@g0:r1 evicted@g0"), std::string::npos) << r.out;
  // Again, or an unknown rank: the coordinator's refusal, exit code 1.
  r = Ctl({"evict", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: evict: FAILED_PRECONDITION: ", 0), 0u)
      << r.err;
  r = Ctl({"evict", "--worker-id", "99"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: evict: NOT_FOUND: ", 0), 0u) << r.err;
  r = Ctl({"evict"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("RANK or --worker-id"), std::string::npos) << r.err;
  r = Ctl({"status"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("replica groups   1 of 1 (min 1)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("committed step   none"), std::string::npos) << r.out;
  // The batch mode is a policy field.
  r = Ctl({"policy", "set", "--batch-mode", "shrink"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"policy", "get"});
  EXPECT_NE(r.out.find("BATCH_MODE_SHRINK"), std::string::npos) << r.out;
  r = Ctl({"policy", "set", "--batch-mode", "grow"});
  EXPECT_EQ(r.exit_code, 2);
}

TEST_F(HsdpctlTest, ErrorsAreOneLineWithExitCodes) {
  RunResult r = Ctl({"status"}, /*with_token=*/false);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: status: UNAUTHENTICATED: ", 0), 0u) << r.err;
  const std::string wrong = dir_.Write("wrong", "not-the-token\n");
  r = RunCommand({HSDPCTL_BIN, "--coordinator", coordinator_->address(),
                  "--token-file", wrong, "drain"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: drain: UNAUTHENTICATED: ", 0), 0u) << r.err;
  r = Ctl({"status"});
  EXPECT_EQ(r.out.find("DRAINING"), std::string::npos)
      << "a refused drain drained";

  r = Ctl({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err.rfind("hsdpctl: ", 0), 0u) << r.err;
  r = Ctl({"policy", "set", "--grad-sync", "sometimes"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--grad-sync"), std::string::npos) << r.err;
  r = Ctl({"schedule"});  // --step is required
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--step"), std::string::npos) << r.err;

  r = RunCommand({HSDPCTL_BIN, "--coordinator", "127.0.0.1:1", "--timeout", "2",
                  "status"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: status: UNAVAILABLE: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// TLS: a self-signed certificate for localhost; hsdpctl trusts it with
// --tls-ca, and a plaintext hsdpctl cannot talk to the TLS port.
TEST(HsdpctlTlsTest, TlsWithCaWorksAndPlaintextIsRefused) {
  TempDir dir;
  const std::string cert = dir.path() + "/cert.pem",
                    key = dir.path() + "/key.pem";
  RunResult gen =
      RunCommand({"/usr/bin/openssl", "req", "-x509", "-newkey", "rsa:2048",
                  "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext",
                  "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key,
                  "-out", cert});
  ASSERT_EQ(gen.exit_code, 0) << gen.err;
  CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                 {"--job-id", kJob, "--world-size", "1",
                                  "--tls-cert", cert, "--tls-key", key});
  ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
  const std::string port =
      coordinator.address().substr(coordinator.address().rfind(':') + 1);
  RunResult r = RunCommand({HSDPCTL_BIN, "--coordinator", "localhost:" + port,
                            "--tls-ca", cert, "status"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("job-ctl"), std::string::npos) << r.out;
  r = RunCommand({HSDPCTL_BIN, "--coordinator", "localhost:" + port,
                  "--timeout", "2", "status"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("hsdpctl: status: UNAVAILABLE: ", 0), 0u) << r.err;
}

}  // namespace
}  // namespace hsdp::testing
