// Table-driven command-line options for the sparsa tool: each command lists its options once, and the same table
// parses the arguments and prints the help. Every bad argument becomes one UsageError line.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace sparsa_cli {

struct Option {
  std::string name;                                     // "--n"
  std::string value_name;                               // "N"; empty for a flag, which takes no value
  std::string help;                                     // one line
  std::function<void(const std::string& value)> apply;  // flags get ""
};

// Applies `args` ("--name value", "--name=value" or "--flag") to `table`; throws UsageError naming `command` for an
// unknown option, a missing value, or a value given to a flag.
void parse_options(const std::vector<std::string>& args, const std::vector<Option>& table, const std::string& command);

// Prints "  --name VALUE   help" lines.
void print_options(std::ostream& os, const std::vector<Option>& table);

// True when args contain --help or -h.
bool wants_help(const std::vector<std::string>& args);

// Value parsers: UsageError("<option>: expected ..., got '<text>'") when the text is not a number in range.
int64_t parse_int(const std::string& option, const std::string& text, int64_t min, int64_t max);
float parse_float(const std::string& option, const std::string& text, double min, double max);

}  // namespace sparsa_cli
