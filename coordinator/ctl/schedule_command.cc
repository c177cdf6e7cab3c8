// hsdpctl schedule: a sealed step's schedule.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/ctl/command.h"
#include "coordinator/ctl/format.h"

namespace hsdp::ctl {
namespace {

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
            << sched.first_microbatch()
            << (sched.post_forward_group_size() > 0
                    ? absl::StrCat("  after forward: sharded within hosts of ",
                                   sched.post_forward_group_size(), " ranks")
                    : std::string())
            << "\n";
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

}  // namespace

void AddScheduleCommand(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* schedule =
      app.add_subcommand("schedule", "Print a sealed step's schedule");
  auto step = std::make_shared<int64_t>(-1);
  auto generation = std::make_shared<std::optional<int64_t>>();
  schedule->add_option("--step", *step, "Step")->required();
  schedule->add_option("--generation", *generation,
                       "The record sealed in this generation (default: the "
                       "step's current one)");
  commands.push_back(
      {schedule, [step, generation](ControlClient& client,
                                    const GlobalOptions& g, std::ostream& out) {
         return Schedule(client, g, *step, *generation, out);
       }});
}

}  // namespace hsdp::ctl
