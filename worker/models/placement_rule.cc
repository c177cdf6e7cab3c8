#include "worker/models/placement_rule.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/models/unit_rule.h"

namespace hsdp::models {
namespace {

constexpr char kReplicated[] = "replicated";

}  // namespace

absl::StatusOr<std::map<std::string, fsdp::ParamPlacement>> MatchPlacementRule(
    absl::string_view rule, const std::vector<std::string>& param_names) {
  std::map<std::string, fsdp::ParamPlacement> out;
  // Which entry placed each parameter.
  std::map<std::string, std::string> placed_by;
  for (absl::string_view entry : absl::StrSplit(rule, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement '", rule, "': '", entry, "' ", why));
    };
    const std::vector<absl::string_view> parts =
        absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (parts.size() != 2 || absl::StripAsciiWhitespace(parts[0]).empty()) {
      return bad("is not GLOB=DIM or GLOB=replicated");
    }
    const absl::string_view glob = absl::StripAsciiWhitespace(parts[0]);
    const absl::string_view where = absl::StripAsciiWhitespace(parts[1]);
    fsdp::ParamPlacement placement;
    if (where == kReplicated) {
      placement.replicated = true;
    } else if (!absl::SimpleAtoi(where, &placement.shard_dim)) {
      return bad("places its parameters neither on a dim nor replicated");
    }
    bool any = false;
    for (const std::string& name : param_names) {
      if (!GlobMatchesModuleName(glob, name)) continue;
      any = true;
      auto [it, fresh] = placed_by.emplace(name, std::string(entry));
      if (!fresh) {
        return bad(absl::StrCat("places ", name, ", which '", it->second,
                                "' placed already"));
      }
      out[name] = placement;
    }
    if (!any) return bad("matches no parameter");
  }
  return out;
}

}  // namespace hsdp::models
