// Option tables (cli_options.h).
#include "cli_options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>

#include "cli_common.h"

namespace sparsa_cli {

void parse_options(const std::vector<std::string>& args, const std::vector<Option>& table, const std::string& command) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i];
    std::string value;
    bool inline_value = false;
    if (const size_t eq = name.find('='); name.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    const auto option = std::find_if(table.begin(), table.end(), [&](const Option& o) { return o.name == name; });
    if (option == table.end()) {
      throw UsageError(command + ": unknown argument '" + args[i] + "' (see sparsa " + command + " --help)");
    }
    if (option->value_name.empty()) {
      if (inline_value) throw UsageError(command + ": " + name + " takes no value");
    } else if (!inline_value) {
      if (i + 1 >= args.size()) {
        throw UsageError(command + ": " + name + " needs a value (" + option->value_name + ")");
      }
      value = args[++i];
    }
    option->apply(value);
  }
}

void print_options(std::ostream& os, const std::vector<Option>& table) {
  for (const Option& o : table) {
    const std::string left = o.name + (o.value_name.empty() ? "" : " " + o.value_name);
    char line[512];
    std::snprintf(line, sizeof line, "  %-30s %s\n", left.c_str(), o.help.c_str());
    os << line;
  }
}

bool wants_help(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(), [](const std::string& a) { return a == "--help" || a == "-h"; });
}

int64_t parse_int(const std::string& option, const std::string& text, int64_t min, int64_t max) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || value < min || value > max) {
    throw UsageError(option + ": expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                     "], got '" + text + "'");
  }
  return value;
}

float parse_float(const std::string& option, const std::string& text, double min, double max) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool in_range = value >= min && value <= max;  // false for NaN
  if (text.empty() || *end != '\0' || errno == ERANGE || !in_range) {
    char range[96];
    std::snprintf(range, sizeof range, "[%g, %g]", min, max);
    throw UsageError(option + ": expected a number in " + range + ", got '" + text + "'");
  }
  return static_cast<float>(value);
}

}  // namespace sparsa_cli
