#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "framework/checkpoint/checkpoint.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

constexpr const char* kPrefix = "step_";
constexpr const char* kSuffix = ".h5";
constexpr const char* kTmpSuffix = ".h5.tmp";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Step of "step_<digits><suffix>", else -1.
int64_t parse_step(const std::string& name, const std::string& suffix) {
  const std::string prefix = kPrefix;
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      !ends_with(name, suffix))
    return -1;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits)
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  return std::stoll(digits);
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    HP_FAIL(ErrorKind::kIo, "rename ", from, " -> ", to, " failed: ", std::strerror(errno));
}

// Printable, bounded rendering of a file's contents for an error message.
std::string printable(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 64)) out += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  return s.size() > 64 ? out + "..." : out;
}

}  // namespace

std::string checkpoint_file_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s%08lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return buf;
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / checkpoint_file_name(step)).string();
}

std::string checkpoint_tmp_path(const std::string& dir, int64_t step) {
  return checkpoint_path(dir, step) + ".tmp";
}

int64_t checkpoint_step_of(const std::string& file_name) { return parse_step(file_name, kSuffix); }

void make_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'checkpoint_dir': cannot create directory '", dir,
                  "'", ec ? ": " + ec.message() : std::string());
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) HP_FAIL(ErrorKind::kIo, "open ", path, " for fsync failed: ", std::strerror(errno));
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    HP_FAIL(ErrorKind::kIo, "fsync of ", path, " failed: ", std::strerror(err));
  }
  ::close(fd);
}

void commit_checkpoint(const std::string& dir, int64_t step) {
  rename_or_fail(checkpoint_tmp_path(dir, step), checkpoint_path(dir, step));
  fsync_path(dir);
}

void update_latest(const std::string& dir, int64_t step) {
  const std::string latest = (fs::path(dir) / "latest").string();
  const std::string tmp = latest + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << checkpoint_file_name(step) << "\n";
    f.close();
    if (!f) HP_FAIL(ErrorKind::kIo, "cannot write ", tmp);
  }
  fsync_path(tmp);
  rename_or_fail(tmp, latest);
  fsync_path(dir);
}

std::vector<int64_t> committed_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t s = checkpoint_step_of(e.path().filename().string());
    if (s >= 0 && e.is_regular_file(ec)) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::string read_latest(const std::string& dir) {
  const std::string latest = (fs::path(dir) / "latest").string();
  std::error_code ec;
  if (!fs::exists(latest, ec)) return "";
  std::ifstream f(latest, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  if (checkpoint_step_of(s) < 0)
    HP_USER_ERROR(ErrorKind::kData, latest, ": contents '", printable(s),
                  "' are not the name of a committed checkpoint (step_<N>.h5)");
  return (fs::path(dir) / s).string();
}

std::vector<std::string> apply_retention(const std::string& dir, int64_t keep_last,
                                         int64_t newest_step) {
  std::vector<std::string> deleted;
  std::error_code ec;
  auto remove = [&](const std::string& name) {
    if (fs::remove(fs::path(dir) / name, ec)) deleted.push_back(name);
  };
  std::vector<std::string> stale;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t s = parse_step(name, kTmpSuffix);
    if (s >= 0 && s <= newest_step) stale.push_back(name);
  }
  for (const std::string& name : stale) remove(name);
  if (keep_last > 0) {
    int64_t kept = 0;
    for (int64_t s : committed_steps(dir)) {
      if (s > newest_step) continue;
      if (kept < keep_last) {
        ++kept;
        continue;
      }
      remove(checkpoint_file_name(s));
    }
  }
  return deleted;
}

}  // namespace hp
