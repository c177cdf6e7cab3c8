#include "coordinator/ctl/hsdpctl.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "coordinator/ctl/command.h"
#include "coordinator/ctl/control_client.h"

namespace hsdp::ctl {
namespace {

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

  // In the order `hsdpctl --help` lists them.
  std::vector<Command> commands;
  AddStatusCommands(app, commands);
  AddPolicyCommands(app, commands);
  AddScheduleCommand(app, commands);
  AddCheckpointCommand(app, commands);
  AddDrainCommand(app, commands);
  AddTraceCommand(app, commands);
  AddEvictCommand(app, commands);

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
  } else {
    for (const Command& c : commands) {
      if (c.app->parsed()) result = c.run(*client, g, out);
    }
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
