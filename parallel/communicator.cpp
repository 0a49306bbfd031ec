#include "parallel/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

namespace hp {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

Communicator::Communicator(std::string name, int rank, int size, std::vector<int> world_ranks,
                           CommOptions options)
    : name_(std::move(name)),
      rank_(rank),
      size_(size),
      world_ranks_(std::move(world_ranks)),
      options_(options) {
  HP_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "rank ", rank_, " of ", size_);
  HP_CHECK(static_cast<int>(world_ranks_.size()) == size_, "world rank table of ",
           world_ranks_.size(), " entries for ", size_, " ranks");
}

int Communicator::world_rank(int r) const {
  HP_CHECK(r >= 0 && r < size_, "rank ", r, " of communicator '", name_, "' with ", size_,
           " ranks");
  return world_ranks_[static_cast<size_t>(r)];
}

std::shared_ptr<Communicator> Communicator::split_by_host(const std::string& name) {
  return split_by_label(*this, local_hostname(), name);
}

std::shared_ptr<Communicator> split_by_label(Communicator& parent, const std::string& label,
                                             const std::string& name) {
  const int n = parent.size();
  // Lengths first, so that labels of any length travel in one fixed-size gather.
  Tensor my_len =
      Tensor::host_from(std::vector<int64_t>{static_cast<int64_t>(label.size())}, DType::kI64);
  Tensor lens = Tensor::host({n}, DType::kI64);
  parent.all_gather(my_len, lens);
  const int64_t* len = lens.data<int64_t>();
  int64_t max_len = *std::max_element(len, len + n);
  int64_t words = std::max<int64_t>(1, (max_len + 7) / 8);

  Tensor mine = Tensor::host({words}, DType::kI64);
  std::memcpy(mine.raw(), label.data(), label.size());
  Tensor all = Tensor::host({n * words}, DType::kI64);
  parent.all_gather(mine, all);

  // Color: the lowest rank carrying the same label.
  const char* bytes = static_cast<const char*>(all.raw());
  int color = parent.rank();
  for (int r = 0; r < n; ++r) {
    if (len[r] == static_cast<int64_t>(label.size()) &&
        std::memcmp(bytes + r * words * 8, label.data(), label.size()) == 0) {
      color = r;
      break;
    }
  }
  return parent.split(color, parent.rank(), name);
}

std::string local_hostname() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) {
    HP_FAIL(ErrorKind::kComm, "gethostname failed: ", std::strerror(errno));
  }
  return std::string(buf);
}

}  // namespace hp
