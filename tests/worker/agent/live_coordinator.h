// Helpers for agent tests against a real in-process coordinator on loopback:
// a one-rank job and the options of an agent with a one-unit model.
#ifndef HSDP_TESTS_WORKER_AGENT_LIVE_COORDINATOR_H_
#define HSDP_TESTS_WORKER_AGENT_LIVE_COORDINATOR_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "coordinator/server.h"
#include "worker/agent/agent.h"

namespace hsdp::agent::testing {

// A coordinator of a 1x1 job `job_id` listening on `listen`, persisting under
// `state_dir` when it is not empty; null (and a test failure) if it did not
// start.
inline std::unique_ptr<coordinator::CoordinatorServer> StartOneRankCoordinator(
    const std::string& job_id, const std::string& listen,
    const std::string& state_dir = "") {
  coordinator::JobConfig job;
  job.job_id = job_id;
  job.world_size = 1;
  job.mesh = MeshShape{1, 1};
  job.state_dir = state_dir;
  coordinator::ServerOptions options;
  options.listen = listen;
  options.sync_state = false;
  options.shutdown_deadline = absl::Seconds(1);
  auto server = coordinator::CoordinatorServer::Start(job, options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// An agent of job `job_id` at `address` with a one-unit model and short
// retry delays.
inline AgentOptions OneUnitAgentOptions(const std::string& address,
                                        const std::string& job_id) {
  AgentOptions o;
  o.coordinator = address;
  o.job_id = job_id;
  o.model = "gpt-test";
  hsdp::v1::UnitInfo root;
  root.set_name("root");
  root.set_param_count(100);
  root.set_param_bytes(400);
  o.units = {root};
  o.retry_budget = absl::Seconds(20);
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  return o;
}

}  // namespace hsdp::agent::testing

#endif  // HSDP_TESTS_WORKER_AGENT_LIVE_COORDINATOR_H_
