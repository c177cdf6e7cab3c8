// hsdpctl policy get and hsdpctl policy set.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "coordinator/ctl/command.h"

namespace hsdp::ctl {
namespace {

// Options of `policy set`. Optional fields stay unset unless the flag was
// given, so only the named fields change.
struct PolicySetOptions {
  std::string file;
  std::string units;
  std::string reshard_after_forward;
  std::string reshard_after_backward;
  std::optional<int> forward_prefetch;
  std::optional<int> backward_prefetch;
  std::optional<int> microbatches;
  std::string grad_sync;
  std::string all_reduce;
  std::optional<int> checkpoint_interval;
  std::optional<int64_t> memory_budget;
  std::string batch_mode;
  std::optional<int64_t> comm_fusion_bucket;
  std::string reshard_within_host;
};

absl::StatusOr<bool> ParseBool(const std::string& flag,
                               const std::string& value) {
  const std::string v = absl::AsciiStrToLower(value);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": '", value, "' is not a boolean"));
}

absl::Status PolicyGet(ControlClient& client, const GlobalOptions& g,
                       std::ostream& out) {
  return CallAndPrint(
      client, g, &ControlService::Stub::GetPolicy, hsdp::v1::GetPolicyRequest(),
      out, [&](const hsdp::v1::GetPolicyResponse& r) {
        out << "policy version " << r.policy_version()
            << ", effective from step " << r.effective_step() << "\n"
            << hsdp::DescribePolicy(r.policy());
      });
}

absl::Status ApplyPolicyFlags(const PolicySetOptions& o,
                              hsdp::v1::Policy* policy) {
  std::optional<bool> raf, rab;
  if (!o.reshard_after_forward.empty()) {
    HSDP_ASSIGN_OR_RETURN(
        raf, ParseBool("--reshard-after-forward", o.reshard_after_forward));
  }
  if (!o.reshard_after_backward.empty()) {
    HSDP_ASSIGN_OR_RETURN(
        rab, ParseBool("--reshard-after-backward", o.reshard_after_backward));
  }
  if (!o.units.empty()) {
    if (!raf && !rab) {
      return absl::InvalidArgumentError(
          "--units needs --reshard-after-forward and/or "
          "--reshard-after-backward");
    }
    hsdp::v1::UnitOverride* override_ = policy->add_overrides();
    override_->set_unit_glob(o.units);
    if (raf) override_->set_reshard_after_forward(*raf);
    if (rab) override_->set_reshard_after_backward(*rab);
  } else {
    if (raf) policy->set_reshard_after_forward(*raf);
    if (rab) policy->set_reshard_after_backward(*rab);
  }
  if (o.forward_prefetch)
    policy->set_forward_prefetch_depth(*o.forward_prefetch);
  if (o.backward_prefetch)
    policy->set_backward_prefetch_depth(*o.backward_prefetch);
  if (o.microbatches) policy->set_microbatches(*o.microbatches);
  if (o.checkpoint_interval)
    policy->set_checkpoint_interval(*o.checkpoint_interval);
  if (o.memory_budget) policy->set_memory_budget_bytes(*o.memory_budget);
  if (o.comm_fusion_bucket) {
    policy->set_comm_fusion_bucket_bytes(*o.comm_fusion_bucket);
  }
  if (!o.reshard_within_host.empty()) {
    HSDP_ASSIGN_OR_RETURN(const bool within, ParseBool("--reshard-within-host",
                                                       o.reshard_within_host));
    policy->set_reshard_after_forward_within_host(within);
  }
  // CLI11 already restricted both to "last" or "every".
  if (!o.grad_sync.empty()) {
    policy->set_grad_sync(o.grad_sync == "every"
                              ? hsdp::v1::GRAD_SYNC_MODE_EVERY_MICROBATCH
                              : hsdp::v1::GRAD_SYNC_MODE_LAST_MICROBATCH);
  }
  if (!o.all_reduce.empty()) {
    policy->set_all_reduce(o.all_reduce == "every"
                               ? hsdp::v1::ALL_REDUCE_MODE_EVERY_MICROBATCH
                               : hsdp::v1::ALL_REDUCE_MODE_LAST_MICROBATCH);
  }
  // CLI11 already restricted it to "fixed" or "shrink".
  if (!o.batch_mode.empty()) {
    policy->set_batch_mode(o.batch_mode == "shrink"
                               ? hsdp::v1::BATCH_MODE_SHRINK
                               : hsdp::v1::BATCH_MODE_FIXED);
  }
  return absl::OkStatus();
}

// The new policy is the file's (when --file is given) or else the coordinator's
// current one, with the flags applied on top: `policy set --forward-prefetch 2`
// changes just that field.
absl::Status PolicySet(ControlClient& client, const GlobalOptions& g,
                       const PolicySetOptions& o, std::ostream& out) {
  hsdp::v1::SetPolicyRequest request;
  if (!o.file.empty()) {
    HSDP_ASSIGN_OR_RETURN(*request.mutable_policy(),
                          hsdp::ReadPolicyFile(o.file));
  } else {
    hsdp::v1::GetPolicyResponse current;
    HSDP_RETURN_IF_ERROR(client.Call(&ControlService::Stub::GetPolicy,
                                     hsdp::v1::GetPolicyRequest(), &current));
    *request.mutable_policy() = current.policy();
  }
  HSDP_RETURN_IF_ERROR(ApplyPolicyFlags(o, request.mutable_policy()));
  return CallAndPrint(client, g, &ControlService::Stub::SetPolicy, request, out,
                      [&](const hsdp::v1::SetPolicyResponse& r) {
                        out << "policy version " << r.policy_version()
                            << " applies from step " << r.effective_step()
                            << "\n";
                      });
}

}  // namespace

void AddPolicyCommands(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* policy =
      app.add_subcommand("policy", "Get or set the sharding policy");
  policy->require_subcommand(1);
  CLI::App* policy_get =
      policy->add_subcommand("get", "Print the current policy");
  CLI::App* policy_set = policy->add_subcommand(
      "set",
      "Set the policy from a file and/or flags (flags apply on top of it)");
  auto ps = std::make_shared<PolicySetOptions>();
  policy_set->add_option("--file", ps->file,
                         "Policy file (JSON or text format)");
  policy_set->add_option("--units", ps->units,
                         "Glob: the reshard flags become an override");
  policy_set->add_option("--reshard-after-forward", ps->reshard_after_forward,
                         "BOOL");
  policy_set->add_option("--reshard-after-backward", ps->reshard_after_backward,
                         "BOOL");
  policy_set->add_option("--forward-prefetch", ps->forward_prefetch,
                         "Forward prefetch depth");
  policy_set->add_option("--backward-prefetch", ps->backward_prefetch,
                         "Backward prefetch depth");
  policy_set->add_option("--microbatches", ps->microbatches,
                         "Gradient-accumulation microbatches");
  policy_set->add_option("--grad-sync", ps->grad_sync, "last|every")
      ->check(CLI::IsMember({"last", "every"}));
  policy_set->add_option("--all-reduce", ps->all_reduce, "last|every")
      ->check(CLI::IsMember({"last", "every"}));
  policy_set->add_option("--checkpoint-interval", ps->checkpoint_interval,
                         "Steps (0: never)");
  policy_set->add_option("--memory-budget", ps->memory_budget,
                         "Bytes per rank (0: manual mode)");
  policy_set->add_option("--batch-mode", ps->batch_mode, "fixed|shrink")
      ->check(CLI::IsMember({"fixed", "shrink"}));
  policy_set->add_option(
      "--comm-fusion-bucket", ps->comm_fusion_bucket,
      "Bytes: consecutive units up to this size share their collectives "
      "(0: no fusion)");
  policy_set->add_option(
      "--reshard-within-host", ps->reshard_within_host,
      "true|false: where shard groups span hosts, keep each unit sharded "
      "over its host after forward, so backward gathers stay in the host");
  commands.push_back({policy_get, PolicyGet});
  commands.push_back(
      {policy_set,
       [ps](ControlClient& client, const GlobalOptions& g, std::ostream& out) {
         return PolicySet(client, g, *ps, out);
       }});
}

}  // namespace hsdp::ctl
