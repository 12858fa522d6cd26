// The `sparsa` command-line tool: `sparsa demo`, `sparsa run`, `sparsa version` (docs/cli.md).
// Every failure prints one line on stderr: exit status 2 for a bad command line or input file, 1 for a failure while
// running. Progress goes to stderr, results to stdout.
#include <sparsa/sparsa.h>

#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_options.h"

namespace sparsa_cli {
int run_demo(const std::vector<std::string>& args);
int run_command(const std::vector<std::string>& args);
void print_demo_help(std::ostream& os);
void print_run_help(std::ostream& os);
}  // namespace sparsa_cli

namespace {

void print_help(std::ostream& os) {
  os << "usage: sparsa <command> [options]\n\n"
        "commands:\n"
        "  demo      every policy on a structured long-context input, one table vs dense attention\n"
        "  run       one policy on your .npy tensors (q, k, v), compared with dense attention\n"
        "  version   print the library version\n\n"
        "`sparsa <command> --help` lists a command's options. Exit status: 0 ok, 1 run failure, 2 bad arguments.\n";
}

int dispatch(const std::vector<std::string>& argv) {
  using namespace sparsa_cli;
  if (argv.empty()) throw UsageError("missing command (expected demo, run or version; see sparsa --help)");
  const std::string& command = argv[0];
  const std::vector<std::string> args(argv.begin() + 1, argv.end());
  if (command == "--help" || command == "-h" || command == "help") {
    print_help(std::cout);
    return 0;
  }
  if (command == "version" || command == "--version") {
    std::cout << "sparsa " << sparsa_version_string() << "\n";
    return 0;
  }
  if (command == "demo") {
    if (wants_help(args)) {
      print_demo_help(std::cout);
      return 0;
    }
    return run_demo(args);
  }
  if (command == "run") {
    if (wants_help(args)) {
      print_run_help(std::cout);
      return 0;
    }
    return run_command(args);
  }
  throw UsageError("unknown command '" + command + "' (expected demo, run or version; see sparsa --help)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const sparsa_cli::UsageError& e) {
    std::cerr << "sparsa: " << e.what() << "\n";
    return sparsa_cli::kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "sparsa: " << e.what() << "\n";
    return sparsa_cli::kExitRuntimeError;
  }
}
