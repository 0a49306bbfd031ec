// Typed errors and the CHECK macros used everywhere in hotpath.
//
// Every failure becomes an exception. An internal or library failure (HP_CHECK, HP_FAIL,
// throw_error) is an Error whose message names its kind, the rank that raised it and file:line,
// then the failed condition (HP_CHECK) or the caller's text with the library's own error string
// where the caller passes it. A user's mistake (HP_USER_ERROR: a flag, a config key, a data
// file) is a UserError whose message is the caller's text alone: what is wrong and what is valid,
// with no file:line or rank (the log line that prints it carries the rank). Library code never
// calls exit(); the top level (launch/main.cpp) catches, logs, aborts communicators and exits 2
// for a UserError, 1 for any other failure.
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
