// hsdpctl status and hsdpctl workers.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/ctl/command.h"
#include "coordinator/ctl/format.h"

namespace hsdp::ctl {
namespace {

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

}  // namespace

void AddStatusCommands(CLI::App& app, std::vector<Command>& commands) {
  commands.push_back(
      {app.add_subcommand("status", "Job state, generation, sealed step"),
       Status});
  commands.push_back(
      {app.add_subcommand("workers", "Workers and their latest reports"),
       Workers});
}

}  // namespace hsdp::ctl
