#include "parallel/mpi_communicator.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <thread>

#include "framework/core/log.h"

namespace hp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kP2pTag = 0x4850;  // any fixed tag: this communicator carries nothing else

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return str_cat("MPI error ", rc);
  return std::string(buf, static_cast<size_t>(len));
}

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

// Polling: spin briefly (small collectives finish in microseconds), then sleep with backoff so
// that oversubscribed ranks leave the cores to the ranks still computing.
class Backoff {
 public:
  void pause() {
    if (Clock::now() - start_ < std::chrono::microseconds(500)) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  Clock::time_point start_ = Clock::now();
  std::chrono::microseconds sleep_{20};
};

}  // namespace

void mpi_fail(int rc, const char* stmt, const char* file, int line) {
  throw_error(ErrorKind::kMpi, file, line, str_cat(stmt, ": ", mpi_error_string(rc)));
}

// A failed MPI call inside an operation breaks the communicator and names the operation.
#define MPI_OP_CHECK(op, stmt)                                            \
  do {                                                                    \
    int hp_mpi_rc_ = (stmt);                                              \
    if (hp_mpi_rc_ != MPI_SUCCESS)                                        \
      HP_COMM_FAIL(op, #stmt, " failed: ", mpi_error_string(hp_mpi_rc_)); \
  } while (0)

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, int rank, int size,
                                 std::vector<int> world_ranks, CommOptions options)
    : HostCommunicator(std::move(name), rank, size, std::move(world_ranks), options), comm_(comm) {}

std::shared_ptr<MpiCommunicator> MpiCommunicator::create(MPI_Comm comm, const std::string& name,
                                                         const CommOptions& options) {
  if (!mpi_usable()) {
    HP_FAIL(ErrorKind::kMpi, "communicator '", name,
            "' needs MPI to be initialised (and not finalised): create an MpiSession first");
  }
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_CHECK(MPI_Comm_idup(comm, &dup, &req));
  const Clock::time_point deadline = Clock::now() + options.timeout;
  Backoff backoff;
  for (;;) {
    int done = 0;
    MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) break;
    if (Clock::now() >= deadline) {
      int r = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &r);
      HP_FAIL(ErrorKind::kComm, "rank ", r, ": creating communicator '", name, "' timed out after ",
              options.timeout.count(), " ms (not every rank called it)");
    }
    backoff.pause();
  }
  MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(dup, &rank));
  MPI_CHECK(MPI_Comm_size(dup, &size));
  return std::shared_ptr<MpiCommunicator>(
      new MpiCommunicator(dup, name, rank, size, world_ranks_of(dup), options));
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ == MPI_COMM_NULL || !mpi_usable()) return;
  // A pending operation can neither be cancelled nor completed: freeing the communicator, or
  // MPI_Finalize later, could wait forever. End the job instead.
  if (broken()) abort(str_cat("communicator '", name(), "' destroyed after: ", broken_reason()));
  MPI_Comm_free(&comm_);
}

std::vector<int> MpiCommunicator::world_ranks_of(MPI_Comm comm) {
  int size = 0;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Group group, world_group;
  MPI_CHECK(MPI_Comm_group(comm, &group));
  MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> here(static_cast<size_t>(size)), world(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) here[static_cast<size_t>(r)] = r;
  MPI_CHECK(MPI_Group_translate_ranks(group, size, here.data(), world_group, world.data()));
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return world;
}

void MpiCommunicator::wait(const Op& op, std::vector<MPI_Request>& requests,
                           const std::vector<int>& peers) {
  const int n = static_cast<int>(requests.size());
  std::vector<int> done(requests.size());
  std::vector<MPI_Status> statuses(requests.size());
  Backoff backoff;
  for (;;) {
    int count = 0;
    int rc = MPI_Testsome(n, requests.data(), &count, done.data(), statuses.data());
    if (rc == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < count; ++i) {
        const MPI_Status& st = statuses[static_cast<size_t>(i)];
        if (st.MPI_ERROR != MPI_SUCCESS) {
          int peer = peers[static_cast<size_t>(done[static_cast<size_t>(i)])];
          HP_COMM_FAIL(op, "message ", peer >= 0 ? str_cat("with rank ", world_rank(peer)) : "",
                       " failed: ", mpi_error_string(st.MPI_ERROR));
        }
      }
    }
    if (rc != MPI_SUCCESS) HP_COMM_FAIL(op, "MPI_Testsome failed: ", mpi_error_string(rc));
    if (count == MPI_UNDEFINED) return;  // every request has completed
    if (Clock::now() >= op.deadline) {
      std::vector<int> waiting;
      bool known = true;
      for (size_t i = 0; i < requests.size(); ++i) {
        if (requests[i] == MPI_REQUEST_NULL) continue;
        if (peers[i] < 0) {
          known = false;
        } else if (std::find(waiting.begin(), waiting.end(), peers[i]) == waiting.end()) {
          waiting.push_back(peers[i]);
        }
      }
      HP_COMM_TIMEOUT(op, waiting, known);
    }
    if (count == 0) backoff.pause();
  }
}

namespace {
int to_int(size_t v, const char* what) {
  if (v > static_cast<size_t>(INT_MAX)) {
    HP_FAIL(ErrorKind::kInternal, what, " of ", v,
            " bytes: MPI host communicators move at most 2 GiB per peer and call");
  }
  return static_cast<int>(v);
}

std::vector<int> to_ints(const std::vector<size_t>& v, const char* what) {
  std::vector<int> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_int(v[i], what);
  return out;
}
}  // namespace

void MpiCommunicator::do_all_to_all(const Op& op, const char* send,
                                    const std::vector<size_t>& send_bytes,
                                    const std::vector<size_t>& send_displs, char* recv,
                                    const std::vector<size_t>& recv_bytes,
                                    const std::vector<size_t>& recv_displs) {
  std::vector<int> sc = to_ints(send_bytes, "send count"), sd = to_ints(send_displs, "send offset");
  std::vector<int> rc = to_ints(recv_bytes, "recv count"), rd = to_ints(recv_displs, "recv offset");
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  MPI_OP_CHECK(op, MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                                  MPI_BYTE, comm_, &req[0]));
  wait(op, req, {-1});
}

void MpiCommunicator::do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                                    const std::vector<size_t>& recv_bytes,
                                    const std::vector<size_t>& recv_displs) {
  std::vector<int> rc = to_ints(recv_bytes, "gather count");
  std::vector<int> rd = to_ints(recv_displs, "gather offset");
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  MPI_OP_CHECK(op, MPI_Iallgatherv(send, to_int(bytes, "gather count"), MPI_BYTE, recv, rc.data(),
                                   rd.data(), MPI_BYTE, comm_, &req[0]));
  wait(op, req, {-1});
}

void MpiCommunicator::do_broadcast(const Op& op, char* data, size_t bytes, int root) {
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  MPI_OP_CHECK(op, MPI_Ibcast(data, to_int(bytes, "broadcast"), MPI_BYTE, root, comm_, &req[0]));
  // Not {root}: a tree broadcast may be waiting on an intermediate rank.
  wait(op, req, {-1});
}

void MpiCommunicator::do_barrier(const Op& op) {
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  MPI_OP_CHECK(op, MPI_Ibarrier(comm_, &req[0]));
  wait(op, req, {-1});
}

void MpiCommunicator::do_p2p(const Op& op, const std::vector<P2p>& ops) {
  std::vector<MPI_Request> req(ops.size(), MPI_REQUEST_NULL);
  std::vector<int> peers(ops.size());
  // Receives first, so that matching sends find them posted.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2p& p = ops[i];
      peers[i] = p.peer;
      if (!p.is_send && pass == 0) {
        MPI_OP_CHECK(op, MPI_Irecv(p.data, to_int(p.bytes, "recv"), MPI_BYTE, p.peer, kP2pTag,
                                   comm_, &req[i]));
      } else if (p.is_send && pass == 1) {
        MPI_OP_CHECK(op, MPI_Isend(p.data, to_int(p.bytes, "send"), MPI_BYTE, p.peer, kP2pTag,
                                   comm_, &req[i]));
      }
    }
  }
  wait(op, req, peers);
}

std::shared_ptr<Communicator> MpiCommunicator::do_split(const Op& op, int color,
                                                        const std::vector<int>& members,
                                                        const std::string& name) {
  // Every rank has just contributed to the colour gather, so this blocking call finds all of
  // them and returns at once.
  int key = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank()) key = static_cast<int>(i);
  }
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_OP_CHECK(op, MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
  if (sub == MPI_COMM_NULL) return nullptr;
  MPI_OP_CHECK(op, MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN));
  int r = 0, n = 0;
  MPI_OP_CHECK(op, MPI_Comm_rank(sub, &r));
  MPI_OP_CHECK(op, MPI_Comm_size(sub, &n));
  HP_CHECK(n == static_cast<int>(members.size()), "MPI split of ", n, " ranks, expected ",
           members.size());
  return std::shared_ptr<Communicator>(
      new MpiCommunicator(sub, name, r, n, world_ranks_of(sub), options()));
}

std::shared_ptr<Communicator> MpiCommunicator::split_by_host(const std::string& name) {
  Op op = begin(OpKind::kSplit);
  // A timed barrier first: once every rank is known to be here, the blocking split returns.
  if (size() > 1) do_barrier(op);
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_OP_CHECK(op, MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &sub));
  MPI_OP_CHECK(op, MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN));
  int r = 0, n = 0;
  MPI_OP_CHECK(op, MPI_Comm_rank(sub, &r));
  MPI_OP_CHECK(op, MPI_Comm_size(sub, &n));
  return std::shared_ptr<Communicator>(
      new MpiCommunicator(sub, name, r, n, world_ranks_of(sub), options()));
}

namespace {
std::atomic<int> g_abort_exit_code{1};
}  // namespace

void MpiCommunicator::set_abort_exit_code(int code) noexcept { g_abort_exit_code = code; }

void MpiCommunicator::abort(const std::string& reason) noexcept {
  try {
    log_error("rank ", world_rank(), ": aborting the job (communicator '", name(), "'): ", reason);
  } catch (...) {
  }
  if (mpi_usable()) MPI_Abort(MPI_COMM_WORLD, g_abort_exit_code.load());
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int init = 0;
  MPI_CHECK(MPI_Initialized(&init));
  if (init) return;
  int provided = 0;
  MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  owns_ = true;
}

bool mpi_thread_multiple() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return false;
  int provided = MPI_THREAD_SINGLE;
  MPI_CHECK(MPI_Query_thread(&provided));
  return provided >= MPI_THREAD_MULTIPLE;
}

MpiSession::~MpiSession() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (owns_ && !fin) MPI_Finalize();
}

}  // namespace hp
