// The command line's option reader and its usage errors, shared by the flowmoe subcommands.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/common/error.h"

namespace flowmoe {

class UsageError : public ConfigError {
  using ConfigError::ConfigError;
};
struct HelpShown {};  // --help: the text is printed, exit 0

// A tiny argument reader: --opt VALUE, --opt=VALUE, flags and positionals.
class Args {
 public:
  Args(int argc, char** argv, int first, const char* help) : help_(help) {
    for (int i = first; i < argc; ++i) items_.push_back(argv[i]);
  }
  bool done() const { return pos_ >= items_.size(); }
  // The next item; a "--x=y" item is split so that value() returns y.
  std::string next() {
    std::string a = items_[pos_++];
    pending_.clear();
    has_pending_ = false;
    size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      pending_ = a.substr(eq + 1);
      has_pending_ = true;
      a = a.substr(0, eq);
    }
    if (a == "-h" || a == "--help") {
      std::fputs(help_, stdout);
      throw HelpShown{};
    }
    return a;
  }
  std::string value(const std::string& opt) {
    if (has_pending_) {
      has_pending_ = false;
      return pending_;
    }
    if (done()) throw UsageError(opt + " needs a value");
    return items_[pos_++];
  }
  // An optional value: the next item unless it is another option.
  bool has_optional_value() const { return has_pending_ || (!done() && items_[pos_].rfind("-", 0) != 0); }

 private:
  const char* help_;
  std::vector<std::string> items_;
  size_t pos_ = 0;
  std::string pending_;
  bool has_pending_ = false;
};

// The options of the subcommands that read a checkpoint with its run's config (eval, fp8-error):
// --config FILE, --checkpoint DIR and any --set KEY=VALUE.
struct CheckpointArgs {
  std::string config, checkpoint;
  std::vector<std::string> sets;

  // Takes `a` (just read from args) when it is one of these options; false leaves it to the caller.
  bool take(Args& args, const std::string& a) {
    if (a == "--config")
      config = args.value(a);
    else if (a == "--checkpoint")
      checkpoint = args.value(a);
    else if (a == "--set")
      sets.push_back(args.value(a));
    else
      return false;
    return true;
  }
  // Both are required: a UsageError "<command>: --config FILE and --checkpoint DIR are required".
  void require(const std::string& command) const {
    if (config.empty() || checkpoint.empty())
      throw UsageError(command + ": --config FILE and --checkpoint DIR are required");
  }
};

// An option's value as a whole number of at least 1, or a UsageError:
// "<command>: <opt> needs <what>, got '<value>'".
inline int64_t positive_integer(const std::string& command, const std::string& opt, const std::string& value,
                                const std::string& what = "a positive integer") {
  char* end = nullptr;
  const long long n = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || n < 1)
    throw UsageError(command + ": " + opt + " needs " + what + ", got '" + value + "'");
  return n;
}

// An option's value as a finite number of at least 0 (a whole one when `integer`), or a UsageError:
// "<command>: <opt> needs a non-negative number, got '<value>'".
inline double non_negative_number(const std::string& command, const std::string& opt, const std::string& value,
                                  bool integer = false) {
  char* end = nullptr;
  const double x = integer ? double(std::strtoll(value.c_str(), &end, 10)) : std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
    throw UsageError(command + ": " + opt + " needs a non-negative " + (integer ? "integer" : "number") + ", got '" +
                     value + "'");
  return x;
}

}  // namespace flowmoe
