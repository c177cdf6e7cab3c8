#include "worker/models/unit_rule.h"

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace hsdp::models {
namespace {

// `ancestor` is a proper prefix of `name` in dotted components.
bool IsAncestor(absl::string_view ancestor, absl::string_view name) {
  return name.size() > ancestor.size() && absl::StartsWith(name, ancestor) &&
         name[ancestor.size()] == '.';
}

}  // namespace

bool GlobMatchesModuleName(absl::string_view pattern, absl::string_view name) {
  // Backtracking over the last '*' suffices: '*' never crosses a '.', and a
  // '.' in the pattern only matches a '.'.
  size_t p = 0, n = 0;
  size_t star_p = absl::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star_p = p++;
      star_n = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star_p != absl::string_view::npos && name[star_n] != '.') {
      p = star_p + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

absl::StatusOr<std::vector<std::string>> MatchUnitRule(
    absl::string_view rule, const std::vector<std::string>& module_names) {
  std::vector<std::string> globs;
  for (absl::string_view g : absl::StrSplit(rule, ',')) {
    g = absl::StripAsciiWhitespace(g);
    if (g.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--units '", rule, "': empty glob"));
    }
    globs.emplace_back(g);
  }
  // Which glob selected each name (the first that matches it).
  std::map<std::string, std::string> selected_by;
  std::vector<std::string> selected;
  for (const std::string& glob : globs) {
    bool any = false;
    for (const std::string& name : module_names) {
      if (name.empty() || !GlobMatchesModuleName(glob, name)) continue;
      any = true;
      if (selected_by.emplace(name, glob).second) selected.push_back(name);
    }
    if (!any) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--units '", rule, "': '", glob, "' matches no submodule"));
    }
  }
  for (const std::string& a : selected) {
    for (const std::string& b : selected) {
      if (IsAncestor(a, b)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--units '", rule, "': units overlap: '", b,
                         "' (from '", selected_by[b], "') is inside '", a,
                         "' (from '", selected_by[a], "')"));
      }
    }
  }
  // Forward order is the model's order, not the rule's.
  std::vector<std::string> ordered;
  for (const std::string& name : module_names) {
    if (selected_by.count(name)) ordered.push_back(name);
  }
  return ordered;
}

}  // namespace hsdp::models
