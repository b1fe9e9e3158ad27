// Typed errors for flowmoe. Everything below main() throws; nothing calls exit(), so tests can
// EXPECT_THROW on bad input. Each message names what failed and where (file:line).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace flowmoe {

// Base of every flowmoe error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class ShapeError : public Error { using Error::Error; };   // shapes that do not fit together
class DTypeError : public Error { using Error::Error; };   // unsupported or mismatched dtypes
class DeviceError : public Error { using Error::Error; };  // wrong device, or no CUDA
class CudaError : public Error { using Error::Error; };    // a CUDA / cuBLASLt / NCCL call failed
class ConfigError : public Error { using Error::Error; };  // bad YAML or --set value
class IoError : public Error { using Error::Error; };      // files: checkpoints, data

namespace detail {
inline std::string where(const char* file, int line) {
  std::ostringstream os;
  os << " at " << file << ":" << line;
  return os.str();
}
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace flowmoe

// FLOWMOE_CHECK(cond, ErrorType, msg...) throws ErrorType("msg... at file:line") when cond is false.
#define FLOWMOE_CHECK(cond, ErrType, ...)                                                        \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      throw ErrType(::flowmoe::detail::cat(__VA_ARGS__) + ::flowmoe::detail::where(__FILE__, __LINE__)); \
  } while (0)

#define FLOWMOE_THROW(ErrType, ...) \
  throw ErrType(::flowmoe::detail::cat(__VA_ARGS__) + ::flowmoe::detail::where(__FILE__, __LINE__))
