#include "framework/core/error.h"

#include <atomic>

namespace hp {
namespace {
std::atomic<int> g_rank{0};
}

void set_error_rank(int rank) { g_rank.store(rank); }
int error_rank() { return g_rank.load(); }

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInternal:
      return "internal";
    case ErrorKind::kUser:
      return "usage";
    case ErrorKind::kConfig:
      return "config";
    case ErrorKind::kData:
      return "data";
    case ErrorKind::kIo:
      return "io";
    case ErrorKind::kCuda:
      return "cuda";
    case ErrorKind::kCublas:
      return "cublas";
    case ErrorKind::kNccl:
      return "nccl";
    case ErrorKind::kMpi:
      return "mpi";
    case ErrorKind::kHdf5:
      return "hdf5";
    case ErrorKind::kComm:
      return "comm";
  }
  return "unknown";
}

void throw_error(ErrorKind kind, const char* file, int line, const std::string& what) {
  throw Error(kind, str_cat(error_kind_name(kind), " error on rank ", error_rank(), " at ", file,
                            ":", line, ": ", what));
}

}  // namespace hp
