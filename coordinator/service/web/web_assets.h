// The dashboard's static files (coordinator/service/web/*.html, *.js, *.css),
// compiled into the binary by embed_assets.cmake so the page needs no file
// system and no network.
#ifndef HSDP_COORDINATOR_SERVICE_WEB_WEB_ASSETS_H_
#define HSDP_COORDINATOR_SERVICE_WEB_WEB_ASSETS_H_

#include <vector>

#include "absl/strings/string_view.h"

namespace hsdp::coordinator {

struct WebAsset {
  // URL path: "/" for index.html, "/NAME" for the others.
  const char* path;
  const char* content_type;
  absl::string_view body;
};

// Every embedded file; immutable, lives as long as the program.
const std::vector<WebAsset>& WebAssets();

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_WEB_WEB_ASSETS_H_
