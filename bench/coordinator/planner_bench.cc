// The plans memory-budget mode picks, with and without the job's link
// figures: a mixture-of-experts model (dense and MoE blocks alternating, an
// MoE block four times a dense one) on 8 ranks, for budgets from the least
// peak the model reaches to the peak with every block kept. Per budget and
// per link: the blocks kept unsharded after forward (D/M kept, d/m
// resharded), the predicted peak, and per step the backward all-gathers the
// kept blocks save, the bytes each rank then does not receive, and their
// predicted time on the row's link and on the 1 Gbit/s cross-host link.
// The last link of each budget is the cross-host one under hierarchical
// reshard (host groups of 4): there a kept block saves a gather inside the
// host, priced on the 100 Gbit/s intra-host link, so the planner weighs it
// at that price. Its host shards cost memory, so its least peak is higher: a
// peak marked '*' is over the row's budget (the plan says so,
// over_memory_budget).
//
//   planner_bench [--microbatches M] [--steps-of-budget K] [--dense-mib D]
//
// Nothing is timed: these are the planner's predictions, the numbers it
// chooses by.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/planner.h"

namespace {

using hsdp::coordinator::AllGatherSavings;
using hsdp::coordinator::LinkCosts;
using hsdp::coordinator::Planner;
using hsdp::v1::StepSchedule;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr int kShard = 8;
constexpr int kBlocks = 12;
constexpr int kExperts = 4;

hsdp::UnitList MoeUnits(int64_t dense_bytes) {
  hsdp::UnitList units;
  auto add = [&](const std::string& name, int64_t bytes) {
    hsdp::v1::UnitInfo u;
    u.set_name(name);
    u.set_param_count(bytes / 4);
    u.set_param_bytes(bytes);
    units.push_back(u);
  };
  add("root", static_cast<int64_t>(64 * kMiB));  // embeddings, norm, head
  for (int i = 0; i < kBlocks; ++i) {
    add(absl::StrCat("layers.", i),
        i % 2 == 0 ? dense_bytes : kExperts * dense_bytes);
  }
  return units;
}

// "dMdM..." with the kept blocks upper-case.
std::string KeptBlocks(const StepSchedule& s) {
  std::string out;
  for (int i = 1; i < s.units_size(); ++i) {
    const bool moe = (i - 1) % 2 == 1;
    const bool kept = !s.units(i).reshard_after_forward();
    out += moe ? (kept ? 'M' : 'm') : (kept ? 'D' : 'd');
  }
  return out;
}

struct Link {
  std::string name;
  LinkCosts links;
  bool across = false;
  // > 1: hierarchical reshard over host groups of this size.
  int host_group = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"planner_bench: the plans memory-budget mode picks per link"};
  int microbatches = 2;
  int budgets = 8;
  double dense_mib = 28;
  app.add_option("--microbatches", microbatches, "Microbatches per step");
  app.add_option("--steps-of-budget", budgets,
                 "Budgets between the least and the most peak");
  app.add_option("--dense-mib", dense_mib, "A dense block's MiB (MoE: 4x)");
  CLI11_PARSE(app, argc, argv);

  const hsdp::UnitList units = MoeUnits(static_cast<int64_t>(dense_mib * kMiB));
  hsdp::v1::Policy manual;
  manual.set_microbatches(microbatches);
  auto peak_of = [&](bool keep_all) {
    Planner planner(units, kShard);
    hsdp::v1::Policy p = manual;
    p.set_reshard_after_forward(!keep_all);
    return planner.PredictPeak(planner.Plan(p, {})).Total();
  };
  const int64_t least = peak_of(false), most = peak_of(true);

  std::vector<Link> links(4);
  links[0].name = "none declared";
  links[1].name = "in host 100G";
  links[1].links.intra_host = {100e9 / 8, 100e-6};
  links[2].name = "across 1G";
  links[2].links.inter_host = {1e9 / 8, 50e-6};
  links[2].across = true;
  links[3].name = "across 1G hpZ";
  links[3].links.intra_host = links[1].links.intra_host;
  links[3].links.inter_host = links[2].links.inter_host;
  links[3].across = true;
  links[3].host_group = kShard / 2;
  // Every plan's savings also on the cross-host link, to compare with.
  Planner across(units, kShard);
  across.SetLinks(links[2].links);
  across.SetShardGroupsCrossHosts(true);

  std::printf(
      "planner_bench: MoE model, root 64 MiB + %d blocks alternating dense "
      "%.2f MiB / MoE %.2f MiB, %d ranks per shard group, %d microbatches; "
      "peak %.1f MiB (every block resharded) .. %.1f MiB (every block kept)\n",
      kBlocks, dense_mib, kExperts * dense_mib, kShard, microbatches,
      static_cast<double>(least) / kMiB, static_cast<double>(most) / kMiB);
  std::printf("%-10s %-14s %-13s %9s %9s %10s %9s %14s\n", "budget_MiB", "link",
              "kept", "peak_MiB", "saved_ag", "saved_MiB", "saved_s",
              "saved_s@1G_xh");
  for (int k = 0; k <= budgets; ++k) {
    const int64_t budget = least + (most - least) * k / budgets;
    for (const Link& link : links) {
      Planner planner(units, kShard);
      planner.SetLinks(link.links);
      planner.SetShardGroupsCrossHosts(link.across);
      planner.SetHostGroupSize(link.host_group);
      hsdp::v1::Policy p = manual;
      p.set_memory_budget_bytes(budget);
      p.set_reshard_after_forward_within_host(link.host_group > 1);
      const StepSchedule s = planner.Plan(p, {});
      const AllGatherSavings saved = planner.Savings(s);
      // Under hierarchical reshard no saved gather would cross hosts.
      const std::string across_seconds =
          link.host_group > 1
              ? "-"
              : absl::StrFormat("%.3f", across.Savings(s).seconds);
      // '*': the least peak this policy reaches is over the budget.
      const std::string peak = absl::StrFormat(
          "%.1f%s", static_cast<double>(s.predicted_peak_bytes()) / kMiB,
          s.over_memory_budget() ? "*" : "");
      std::printf("%-10.1f %-14s %-13s %9s %9lld %10.1f %9.4f %14s\n",
                  static_cast<double>(budget) / kMiB, link.name.c_str(),
                  KeptBlocks(s).c_str(), peak.c_str(),
                  static_cast<long long>(saved.count),
                  static_cast<double>(saved.bytes) / kMiB, saved.seconds,
                  across_seconds.c_str());
    }
  }
  return 0;
}
