// Typed errors and the CHECK macros used everywhere in hotpath.
//
// Every failure becomes an exception whose message names the failed statement, file:line, the
// library's own error string and the rank that raised it. Library code never calls exit(); the
// top level (launch/) catches, logs, aborts communicators and exits non-zero.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace hp {

// The rank is set once at start by the launcher so that every message can carry it.
void set_error_rank(int rank);
int error_rank();

enum class ErrorKind {
  kInternal,
  kUser,
  kConfig,
  kData,
  kIo,
  kCuda,
  kCublas,
  kNccl,
  kMpi,
  kHdf5,
  kComm
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// A mistake of the user's (bad flag, config key, data file): the message says what is valid.
class UserError : public Error {
 public:
  UserError(ErrorKind kind, const std::string& what) : Error(kind, what) {}
};

[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const std::string& what);

namespace detail {
inline void stream_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_all(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  stream_all(os, rest...);
}
}  // namespace detail

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::stream_all(os, args...);
  return os.str();
}

}  // namespace hp

// Internal invariant: a violated HP_CHECK is a bug in hotpath or a misuse of its API.
#define HP_CHECK(cond, ...)                                                         \
  do {                                                                              \
    if (!(cond))                                                                    \
      ::hp::throw_error(::hp::ErrorKind::kInternal, __FILE__, __LINE__,             \
                        ::hp::str_cat("check failed: " #cond ": ", ##__VA_ARGS__)); \
  } while (0)

// A user-facing failure (bad config, bad data): no "check failed", just the message.
#define HP_USER_ERROR(kind, ...) throw ::hp::UserError(kind, ::hp::str_cat(__VA_ARGS__))

#define HP_FAIL(kind, ...) ::hp::throw_error(kind, __FILE__, __LINE__, ::hp::str_cat(__VA_ARGS__))
