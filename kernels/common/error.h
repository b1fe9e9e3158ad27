// Typed errors for flowmoe. Everything below main() throws; nothing calls exit(), so tests can
// EXPECT_THROW on bad input. what() is the message alone, one line, for the user; the source
// location that threw is kept apart (file(), line()) for `flowmoe --debug`.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace flowmoe {

namespace detail {
// Errors are printed as one line: each line break (with the blanks around it) becomes "; ".
inline std::string one_line(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\n' && s[i] != '\r') {
      out += s[i];
      continue;
    }
    while (!out.empty() && (out.back() == ' ' || out.back() == '\t')) out.pop_back();
    while (i + 1 < s.size() && (s[i + 1] == '\n' || s[i + 1] == '\r' || s[i + 1] == ' ' || s[i + 1] == '\t')) ++i;
    if (!out.empty() && i + 1 < s.size()) out += out.back() == ':' || out.back() == ';' ? " " : "; ";
  }
  return out;
}
}  // namespace detail

// Base of every flowmoe error. file is nullptr (line 0) when the error was not thrown by
// FLOWMOE_CHECK / FLOWMOE_THROW.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, const char* file = nullptr, int line = 0)
      : std::runtime_error(detail::one_line(message)), file_(file), line_(line) {}
  const char* file() const { return file_; }
  int line() const { return line_; }
  // "file:line", or "" when unknown.
  std::string location() const { return file_ ? std::string(file_) + ":" + std::to_string(line_) : std::string(); }

 private:
  const char* file_;
  int line_;
};
class ShapeError : public Error {
  using Error::Error;
};  // shapes that do not fit together
class DTypeError : public Error {
  using Error::Error;
};  // unsupported or mismatched dtypes
class DeviceError : public Error {
  using Error::Error;
};  // wrong device, or no CUDA
class CudaError : public Error {
  using Error::Error;
};  // a CUDA / cuBLASLt / NCCL call failed
class ConfigError : public Error {
  using Error::Error;
};  // bad YAML or --set value
class IoError : public Error {
  using Error::Error;
};  // files: checkpoints, data

namespace detail {
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace flowmoe

// FLOWMOE_CHECK(cond, ErrorType, msg...) throws ErrorType("msg...") when cond is false, recording
// where (__FILE__, __LINE__) beside the message.
#define FLOWMOE_CHECK(cond, ErrType, ...)                                                \
  do {                                                                                   \
    if (!(cond)) throw ErrType(::flowmoe::detail::cat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

#define FLOWMOE_THROW(ErrType, ...) throw ErrType(::flowmoe::detail::cat(__VA_ARGS__), __FILE__, __LINE__)
