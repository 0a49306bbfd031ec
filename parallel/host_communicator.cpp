#include "parallel/host_communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <type_traits>

namespace hp {
namespace {

template <typename T>
T sum_of(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wrap around instead of signed overflow
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T>
T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return b > a ? b : a;
}

template <typename T>
T min_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return b < a ? b : a;
}

template <typename T>
void fold(T* acc, const T* x, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      for (int64_t i = 0; i < n; ++i) acc[i] = sum_of(acc[i], x[i]);
      break;
    case ReduceOp::kMax:
      for (int64_t i = 0; i < n; ++i) acc[i] = max_of(acc[i], x[i]);
      break;
    case ReduceOp::kMin:
      for (int64_t i = 0; i < n; ++i) acc[i] = min_of(acc[i], x[i]);
      break;
  }
}

std::string seconds_str(std::chrono::milliseconds t) {
  if (t.count() % 1000 == 0) return str_cat(t.count() / 1000, " s");
  return str_cat(t.count(), " ms");
}

}  // namespace

void reduce_into(void* acc, const void* x, int64_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kF32:
      fold(static_cast<float*>(acc), static_cast<const float*>(x), n, op);
      return;
    case DType::kF64:
      fold(static_cast<double*>(acc), static_cast<const double*>(x), n, op);
      return;
    case DType::kI32:
      fold(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), n, op);
      return;
    case DType::kI64:
      fold(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), n, op);
      return;
    case DType::kBF16:
      break;
  }
  HP_FAIL(ErrorKind::kInternal, "reduction of dtype ", dtype_name(dtype), " is not supported");
}

std::vector<int64_t> even_chunks(int64_t n, int parts) {
  HP_CHECK(parts >= 1 && n >= 0, "even_chunks(", n, ", ", parts, ")");
  std::vector<int64_t> c(static_cast<size_t>(parts), n / parts);
  for (int64_t i = 0; i < n % parts; ++i) ++c[static_cast<size_t>(i)];
  return c;
}

const char* HostCommunicator::op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllToAllV:
      return "all_to_all_v";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSendRecv:
      return "send/recv";
    case OpKind::kSplit:
      return "split";
    case OpKind::kRendezvous:
      return "rendezvous";
  }
  return "?";
}

HostCommunicator::HostCommunicator(std::string name, int rank, int size,
                                   std::vector<int> world_ranks, CommOptions options)
    : Communicator(std::move(name), rank, size, std::move(world_ranks), options) {}

HostCommunicator::Op HostCommunicator::begin(OpKind kind) const {
  if (broken()) {
    throw_error(ErrorKind::kComm, __FILE__, __LINE__,
                str_cat("rank ", world_rank(), ": ", op_name(kind), " on '", name(),
                        "': communicator unusable after an earlier failure: ", broken_reason_));
  }
  if (group_depth_ > 0) {
    HP_FAIL(ErrorKind::kInternal, op_name(kind), " on '", name(),
            "' inside group_start()/group_end(): only send and recv may be grouped");
  }
  return Op{kind, Clock::now() + timeout()};
}

void HostCommunicator::mark_broken(const std::string& reason) {
  if (broken_reason_.empty()) broken_reason_ = reason.empty() ? "broken" : reason;
}

void HostCommunicator::fail(const Op& op, const std::string& what, const char* file, int line) {
  raise(op, ": " + what, file, line);
}

void HostCommunicator::raise(const Op& op, const std::string& rest, const char* file, int line) {
  std::string msg =
      str_cat("rank ", world_rank(), ": ", op_name(op.kind), " on '", name(), "'", rest);
  if (broken_reason_.empty()) broken_reason_ = msg;
  throw_error(ErrorKind::kComm, file, line, msg);
}

void HostCommunicator::fail_timeout(const Op& op, const std::vector<int>& waiting_for,
                                    bool peers_known, const char* file, int line) {
  std::string what = str_cat(" timed out after ", seconds_str(timeout()));
  if (!waiting_for.empty()) {
    what += str_cat(" waiting for ", describe_peers(waiting_for));
  } else if (!peers_known) {
    what += " (the transport cannot tell which ranks have not arrived)";
  }
  raise(op, what, file, line);
}

std::string HostCommunicator::describe_peers(const std::vector<int>& ranks_here) const {
  std::string s = ranks_here.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks_here.size(); ++i) {
    s += str_cat(i ? ", " : "", world_rank(ranks_here[i]));
  }
  return s;
}

void HostCommunicator::check_tensor(const Op& op, const Tensor& t, bool reduction) const {
  if (!t.defined()) {
    HP_FAIL(ErrorKind::kInternal, op_name(op.kind), " on '", name(), "': undefined tensor");
  }
  if (t.device() != Device::kCPU) {
    HP_FAIL(ErrorKind::kInternal, op_name(op.kind), " on '", name(), "' moves host tensors; got ",
            t.desc());
  }
  if (reduction && t.dtype() == DType::kBF16) {
    HP_FAIL(ErrorKind::kInternal, op_name(op.kind), " on '", name(),
            "': bf16 is movement-only on host communicators (reduce in f32); got ", t.desc());
  }
}

void HostCommunicator::all_reduce(Tensor& t, ReduceOp rop) {
  Op op = begin(OpKind::kAllReduce);
  check_tensor(op, t, true);
  const int n_ranks = size();
  if (n_ranks == 1) return;
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype());
  const size_t nb = static_cast<size_t>(n) * es;
  char* data = static_cast<char*>(t.raw());

  if (n < n_ranks || nb * static_cast<size_t>(n_ranks) <= kGatherReduceBytes) {
    std::vector<char> all(nb * static_cast<size_t>(n_ranks));
    std::vector<size_t> bytes(static_cast<size_t>(n_ranks), nb), displs(bytes.size());
    for (int r = 0; r < n_ranks; ++r) displs[static_cast<size_t>(r)] = static_cast<size_t>(r) * nb;
    do_all_gather(op, data, nb, all.data(), bytes, displs);
    if (nb > 0) std::memcpy(data, all.data(), nb);  // an empty tensor may have no storage
    for (int r = 1; r < n_ranks; ++r) {
      reduce_into(data, all.data() + displs[static_cast<size_t>(r)], n, t.dtype(), rop);
    }
    return;
  }

  // Chunk r is folded by rank r, then the folded chunks are gathered back into t.
  std::vector<int64_t> chunk = even_chunks(n, n_ranks);
  std::vector<size_t> chunk_bytes(chunk.size()), chunk_displs(chunk.size());
  size_t off = 0;
  for (size_t r = 0; r < chunk.size(); ++r) {
    chunk_bytes[r] = static_cast<size_t>(chunk[r]) * es;
    chunk_displs[r] = off;
    off += chunk_bytes[r];
  }
  const int64_t mine = chunk[static_cast<size_t>(rank())];
  const size_t mine_bytes = static_cast<size_t>(mine) * es;
  std::vector<char> parts(mine_bytes * static_cast<size_t>(n_ranks));
  std::vector<size_t> part_bytes(chunk.size(), mine_bytes), part_displs(chunk.size());
  for (size_t r = 0; r < chunk.size(); ++r) part_displs[r] = r * mine_bytes;
  do_all_to_all(op, data, chunk_bytes, chunk_displs, parts.data(), part_bytes, part_displs);
  for (int r = 1; r < n_ranks; ++r) {
    reduce_into(parts.data(), parts.data() + part_displs[static_cast<size_t>(r)], mine, t.dtype(),
                rop);
  }
  do_all_gather(op, parts.data(), mine_bytes, data, chunk_bytes, chunk_displs);
}

void HostCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp rop) {
  Op op = begin(OpKind::kReduceScatter);
  check_tensor(op, in, true);
  check_tensor(op, out, true);
  const int n_ranks = size();
  if (in.dtype() != out.dtype() || in.numel() != out.numel() * n_ranks) {
    HP_FAIL(ErrorKind::kInternal, "reduce_scatter on '", name(), "' of ", n_ranks,
            " ranks needs in.numel() == ", n_ranks, " * out.numel() and equal dtypes; got in ",
            in.desc(), ", out ", out.desc());
  }
  const int64_t m = out.numel();
  const size_t mb = static_cast<size_t>(m) * dtype_size(out.dtype());
  if (n_ranks == 1) {
    if (mb > 0) std::memmove(out.raw(), in.raw(), mb);
    return;
  }
  std::vector<char> parts(mb * static_cast<size_t>(n_ranks));
  std::vector<size_t> bytes(static_cast<size_t>(n_ranks), mb), displs(bytes.size());
  for (size_t r = 0; r < displs.size(); ++r) displs[r] = r * mb;
  do_all_to_all(op, static_cast<const char*>(in.raw()), bytes, displs, parts.data(), bytes, displs);
  if (mb > 0) std::memcpy(out.raw(), parts.data(), mb);
  for (int r = 1; r < n_ranks; ++r) {
    reduce_into(out.raw(), parts.data() + displs[static_cast<size_t>(r)], m, out.dtype(), rop);
  }
}

void HostCommunicator::all_gather(const Tensor& in, Tensor& out) {
  Op op = begin(OpKind::kAllGather);
  check_tensor(op, in, false);
  check_tensor(op, out, false);
  const int n_ranks = size();
  if (in.dtype() != out.dtype() || out.numel() != in.numel() * n_ranks) {
    HP_FAIL(ErrorKind::kInternal, "all_gather on '", name(), "' of ", n_ranks,
            " ranks needs out.numel() == ", n_ranks, " * in.numel() and equal dtypes; got in ",
            in.desc(), ", out ", out.desc());
  }
  const size_t nb = in.nbytes();
  if (n_ranks == 1) {
    std::memmove(out.raw(), in.raw(), nb);
    return;
  }
  std::vector<size_t> bytes(static_cast<size_t>(n_ranks), nb), displs(bytes.size());
  for (size_t r = 0; r < displs.size(); ++r) displs[r] = r * nb;
  do_all_gather(op, static_cast<const char*>(in.raw()), nb, static_cast<char*>(out.raw()), bytes,
                displs);
}

void HostCommunicator::all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_counts,
                                    Tensor& recv, const std::vector<int64_t>& recv_counts) {
  Op op = begin(OpKind::kAllToAllV);
  check_tensor(op, send, false);
  check_tensor(op, recv, false);
  const size_t n_ranks = static_cast<size_t>(size());
  if (send_counts.size() != n_ranks || recv_counts.size() != n_ranks) {
    HP_FAIL(ErrorKind::kInternal, "all_to_all_v on '", name(), "' needs one count per rank (",
            n_ranks, "); got ", send_counts.size(), " send and ", recv_counts.size(),
            " recv counts");
  }
  if (send.ndim() < 1 || recv.ndim() < 1 || send.dtype() != recv.dtype() ||
      Shape(send.shape().begin() + 1, send.shape().end()) !=
          Shape(recv.shape().begin() + 1, recv.shape().end())) {
    HP_FAIL(ErrorKind::kInternal, "all_to_all_v on '", name(),
            "' needs send and recv of one dtype with equal trailing dimensions; got send ",
            send.desc(), ", recv ", recv.desc());
  }
  const size_t row_bytes =
      static_cast<size_t>(shape_numel(Shape(send.shape().begin() + 1, send.shape().end()))) *
      dtype_size(send.dtype());
  auto to_bytes = [&](const std::vector<int64_t>& counts, int64_t rows, const char* which,
                      std::vector<size_t>& bytes, std::vector<size_t>& displs) {
    bytes.resize(n_ranks);
    displs.resize(n_ranks);
    int64_t total = 0;
    for (size_t r = 0; r < n_ranks; ++r) {
      if (counts[r] < 0) {
        HP_FAIL(ErrorKind::kInternal, "all_to_all_v on '", name(), "': negative ", which, " count ",
                counts[r], " for rank ", r);
      }
      displs[r] = static_cast<size_t>(total) * row_bytes;
      bytes[r] = static_cast<size_t>(counts[r]) * row_bytes;
      total += counts[r];
    }
    if (total != rows) {
      HP_FAIL(ErrorKind::kInternal, "all_to_all_v on '", name(), "': ", which, " counts add up to ",
              total, " rows but the ", which, " tensor has ", rows);
    }
  };
  std::vector<size_t> sb, sd, rb, rd;
  to_bytes(send_counts, send.dim(0), "send", sb, sd);
  to_bytes(recv_counts, recv.dim(0), "recv", rb, rd);
  if (n_ranks == 1) {
    if (sb[0] != rb[0]) {
      HP_FAIL(ErrorKind::kInternal, "all_to_all_v on '", name(), "': sends ", send_counts[0],
              " rows to itself but expects ", recv_counts[0]);
    }
    std::memmove(recv.raw(), send.raw(), sb[0]);
    return;
  }
  do_all_to_all(op, static_cast<const char*>(send.raw()), sb, sd, static_cast<char*>(recv.raw()),
                rb, rd);
}

void HostCommunicator::broadcast(Tensor& t, int root) {
  Op op = begin(OpKind::kBroadcast);
  check_tensor(op, t, false);
  if (root < 0 || root >= size()) {
    HP_FAIL(ErrorKind::kInternal, "broadcast on '", name(), "' from root ", root, " of ", size(),
            " ranks");
  }
  if (size() == 1) return;
  do_broadcast(op, static_cast<char*>(t.raw()), t.nbytes(), root);
}

void HostCommunicator::barrier() {
  Op op = begin(OpKind::kBarrier);
  if (size() == 1) return;
  do_barrier(op);
}

void HostCommunicator::send(const Tensor& t, int peer) { point_to_point(t, peer, true); }

void HostCommunicator::recv(Tensor& t, int peer) { point_to_point(t, peer, false); }

void HostCommunicator::point_to_point(const Tensor& t, int peer, bool send) {
  Op op{OpKind::kSendRecv, Clock::time_point{}};
  check_tensor(op, t, false);
  if (peer < 0 || peer >= size() || peer == rank()) {
    HP_FAIL(ErrorKind::kInternal, send ? "send" : "recv", " on '", name(), "' between rank ",
            rank(), " and rank ", peer, " of ", size());
  }
  P2p p{send, peer, static_cast<char*>(t.raw()), t.nbytes()};
  if (group_depth_ > 0) {
    if (broken()) begin(OpKind::kSendRecv);  // throws
    group_ops_.push_back(p);
    group_keep_.push_back(t);
    return;
  }
  op = begin(OpKind::kSendRecv);
  do_p2p(op, {p});
}

void HostCommunicator::group_start() { ++group_depth_; }

void HostCommunicator::group_end() {
  HP_CHECK(group_depth_ > 0, "group_end() on '", name(), "' without group_start()");
  if (--group_depth_ > 0) return;
  std::vector<P2p> ops;
  ops.swap(group_ops_);
  std::vector<Tensor> keep;
  keep.swap(group_keep_);
  if (ops.empty()) return;
  Op op = begin(OpKind::kSendRecv);
  do_p2p(op, ops);
}

std::shared_ptr<Communicator> HostCommunicator::split(int color, int key, const std::string& name) {
  Op op = begin(OpKind::kSplit);
  const int n_ranks = size();
  std::vector<int> members;
  if (n_ranks == 1) {
    if (color >= 0) members.push_back(0);
    return do_split(op, color, members, name);
  }
  int64_t mine[2] = {color < 0 ? -1 : color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(n_ranks));
  std::vector<size_t> bytes(static_cast<size_t>(n_ranks), sizeof(mine)), displs(bytes.size());
  for (size_t r = 0; r < displs.size(); ++r) displs[r] = r * sizeof(mine);
  do_all_gather(op, reinterpret_cast<const char*>(mine), sizeof(mine),
                reinterpret_cast<char*>(all.data()), bytes, displs);
  if (color >= 0) {
    for (int r = 0; r < n_ranks; ++r) {
      if (all[2 * static_cast<size_t>(r)] == color) members.push_back(r);
    }
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<size_t>(a) + 1] < all[2 * static_cast<size_t>(b) + 1];
    });
  }
  return do_split(op, color, members, name);
}

}  // namespace hp
