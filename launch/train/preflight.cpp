#include "launch/train/outputs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "framework/core/error.h"

namespace fs = std::filesystem;

namespace hp {
namespace {

[[noreturn]] void fail(const char* key, const std::string& path, const std::string& why) {
  HP_USER_ERROR(ErrorKind::kConfig, "config key '", key, "': cannot write '", path, "': ", why,
                " (checked before the run starts)");
}

void make_dirs(const char* key, const fs::path& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    fail(key, dir.string(), "it exists and is not a directory");
  fs::create_directories(dir, ec);
  if (ec) fail(key, dir.string(), "cannot create the directory: " + ec.message());
}

// A new file in `dir` is created, written, flushed and removed.
void probe_directory(const char* key, const std::string& dir, int rank) {
  make_dirs(key, dir);
  const std::string probe = (fs::path(dir) / (".hotpath_write_probe." + std::to_string(rank) + "." +
                                              std::to_string(::getpid())))
                                .string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(key, dir, std::strerror(errno));
  const char byte = 0;
  const bool ok = ::write(fd, &byte, 1) == 1 && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!ok) fail(key, dir, std::strerror(err));
}

// The file is opened for appending (never truncated here); one this check created is removed.
void probe_file(const char* key, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(key, path, "it is a directory");
  make_dirs(key, fs::path(path).parent_path());
  const bool existed = fs::exists(path, ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) fail(key, path, std::strerror(errno));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
}

}  // namespace

void check_outputs_writable(const TrainOptions& o, const std::string& command, int rank) {
  if (command == "train" && !o.checkpoint.dir.empty())
    probe_directory("checkpoint_dir", o.checkpoint.dir, rank);
  if (rank != 0) return;
  if (command == "train" && !o.run.metrics_path.empty())
    probe_file("metrics_path", o.run.metrics_path);
  if (command.rfind("bench", 0) == 0 && !o.bench.json.empty())
    probe_file("bench_json", o.bench.json);
}

}  // namespace hp
