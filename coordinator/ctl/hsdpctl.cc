#include "coordinator/ctl/hsdpctl.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "coordinator/grpc_status.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace hsdp::ctl {
namespace {

using hsdp::v1::ControlService;

constexpr char kDefaultCoordinator[] = "localhost:50051";
constexpr double kDefaultTimeoutSeconds = 10.0;

// Global options shared by every subcommand.
struct GlobalOptions {
  std::string coordinator = kDefaultCoordinator;
  std::string token_file;
  std::string tls_ca;
  // Mutual TLS: this client's certificate chain and key (PEM files).
  std::string tls_client_cert;
  std::string tls_client_key;
  bool json = false;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

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
};

// Options of `evict`: exactly one target.
struct EvictOptions {
  std::optional<int> rank;
  std::optional<int64_t> worker_id;
};

absl::StatusOr<bool> ParseBool(const std::string& flag,
                               const std::string& value) {
  const std::string v = absl::AsciiStrToLower(value);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": '", value, "' is not a boolean"));
}

// Talks to one coordinator; every call carries the deadline and, when
// configured, the token.
class ControlClient {
 public:
  static absl::StatusOr<ControlClient> Connect(const GlobalOptions& options) {
    std::shared_ptr<grpc::ChannelCredentials> creds =
        grpc::InsecureChannelCredentials();
    if (!options.tls_ca.empty()) {
      grpc::SslCredentialsOptions ssl;
      HSDP_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_ca));
      if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
        return absl::InvalidArgumentError(
            "--tls-client-cert and --tls-client-key go together");
      }
      if (!options.tls_client_cert.empty()) {
        HSDP_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                              ReadFile(options.tls_client_cert));
        HSDP_ASSIGN_OR_RETURN(ssl.pem_private_key,
                              ReadFile(options.tls_client_key));
      }
      creds = grpc::SslCredentials(ssl);
    } else if (!options.tls_client_cert.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-cert needs --tls-ca (the coordinator's CA)");
    }
    std::string token;
    if (!options.token_file.empty()) {
      HSDP_ASSIGN_OR_RETURN(std::string contents, ReadFile(options.token_file));
      token = std::string(absl::StripAsciiWhitespace(contents));
    }
    return ControlClient(ControlService::NewStub(
                             grpc::CreateChannel(options.coordinator, creds)),
                         std::move(token), options.timeout_seconds);
  }

  // Calls one unary method: `client.Call(&ControlService::Stub::GetStatus,
  // request, &response)`.
  template <typename Method, typename Request, typename Response>
  absl::Status Call(Method method, const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(
                             static_cast<int64_t>(timeout_seconds_ * 1000)));
    if (!token_.empty())
      context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    return hsdp::coordinator::FromGrpcStatus(
        ((*stub_).*method)(&context, request, response));
  }

 private:
  ControlClient(std::unique_ptr<ControlService::Stub> stub, std::string token,
                double timeout)
      : stub_(std::move(stub)),
        token_(std::move(token)),
        timeout_seconds_(timeout) {}

  std::unique_ptr<ControlService::Stub> stub_;
  std::string token_;
  double timeout_seconds_;
};

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.always_print_enums_as_ints = false;
  std::string json;
  // Printing a well-formed message cannot fail.
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

// Calls `method` and prints its response: JSON with --json, else
// `print_human(response)`.
template <typename Request, typename Response, typename PrintHuman>
absl::Status CallAndPrint(ControlClient& client, const GlobalOptions& g,
                          grpc::Status (ControlService::Stub::*method)(
                              grpc::ClientContext*, const Request&, Response*),
                          const Request& request, std::ostream& out,
                          PrintHuman&& print_human) {
  Response response;
  HSDP_RETURN_IF_ERROR(client.Call(method, request, &response));
  if (g.json) {
    out << ToJson(response) << "\n";
  } else {
    print_human(response);
  }
  return absl::OkStatus();
}

// Strips an enum value's type prefix for tables: JOB_STATE_RUNNING -> RUNNING.
std::string ShortEnum(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

std::string StepOrNone(int64_t step) {
  return step < 0 ? "none" : std::to_string(step);
}

// Left-aligned columns separated by two spaces; a header row and one row per
// entry.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print(std::ostream& out) const {
    std::vector<size_t> widths;
    for (const auto& row : rows_) {
      widths.resize(std::max(widths.size(), row.size()));
      for (size_t i = 0; i < row.size(); ++i)
        widths[i] = std::max(widths[i], row[i].size());
    }
    for (const auto& row : rows_) {
      std::string line;
      for (size_t i = 0; i < row.size(); ++i) {
        line += row[i];
        if (i + 1 < row.size())
          line += std::string(widths[i] - row[i].size() + 2, ' ');
      }
      out << line << "\n";
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string FormatBytes(int64_t bytes) {
  constexpr double kMiB = 1024.0 * 1024.0;
  if (bytes <= 0) return "-";
  std::ostringstream s;
  s.precision(1);
  s << std::fixed << static_cast<double>(bytes) / kMiB << "MiB";
  return s.str();
}

std::string FormatDouble(double value, int precision) {
  std::ostringstream s;
  s.precision(precision);
  s << std::fixed << value;
  return s.str();
}

// The job's training settings as "FIELD VALUE" rows.
void AddTrainingRows(const hsdp::v1::TrainingSpec& spec, Table& t) {
  const hsdp::v1::OptimizerSpec& o = spec.optimizer();
  std::string optimizer =
      o.kind() == hsdp::v1::OPTIMIZER_KIND_SGD
          ? absl::StrCat("sgd lr=", o.lr(), " momentum=", o.momentum())
          : absl::StrCat("adamw lr=", o.lr(), " betas=", o.beta1(), ",",
                         o.beta2(), " eps=", o.eps());
  absl::StrAppend(&optimizer, " weight_decay=", o.weight_decay());
  const hsdp::v1::LrScheduleSpec& l = spec.lr_schedule();
  t.Add(
      {"task", absl::StrCat(spec.task(), " v", spec.task_version(),
                            spec.dims().empty() ? "" : " dims=", spec.dims())});
  t.Add({"seed", std::to_string(spec.seed())});
  t.Add({"steps", std::to_string(spec.steps())});
  t.Add({"microbatch size", std::to_string(spec.microbatch_size())});
  t.Add({"optimizer", optimizer});
  t.Add({"lr schedule",
         absl::StrCat(l.cosine() ? "cosine" : "constant",
                      " warmup=", l.warmup_steps(),
                      l.cosine() ? absl::StrCat(" min_lr=", l.min_lr()) : "")});
  t.Add({"precision",
         absl::StrCat("params ", spec.param_dtype(), ", reduce ",
                      spec.reduce_dtype().empty() ? spec.param_dtype()
                                                  : spec.reduce_dtype(),
                      ", accumulate ",
                      spec.grad_accumulation_dtype().empty()
                          ? spec.param_dtype()
                          : spec.grad_accumulation_dtype())});
  t.Add({"cpu offload", spec.cpu_offload() ? "on" : "off"});
  t.Add({"recompute",
         spec.recompute_units().empty() ? "-" : spec.recompute_units()});
  t.Add({"clip grad norm", spec.clip_grad_norm() > 0
                               ? FormatDouble(spec.clip_grad_norm(), 3)
                               : "-"});
}

// "REPORTED by worker 7 in generation 2: <detail>; detected 0.003s,
// re-formed 2.1s, recovered 1.4s".
std::string DescribeFailure(const hsdp::v1::GetStatusResponse& r) {
  const hsdp::v1::FailureRecord& f = r.last_failure();
  auto seconds = [](int64_t from_ms, int64_t to_ms) {
    return to_ms > 0
               ? FormatDouble(static_cast<double>(to_ms - from_ms) / 1e3, 3) +
                     "s"
               : std::string("-");
  };
  return absl::StrCat(
      ShortEnum(hsdp::v1::FailureCause_Name(f.cause()), "FAILURE_CAUSE_"),
      " by worker ", f.worker_id(), " in generation ", f.generation(), ": ",
      f.detail(), "; detected ", seconds(f.failed_unix_ms(), f.ended_unix_ms()),
      ", re-formed ", seconds(f.ended_unix_ms(), f.formed_unix_ms()),
      ", recovered ", seconds(f.formed_unix_ms(), f.recovered_unix_ms()));
}

// A worker's history in one cell: "joined@g0 member@g0:r3 lost@g1".
std::string DescribeHistory(const hsdp::v1::WorkerInfo& w) {
  std::vector<std::string> events;
  for (const auto& e : w.history()) {
    std::string event = absl::AsciiStrToLower(ShortEnum(
        hsdp::v1::WorkerEventKind_Name(e.kind()), "WORKER_EVENT_KIND_"));
    absl::StrAppend(&event, "@g", e.generation());
    if (e.kind() == hsdp::v1::WORKER_EVENT_KIND_MEMBER) {
      absl::StrAppend(&event, ":r", e.rank());
    }
    events.push_back(std::move(event));
  }
  return events.empty() ? "-" : absl::StrJoin(events, " ");
}

absl::Status Status(ControlClient& client, const GlobalOptions& g,
                    std::ostream& out) {
  return CallAndPrint(
      client, g, &ControlService::Stub::GetStatus, hsdp::v1::GetStatusRequest(),
      out, [&](const hsdp::v1::GetStatusResponse& r) {
        Table t({"FIELD", "VALUE"});
        t.Add({"job", r.job_id()});
        t.Add({"state",
               ShortEnum(hsdp::v1::JobState_Name(r.state()), "JOB_STATE_")});
        if (!r.message().empty()) t.Add({"why", r.message()});
        t.Add({"world",
               absl::StrCat(r.world_size(), " (mesh ", r.mesh().replicate(),
                            "x", r.mesh().shard(), ")")});
        t.Add({"replica groups",
               absl::StrCat(r.replicas(), " of ", r.mesh().replicate(),
                            " (min ", r.min_replicas(), ")")});
        t.Add({"workers alive",
               absl::StrCat(r.workers_alive(), "/", r.world_size(), ", ",
                            r.workers_standby(), " standby, ",
                            r.workers_joining(), " joining")});
        t.Add({"generation", std::to_string(r.generation())});
        for (const std::string& warning : r.topology_warnings()) {
          t.Add({"topology", warning});
        }
        t.Add({"committed step", StepOrNone(r.last_committed_step())});
        t.Add({"sealed step", StepOrNone(r.sealed_step())});
        t.Add({"policy version", std::to_string(r.policy_version())});
        t.Add({"last checkpoint", StepOrNone(r.last_checkpoint_step())});
        t.Add({"drain step", StepOrNone(r.drain_step())});
        t.Add({"model", r.model().empty() ? "-" : r.model()});
        t.Add({"units", std::to_string(r.unit_count())});
        t.Add({"failures", std::to_string(r.failures())});
        if (r.has_last_failure()) t.Add({"last failure", DescribeFailure(r)});
        t.Add(
            {"dashboard", r.dashboard_url().empty() ? "-" : r.dashboard_url()});
        if (r.has_training()) AddTrainingRows(r.training(), t);
        t.Print(out);
      });
}

absl::Status Workers(ControlClient& client, const GlobalOptions& g,
                     std::ostream& out) {
  return CallAndPrint(
      client, g, &ControlService::Stub::ListWorkers,
      hsdp::v1::ListWorkersRequest(), out,
      [&](const hsdp::v1::ListWorkersResponse& r) {
        auto number = [](int64_t v) {
          return v < 0 ? std::string("-") : std::to_string(v);
        };
        Table t({"WORKER", "RANK", "STATE", "GEN", "ROLE", "HOST", "DEVICE",
                 "REPLICA", "SHARD", "HEARTBEAT", "STEP", "LOSS", "STEP_S",
                 "PEAK_MEM", "HISTORY"});
        for (const auto& w : r.workers()) {
          const bool reported = w.has_last_report();
          const auto& rep = w.last_report();
          t.Add({std::to_string(w.worker_id()), number(w.rank()),
                 ShortEnum(hsdp::v1::WorkerState_Name(w.state()),
                           "WORKER_STATE_"),
                 number(w.generation()),
                 w.role() == hsdp::v1::GENERATION_ROLE_UNSPECIFIED
                     ? "-"
                     : absl::AsciiStrToLower(
                           ShortEnum(hsdp::v1::GenerationRole_Name(w.role()),
                                     "GENERATION_ROLE_")),
                 w.hostname().empty() ? "-" : w.hostname(),
                 w.device().empty() ? "-" : w.device(),
                 number(w.replicate_index()), number(w.shard_index()),
                 absl::StrCat(w.heartbeat_age_ms(), "ms"),
                 reported ? std::to_string(rep.step()) : "-",
                 reported ? FormatDouble(rep.loss(), 4) : "-",
                 reported ? FormatDouble(rep.step_seconds(), 3) : "-",
                 reported ? FormatBytes(rep.peak_memory_bytes()) : "-",
                 DescribeHistory(w)});
        }
        t.Print(out);
      });
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

std::string JoinInts(const google::protobuf::RepeatedField<int32_t>& values) {
  return values.empty() ? "-" : absl::StrJoin(values, ",");
}

absl::Status Schedule(ControlClient& client, const GlobalOptions& g,
                      int64_t step, std::optional<int64_t> generation,
                      std::ostream& out) {
  hsdp::v1::ControlServiceGetScheduleRequest request;
  request.set_step(step);
  if (generation.has_value()) request.set_generation(*generation);
  return CallAndPrint(
      client, g, &ControlService::Stub::GetSchedule, request, out,
      [&](const hsdp::v1::ControlServiceGetScheduleResponse& r) {
        const auto& sched = r.schedule();
        out << "step " << sched.step() << "  policy version "
            << sched.policy_version() << "  generation " << sched.generation()
            << "  checkpoint " << (sched.checkpoint() ? "yes" : "no") << "\n"
            << "world " << sched.world_size() << "  batch "
            << absl::AsciiStrToLower(ShortEnum(
                   hsdp::v1::BatchMode_Name(sched.batch_mode()), "BATCH_MODE_"))
            << "  microbatches " << sched.global_microbatches() << " from #"
            << sched.first_microbatch() << "\n";
        Table mb({"MICROBATCH", "GRAD_SYNC", "ALL_REDUCE", "LAST_BACKWARD"});
        for (int i = 0; i < sched.microbatches_size(); ++i) {
          const auto& m = sched.microbatches(i);
          mb.Add({std::to_string(i), m.requires_grad_sync() ? "yes" : "no",
                  m.requires_all_reduce() ? "yes" : "no",
                  m.is_last_backward() ? "yes" : "no"});
        }
        mb.Print(out);
        out << "\n";
        // Comm fusion: the group each unit's collectives go out with.
        std::vector<std::string> fusion(static_cast<size_t>(sched.units_size()),
                                        "-");
        for (int g = 0; g < sched.fusion_groups_size(); ++g) {
          for (int i : sched.fusion_groups(g).units()) {
            if (i >= 0 && i < sched.units_size()) {
              fusion[static_cast<size_t>(i)] = std::to_string(g);
            }
          }
        }
        Table units({"UNIT", "NAME", "RESHARD_FWD", "RESHARD_BWD",
                     "FWD_PREFETCH", "BWD_PREFETCH", "FUSION_GROUP"});
        for (int i = 0; i < sched.units_size(); ++i) {
          const auto& u = sched.units(i);
          units.Add({std::to_string(u.unit_index()), u.unit_name(),
                     u.reshard_after_forward() ? "yes" : "no",
                     u.reshard_after_backward() ? "yes" : "no",
                     JoinInts(u.forward_prefetch()),
                     JoinInts(u.backward_prefetch()),
                     fusion[static_cast<size_t>(i)]});
        }
        units.Print(out);
      });
}

absl::Status Checkpoint(ControlClient& client, const GlobalOptions& g,
                        std::ostream& out) {
  return CallAndPrint(client, g, &ControlService::Stub::RequestCheckpoint,
                      hsdp::v1::RequestCheckpointRequest(), out,
                      [&](const hsdp::v1::RequestCheckpointResponse& r) {
                        out << "checkpoint scheduled after step " << r.step()
                            << "\n";
                      });
}

absl::Status Evict(ControlClient& client, const GlobalOptions& g,
                   const EvictOptions& o, std::ostream& out) {
  hsdp::v1::EvictWorkerRequest request;
  if (o.rank.has_value() == o.worker_id.has_value()) {
    return absl::InvalidArgumentError("give a RANK or --worker-id, not both");
  }
  if (o.rank.has_value()) request.set_rank(*o.rank);
  if (o.worker_id.has_value()) request.set_worker_id(*o.worker_id);
  return CallAndPrint(client, g, &ControlService::Stub::EvictWorker, request,
                      out, [&](const hsdp::v1::EvictWorkerResponse& r) {
                        if (r.generation() >= 0) {
                          out << "worker " << r.worker_id()
                              << " evicted: generation " << r.generation()
                              << " ends at the next step boundary without it\n";
                        } else {
                          out << "worker " << r.worker_id() << " evicted\n";
                        }
                      });
}

absl::Status Drain(ControlClient& client, const GlobalOptions& g,
                   std::ostream& out) {
  return CallAndPrint(client, g, &ControlService::Stub::Drain,
                      hsdp::v1::DrainRequest(), out,
                      [&](const hsdp::v1::DrainResponse& r) {
                        out << "draining: last step " << r.last_step() << "\n";
                      });
}

struct TraceOptions {
  std::string steps;  // "A..B", "A", or empty: the first unsealed step
  std::string output = "trace.json";
  double wait_seconds = 300;
  bool fetch_only = false;
};

// Parses "A..B" or "A" into (first, last); empty gives (0, 0): the first
// unsealed step.
absl::StatusOr<std::pair<int64_t, int64_t>> ParseStepRange(
    const std::string& text) {
  if (text.empty()) return std::make_pair<int64_t, int64_t>(0, 0);
  const size_t dots = text.find("..");
  int64_t first = 0;
  int64_t last = 0;
  const bool ok = dots == std::string::npos
                      ? absl::SimpleAtoi(text, &first) && (last = first, true)
                      : absl::SimpleAtoi(text.substr(0, dots), &first) &&
                            absl::SimpleAtoi(text.substr(dots + 2), &last);
  if (!ok || first < 0 || last < first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps '", text, "': expected A..B with 0 <= A <= B, or A"));
  }
  return std::make_pair(first, last);
}

// Asks the workers to trace the steps (unless fetch_only), waits until every
// rank sent them, and writes the Chrome trace JSON.
absl::Status Trace(ControlClient& client, const GlobalOptions& g,
                   const TraceOptions& o, std::ostream& out) {
  HSDP_ASSIGN_OR_RETURN(auto range, ParseStepRange(o.steps));
  if (!o.fetch_only) {
    hsdp::v1::StartTraceRequest start;
    start.set_first_step(range.first);
    start.set_last_step(range.second);
    hsdp::v1::StartTraceResponse started;
    HSDP_RETURN_IF_ERROR(
        client.Call(&ControlService::Stub::StartTrace, start, &started));
    range = {started.first_step(), started.last_step()};
    if (!g.json) {
      out << "tracing steps " << range.first << ".." << range.second << "\n";
    }
  }
  hsdp::v1::GetTraceRequest request;
  request.set_first_step(range.first);
  request.set_last_step(range.second);
  hsdp::v1::GetTraceResponse trace;
  const absl::Time deadline = absl::Now() + absl::Seconds(o.wait_seconds);
  while (true) {
    HSDP_RETURN_IF_ERROR(
        client.Call(&ControlService::Stub::GetTrace, request, &trace));
    if (trace.complete() || o.fetch_only || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  std::ofstream file(o.output, std::ios::binary | std::ios::trunc);
  file << trace.chrome_trace_json();
  file.close();
  if (!file) {
    return absl::UnavailableError(
        absl::StrCat("cannot write the trace to ", o.output));
  }
  if (g.json) {
    hsdp::v1::GetTraceResponse summary = trace;
    summary.clear_chrome_trace_json();
    out << ToJson(summary) << "\n";
  } else {
    out << "wrote " << o.output << ": steps " << range.first << ".."
        << range.second << ", " << trace.rank_steps_reported() << "/"
        << trace.rank_steps_expected() << " rank-steps, clocks aligned within "
        << absl::StrFormat("%.3f", trace.max_clock_error_nanos() * 2 / 1e6)
        << " ms\n";
  }
  if (!trace.complete()) {
    return absl::DeadlineExceededError(
        absl::StrCat("only ", trace.rank_steps_reported(), " of ",
                     trace.rank_steps_expected(),
                     " rank-steps arrived (partial trace in ", o.output, ")"));
  }
  return absl::OkStatus();
}

// One line, whatever CLI11 or the server put in the message.
std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return std::string(absl::StripAsciiWhitespace(text));
}

}  // namespace

int RunHsdpctl(int argc, char** argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"hsdpctl: inspect and steer a running hsdp coordinator",
               "hsdpctl"};
  app.fallthrough();
  app.require_subcommand(1);
  GlobalOptions g;
  app.add_option("--coordinator", g.coordinator,
                 "Coordinator address HOST:PORT")
      ->envname("HSDP_COORDINATOR");
  app.add_option("--token-file", g.token_file,
                 "File holding the control bearer token")
      ->envname("HSDP_CONTROL_TOKEN_FILE");
  app.add_option("--tls-ca", g.tls_ca, "PEM root certificate: use TLS");
  app.add_option("--tls-client-cert", g.tls_client_cert,
                 "PEM client certificate (mutual TLS; with --tls-client-key)");
  app.add_option("--tls-client-key", g.tls_client_key,
                 "PEM client private key (mutual TLS)");
  app.add_option("--timeout", g.timeout_seconds, "RPC deadline in seconds");
  app.add_flag("--json", g.json, "Print JSON instead of tables");

  CLI::App* status =
      app.add_subcommand("status", "Job state, generation, sealed step");
  CLI::App* workers =
      app.add_subcommand("workers", "Workers and their latest reports");
  CLI::App* policy =
      app.add_subcommand("policy", "Get or set the sharding policy");
  policy->require_subcommand(1);
  CLI::App* policy_get =
      policy->add_subcommand("get", "Print the current policy");
  CLI::App* policy_set = policy->add_subcommand(
      "set",
      "Set the policy from a file and/or flags (flags apply on top of it)");
  PolicySetOptions ps;
  policy_set->add_option("--file", ps.file,
                         "Policy file (JSON or text format)");
  policy_set->add_option("--units", ps.units,
                         "Glob: the reshard flags become an override");
  policy_set->add_option("--reshard-after-forward", ps.reshard_after_forward,
                         "BOOL");
  policy_set->add_option("--reshard-after-backward", ps.reshard_after_backward,
                         "BOOL");
  policy_set->add_option("--forward-prefetch", ps.forward_prefetch,
                         "Forward prefetch depth");
  policy_set->add_option("--backward-prefetch", ps.backward_prefetch,
                         "Backward prefetch depth");
  policy_set->add_option("--microbatches", ps.microbatches,
                         "Gradient-accumulation microbatches");
  policy_set->add_option("--grad-sync", ps.grad_sync, "last|every")
      ->check(CLI::IsMember({"last", "every"}));
  policy_set->add_option("--all-reduce", ps.all_reduce, "last|every")
      ->check(CLI::IsMember({"last", "every"}));
  policy_set->add_option("--checkpoint-interval", ps.checkpoint_interval,
                         "Steps (0: never)");
  policy_set->add_option("--memory-budget", ps.memory_budget,
                         "Bytes per rank (0: manual mode)");
  policy_set->add_option("--batch-mode", ps.batch_mode, "fixed|shrink")
      ->check(CLI::IsMember({"fixed", "shrink"}));
  policy_set->add_option(
      "--comm-fusion-bucket", ps.comm_fusion_bucket,
      "Bytes: consecutive units up to this size share their collectives "
      "(0: no fusion)");
  CLI::App* schedule =
      app.add_subcommand("schedule", "Print a sealed step's schedule");
  int64_t step = -1;
  std::optional<int64_t> schedule_generation;
  schedule->add_option("--step", step, "Step")->required();
  schedule->add_option("--generation", schedule_generation,
                       "The record sealed in this generation (default: the "
                       "step's current one)");
  CLI::App* checkpoint =
      app.add_subcommand("checkpoint", "Checkpoint at the next unsealed step");
  CLI::App* drain =
      app.add_subcommand("drain", "Stop the job after the next unsealed step");
  CLI::App* trace = app.add_subcommand(
      "trace",
      "Record steps' timelines on every rank; write Chrome trace JSON");
  TraceOptions to;
  trace->add_option("--steps", to.steps,
                    "A..B or A (default: the next unsealed step)");
  trace->add_option("-o,--output", to.output, "Output file (trace.json)");
  trace->add_option("--wait", to.wait_seconds,
                    "Seconds to wait for every rank's spans (300)");
  trace->add_flag("--fetch-only", to.fetch_only,
                  "Fetch steps traced before; request nothing");
  CLI::App* evict = app.add_subcommand(
      "evict",
      "Take a worker out (at the next step boundary), as when draining a node");
  EvictOptions eo;
  evict->add_option("rank", eo.rank, "Rank in the current generation");
  evict->add_option("--worker-id", eo.worker_id,
                    "Worker id (also for standby or joining workers)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e, out, err);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e, out, err);
  } catch (const CLI::ParseError& e) {
    err << "hsdpctl: " << OneLine(e.what()) << "\n";
    return kExitUsage;
  }

  std::string command;
  for (CLI::App* sub : app.get_subcommands()) {
    command = sub->get_name();
    for (CLI::App* subsub : sub->get_subcommands())
      command += " " + subsub->get_name();
  }
  absl::StatusOr<ControlClient> client = ControlClient::Connect(g);
  absl::Status result;
  if (!client.ok()) {
    result = client.status();
  } else if (status->parsed()) {
    result = Status(*client, g, out);
  } else if (workers->parsed()) {
    result = Workers(*client, g, out);
  } else if (policy_get->parsed()) {
    result = PolicyGet(*client, g, out);
  } else if (policy_set->parsed()) {
    result = PolicySet(*client, g, ps, out);
  } else if (schedule->parsed()) {
    result = Schedule(*client, g, step, schedule_generation, out);
  } else if (checkpoint->parsed()) {
    result = Checkpoint(*client, g, out);
  } else if (drain->parsed()) {
    result = Drain(*client, g, out);
  } else if (trace->parsed()) {
    result = Trace(*client, g, to, out);
  } else if (evict->parsed()) {
    result = Evict(*client, g, eo, out);
  }
  if (!result.ok()) {
    err << "hsdpctl: " << command << ": "
        << absl::StatusCodeToString(result.code()) << ": "
        << OneLine(std::string(result.message())) << "\n";
    return kExitRpcError;
  }
  return kExitOk;
}

}  // namespace hsdp::ctl
