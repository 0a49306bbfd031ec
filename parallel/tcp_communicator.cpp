#include "parallel/tcp_communicator.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <thread>

#include "framework/core/log.h"

namespace hp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kFrameMagic = 0x46545048;  // "HPTF"
constexpr uint32_t kHelloMagic = 0x4c485048;  // "HPHL"
constexpr uint32_t kProtocolVersion = 1;
constexpr uint16_t kFrameData = 1;
constexpr uint16_t kFrameAbort = 2;
constexpr size_t kMaxAbortReason = 4096;

struct FrameHeader {
  uint32_t magic;
  uint16_t kind;
  uint16_t op;
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == 16, "frame header layout");

// First message on every new connection, from the connecting side.
struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t from;
  int32_t to;
  int32_t size;
  uint32_t listen_port;  // the sender's own listener (rendezvous with rank 0 only)
  uint64_t tag;          // which mesh: 0 for the world, a per-split value otherwise
};

// The accepting side's answer.
enum AckStatus : int32_t { kAckOk = 0, kAckWrongSize = 1, kAckDuplicate = 2 };
struct Ack {
  uint32_t magic;
  int32_t from;
  int32_t status;
  int32_t detail;  // kAckWrongSize: the acceptor's world size
};

// An IPv4 endpoint as it travels in address tables (network byte order).
struct Endpoint {
  uint32_t addr;
  uint32_t port;
};

std::string errno_str(int e) { return std::strerror(e); }

int ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count() + 1, INT_MAX));
}

std::string seconds_str(std::chrono::milliseconds t) {
  if (t.count() % 1000 == 0) return str_cat(t.count() / 1000, " s");
  return str_cat(t.count(), " ms");
}

std::string endpoint_str(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return str_cat(buf, ":", ntohs(a.sin_port));
}

sockaddr_in to_sockaddr(const Endpoint& e) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = e.addr;
  a.sin_port = htons(static_cast<uint16_t>(e.port));
  return a;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Non-blocking listener on all interfaces; port 0 picks an ephemeral one. -1 and *err on failure.
int make_listener(int port, int backlog, std::string* err) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = str_cat("socket: ", errno_str(errno));
    return -1;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    *err = str_cat("bind to port ", port, ": ", errno_str(errno));
    close_fd(fd);
    return -1;
  }
  if (::listen(fd, backlog) != 0) {
    *err = str_cat("listen: ", errno_str(errno));
    close_fd(fd);
    return -1;
  }
  return fd;
}

uint32_t local_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 0;
  return ntohs(a.sin_port);
}

// The local IPv4 address of a connected socket: how peers on that network reach this host.
uint32_t local_addr(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return htonl(INADDR_LOOPBACK);
  return a.sin_addr.s_addr;
}

bool resolve_ipv4(const std::string& host, int port, sockaddr_in* out, std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    *err = str_cat("cannot resolve host '", host, "': ", gai_strerror(rc));
    return false;
  }
  *out = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  out->sin_port = htons(static_cast<uint16_t>(port));
  freeaddrinfo(res);
  return true;
}

// Non-blocking connect bounded by `deadline`. -1 and *err on failure.
int connect_to(const sockaddr_in& addr, Clock::time_point deadline, std::string* err) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = str_cat("socket: ", errno_str(errno));
    return -1;
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      *err = str_cat("connect to ", endpoint_str(addr), ": ", errno_str(errno));
      close_fd(fd);
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int n;
    do {
      n = ::poll(&p, 1, ms_until(deadline));
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      *err =
          str_cat("connect to ", endpoint_str(addr), ": ", n == 0 ? "timed out" : errno_str(errno));
      close_fd(fd);
      return -1;
    }
    int soerr = 0;
    socklen_t len = sizeof(soerr);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      *err = str_cat("connect to ", endpoint_str(addr), ": ", errno_str(soerr));
      close_fd(fd);
      return -1;
    }
  }
  set_nodelay(fd);
  return fd;
}

// Accepts one connection before `deadline`; -1 on timeout (err empty) or failure (err set).
int accept_one(int listener, Clock::time_point deadline, sockaddr_in* peer, std::string* err) {
  err->clear();
  for (;;) {
    socklen_t len = sizeof(*peer);
    int fd =
        ::accept4(listener, reinterpret_cast<sockaddr*>(peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      set_nodelay(fd);
      return fd;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *err = str_cat("accept: ", errno_str(errno));
      return -1;
    }
    int ms = ms_until(deadline);
    if (ms == 0) return -1;
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, ms) < 0 && errno != EINTR) {
      *err = str_cat("poll: ", errno_str(errno));
      return -1;
    }
  }
}

// Moves exactly n bytes on a non-blocking socket before `deadline`.
bool io_full(int fd, void* buf, size_t n, bool write, Clock::time_point deadline,
             std::string* err) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t k =
        write ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (k > 0) {
      done += static_cast<size_t>(k);
      continue;
    }
    if (k == 0 && !write) {
      *err = "the connection was closed";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *err = errno_str(errno);
      return false;
    }
    int ms = ms_until(deadline);
    if (ms == 0) {
      *err = "timed out";
      return false;
    }
    pollfd q{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    ::poll(&q, 1, ms);
  }
  return true;
}

// The host rank 0 advertises in a rendezvous file.
std::string advertised_host() {
  if (const char* h = std::getenv("HOTPATH_RENDEZVOUS_HOST")) {
    if (*h) return h;
  }
  std::string name = local_hostname();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string best = "127.0.0.1";
  if (getaddrinfo(name.c_str(), nullptr, &hints, &res) == 0) {
    for (addrinfo* a = res; a; a = a->ai_next) {
      auto* in = reinterpret_cast<sockaddr_in*>(a->ai_addr);
      if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
      best = buf;
      break;
    }
    freeaddrinfo(res);
  }
  return best;
}

// Reads "host:port\n" from a rendezvous file; false while it is absent or incomplete.
bool read_rendezvous_file(const std::string& path, std::string* host, int* port) {
  std::ifstream f(path);
  if (!f) return false;
  std::string line;
  if (!std::getline(f, line) || f.eof()) return false;  // no newline yet: not ours to read
  size_t colon = line.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  char* end = nullptr;
  long p = std::strtol(line.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535) return false;
  *host = line.substr(0, colon);
  *port = static_cast<int>(p);
  return true;
}

void write_rendezvous_file(const std::string& path, const std::string& content) {
  std::string tmp = str_cat(path, ".tmp.", ::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) {
      HP_USER_ERROR(ErrorKind::kUser, "rank 0: cannot write the rendezvous file '", tmp,
                    "' (--bootstrap=file:", path, "): ", errno_str(errno),
                    "; use a directory every rank can read and rank 0 can write");
    }
    f << content;
    f.flush();
    if (!f) {
      HP_USER_ERROR(ErrorKind::kUser, "rank 0: writing the rendezvous file '", tmp,
                    "' failed: ", errno_str(errno));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    HP_USER_ERROR(ErrorKind::kUser, "rank 0: cannot rename '", tmp, "' to the rendezvous file '",
                  path, "': ", errno_str(e));
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += str_cat(i ? ", " : "", ranks[i]);
  return s;
}

// Completes a mesh: connects to every lower rank and accepts every higher rank whose fds entry is
// still -1. addrs[j] is rank j's listener. `world_ranks` only names ranks in messages. Returns ""
// or what went wrong.
std::string build_mesh(int rank, int size, int listener, const std::vector<Endpoint>& addrs,
                       uint64_t tag, std::vector<int>& fds, Clock::time_point deadline,
                       const std::vector<int>& world_ranks) {
  for (int j = 0; j < rank; ++j) {
    if (fds[static_cast<size_t>(j)] >= 0) continue;
    sockaddr_in a = to_sockaddr(addrs[static_cast<size_t>(j)]);
    std::string err;
    int fd = connect_to(a, deadline, &err);
    if (fd < 0) return str_cat("cannot connect to rank ", world_ranks[j], ": ", err);
    Hello h{kHelloMagic, kProtocolVersion, rank, j, size, 0, tag};
    Ack ack{};
    if (!io_full(fd, &h, sizeof(h), true, deadline, &err) ||
        !io_full(fd, &ack, sizeof(ack), false, deadline, &err)) {
      close_fd(fd);
      return str_cat("handshake with rank ", world_ranks[j], ": ", err);
    }
    if (ack.magic != kHelloMagic || ack.from != j || ack.status != kAckOk) {
      close_fd(fd);
      return str_cat("rank ", world_ranks[j], " refused the connection (status ", ack.status, ")");
    }
    fds[static_cast<size_t>(j)] = fd;
  }
  auto missing = [&] {
    std::vector<int> m;
    for (int j = rank + 1; j < size; ++j) {
      if (fds[static_cast<size_t>(j)] < 0) m.push_back(world_ranks[static_cast<size_t>(j)]);
    }
    return m;
  };
  while (!missing().empty()) {
    sockaddr_in peer{};
    std::string err;
    int fd = accept_one(listener, deadline, &peer, &err);
    if (fd < 0) {
      if (!err.empty()) return err;
      return str_cat("timed out waiting for ", rank_list(missing()), " to connect");
    }
    Hello h{};
    if (!io_full(fd, &h, sizeof(h), false,
                 std::min(deadline, Clock::now() + std::chrono::seconds(10)), &err) ||
        h.magic != kHelloMagic || h.version != kProtocolVersion || h.to != rank || h.tag != tag ||
        h.size != size || h.from <= rank || h.from >= size ||
        fds[static_cast<size_t>(h.from)] >= 0) {
      close_fd(fd);  // not one of ours (or a duplicate): ignore it
      continue;
    }
    Ack ack{kHelloMagic, rank, kAckOk, 0};
    if (!io_full(fd, &ack, sizeof(ack), true, deadline, &err)) {
      close_fd(fd);
      return str_cat("handshake with rank ", world_ranks[static_cast<size_t>(h.from)], ": ", err);
    }
    fds[static_cast<size_t>(h.from)] = fd;
  }
  return "";
}

}  // namespace

// One message in flight: header and payload, sent or received.
struct TcpCommunicator::Transfer {
  int peer = 0;
  bool is_send = false;
  char* data = nullptr;
  size_t bytes = 0;
  FrameHeader header{};
  size_t done = 0;  // of sizeof(header) + bytes
  size_t total() const { return sizeof(FrameHeader) + bytes; }
};

TcpCommunicator::TcpCommunicator(std::string name, int rank, int size, std::vector<int> world_ranks,
                                 CommOptions options, std::vector<int> fds)
    : HostCommunicator(std::move(name), rank, size, std::move(world_ranks), options),
      fds_(std::move(fds)),
      dirty_(fds_.size(), 0),
      rx_partial_(fds_.size(), 0) {}

TcpCommunicator::~TcpCommunicator() { close_all(); }

void TcpCommunicator::close_all() noexcept {
  for (int& fd : fds_) {
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    close_fd(fd);
  }
}

std::shared_ptr<TcpCommunicator> TcpCommunicator::single(const CommOptions& options) {
  return std::shared_ptr<TcpCommunicator>(new TcpCommunicator("world", 0, 1, {0}, options, {-1}));
}

std::shared_ptr<TcpCommunicator> TcpCommunicator::connect_world(const Bootstrap& bootstrap,
                                                                int rank, int world,
                                                                const CommOptions& options) {
  HP_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " of ", world);
  if (world == 1) return single(options);
  HP_CHECK(bootstrap.kind == Bootstrap::Kind::kFile || bootstrap.kind == Bootstrap::Kind::kTcp,
           "TCP rendezvous needs file:PATH or tcp:HOST:PORT, got ", bootstrap.str());
  const bool by_file = bootstrap.kind == Bootstrap::Kind::kFile;
  const std::string spec = bootstrap.str();
  const Clock::time_point deadline = Clock::now() + options.timeout;
  const std::string where = str_cat("rank ", rank, ": rendezvous (", spec, ")");
  auto fail = [&](const std::string& what) {
    throw_error(ErrorKind::kComm, __FILE__, __LINE__, str_cat(where, ": ", what));
  };

  std::vector<int> fds(static_cast<size_t>(world), -1);
  std::vector<int> world_ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) world_ranks[static_cast<size_t>(r)] = r;
  struct Guard {  // closes whatever is open, and rank 0's file, when rendezvous throws
    std::vector<int>& fds;
    int listener = -1;
    std::string file;
    bool armed = true;
    ~Guard() {
      close_fd(listener);
      if (!file.empty()) std::remove(file.c_str());
      if (armed) {
        for (int& fd : fds) close_fd(fd);
      }
    }
  } guard{fds, -1, "", true};

  if (rank == 0) {
    std::string err;
    if (by_file) std::remove(bootstrap.path.c_str());  // a stale file from an earlier run
    guard.listener = make_listener(by_file ? 0 : bootstrap.port, world + 16, &err);
    if (guard.listener < 0) {
      HP_USER_ERROR(ErrorKind::kUser, where, ": rank 0 cannot listen: ", err,
                    by_file ? "" : "; choose a free port in --bootstrap=tcp:HOST:PORT");
    }
    if (by_file) {
      write_rendezvous_file(bootstrap.path,
                            str_cat(advertised_host(), ":", local_port(guard.listener), "\n"));
      guard.file = bootstrap.path;
    }
    std::vector<Endpoint> table(static_cast<size_t>(world), Endpoint{0, 0});
    int joined = 0;
    while (joined < world - 1) {
      sockaddr_in peer{};
      int fd = accept_one(guard.listener, deadline, &peer, &err);
      if (fd < 0) {
        if (!err.empty()) fail(err);
        std::vector<int> missing;
        for (int r = 1; r < world; ++r) {
          if (fds[static_cast<size_t>(r)] < 0) missing.push_back(r);
        }
        fail(str_cat("timed out after ", seconds_str(options.timeout), " waiting for ",
                     rank_list(missing), " to connect"));
      }
      Hello h{};
      if (!io_full(fd, &h, sizeof(h), false,
                   std::min(deadline, Clock::now() + std::chrono::seconds(10)), &err) ||
          h.magic != kHelloMagic || h.version != kProtocolVersion || h.to != 0 || h.tag != 0) {
        close_fd(fd);  // a stranger: keep waiting for ours
        continue;
      }
      if (h.size != world) {
        Ack ack{kHelloMagic, 0, kAckWrongSize, world};
        io_full(fd, &ack, sizeof(ack), true, deadline, &err);
        close_fd(fd);
        HP_USER_ERROR(ErrorKind::kUser, where, ": rank ", h.from, " was started with a world of ",
                      h.size, " ranks and rank 0 with ", world,
                      "; every process needs the same world size (WORLD_SIZE or SLURM_NTASKS)");
      }
      if (h.from < 1 || h.from >= world || fds[static_cast<size_t>(h.from)] >= 0) {
        Ack ack{kHelloMagic, 0, kAckDuplicate, 0};
        io_full(fd, &ack, sizeof(ack), true, deadline, &err);
        close_fd(fd);
        HP_USER_ERROR(ErrorKind::kUser, where, ": two processes claim rank ", h.from,
                      "; every process needs its own rank (RANK or SLURM_PROCID)");
      }
      Ack ack{kHelloMagic, 0, kAckOk, 0};
      if (!io_full(fd, &ack, sizeof(ack), true, deadline, &err)) {
        close_fd(fd);
        fail(str_cat("handshake with rank ", h.from, ": ", err));
      }
      fds[static_cast<size_t>(h.from)] = fd;
      table[static_cast<size_t>(h.from)] = Endpoint{peer.sin_addr.s_addr, h.listen_port};
      ++joined;
    }
    for (int r = 1; r < world; ++r) {
      if (!io_full(fds[static_cast<size_t>(r)], table.data(), table.size() * sizeof(Endpoint), true,
                   deadline, &err)) {
        fail(str_cat("sending the address table to rank ", r, ": ", err));
      }
    }
    if (by_file) std::remove(bootstrap.path.c_str());  // everyone has read it
    guard.file.clear();
  } else {
    std::string err;
    guard.listener = make_listener(0, world + 16, &err);
    if (guard.listener < 0) fail(err);
    const uint32_t my_port = local_port(guard.listener);
    std::string last_problem =
        by_file ? str_cat("'", bootstrap.path, "' never appeared")
                : str_cat("rank 0 never answered at ", bootstrap.host, ":", bootstrap.port);
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      if (Clock::now() >= deadline) {
        fail(str_cat("timed out after ", seconds_str(options.timeout), ": ", last_problem,
                     " (is rank 0 running, with the same --bootstrap?)"));
      }
      std::string host = bootstrap.host;
      int port = bootstrap.port;
      sockaddr_in addr{};
      bool have_addr = by_file ? read_rendezvous_file(bootstrap.path, &host, &port) : true;
      if (have_addr && !resolve_ipv4(host, port, &addr, &err)) {
        last_problem = err;
        have_addr = false;
      }
      if (have_addr) {
        int fd = connect_to(addr, std::min(deadline, Clock::now() + std::chrono::seconds(5)), &err);
        if (fd < 0) {
          last_problem = str_cat("cannot reach rank 0: ", err);
        } else {
          Hello h{kHelloMagic, kProtocolVersion, rank, 0, world, my_port, 0};
          Ack ack{};
          auto hs_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(30));
          if (io_full(fd, &h, sizeof(h), true, hs_deadline, &err) &&
              io_full(fd, &ack, sizeof(ack), false, hs_deadline, &err) &&
              ack.magic == kHelloMagic && ack.from == 0) {
            if (ack.status == kAckWrongSize) {
              close_fd(fd);
              HP_USER_ERROR(ErrorKind::kUser, where, ": rank 0 was started with a world of ",
                            ack.detail, " ranks and this rank with ", world,
                            "; every process needs the same world size (WORLD_SIZE or "
                            "SLURM_NTASKS)");
            }
            if (ack.status == kAckDuplicate) {
              close_fd(fd);
              HP_USER_ERROR(ErrorKind::kUser, where, ": another process already joined as rank ",
                            rank, "; every process needs its own rank (RANK or SLURM_PROCID)");
            }
            if (ack.status == kAckOk) {
              fds[0] = fd;
              break;
            }
          }
          last_problem = str_cat("rank 0 at ", endpoint_str(addr),
                                 " did not complete the handshake", err.empty() ? "" : ": ", err);
          close_fd(fd);
        }
      }
      std::this_thread::sleep_for(std::min(pause, std::chrono::milliseconds(ms_until(deadline))));
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
    }
    std::vector<Endpoint> table(static_cast<size_t>(world));
    if (!io_full(fds[0], table.data(), table.size() * sizeof(Endpoint), false, deadline, &err)) {
      fail(str_cat("receiving the address table from rank 0: ", err));
    }
    std::string mesh_err =
        build_mesh(rank, world, guard.listener, table, 0, fds, deadline, world_ranks);
    if (!mesh_err.empty()) fail(mesh_err);
  }
  guard.armed = false;
  return std::shared_ptr<TcpCommunicator>(
      new TcpCommunicator("world", rank, world, world_ranks, options, fds));
}

std::shared_ptr<Communicator> TcpCommunicator::do_split(const Op& op, int color,
                                                        const std::vector<int>& members,
                                                        const std::string& name) {
  const uint64_t split_index = ++splits_;
  if (size() == 1) {
    if (color < 0) return nullptr;
    return std::shared_ptr<Communicator>(
        new TcpCommunicator(name, 0, 1, {world_rank()}, options(), {-1}));
  }
  // Every rank of this communicator takes part in the address exchange, members or not.
  int listener = -1;
  Endpoint mine{0, 0};
  if (members.size() > 1) {
    std::string err;
    listener = make_listener(0, static_cast<int>(members.size()) + 16, &err);
    if (listener < 0) HP_COMM_FAIL(op, "building '", name, "': ", err);
    int any_peer = fds_[rank() == 0 ? 1 : 0];
    mine = Endpoint{local_addr(any_peer), local_port(listener)};
  }
  std::vector<Endpoint> all(static_cast<size_t>(size()));
  std::vector<size_t> bytes(all.size(), sizeof(Endpoint)), displs(all.size());
  for (size_t r = 0; r < displs.size(); ++r) displs[r] = r * sizeof(Endpoint);
  try {
    do_all_gather(op, reinterpret_cast<const char*>(&mine), sizeof(mine),
                  reinterpret_cast<char*>(all.data()), bytes, displs);
  } catch (...) {
    close_fd(listener);
    throw;
  }
  if (color < 0) return nullptr;
  const int n = static_cast<int>(members.size());
  int new_rank = 0;
  std::vector<int> world_ranks(members.size());
  std::vector<Endpoint> addrs(members.size());
  for (int i = 0; i < n; ++i) {
    int r = members[static_cast<size_t>(i)];
    if (r == rank()) new_rank = i;
    world_ranks[static_cast<size_t>(i)] = world_rank(r);
    addrs[static_cast<size_t>(i)] = all[static_cast<size_t>(r)];
  }
  std::vector<int> fds(members.size(), -1);
  if (n > 1) {
    // Distinct per split and colour, so a connection can never join the wrong mesh.
    const uint64_t tag = (split_index << 32) ^ static_cast<uint64_t>(color + 1);
    std::string err = build_mesh(new_rank, n, listener, addrs, tag, fds, op.deadline, world_ranks);
    close_fd(listener);
    if (!err.empty()) {
      for (int& fd : fds) close_fd(fd);
      HP_COMM_FAIL(op, "building '", name, "': ", err);
    }
  }
  return std::shared_ptr<Communicator>(
      new TcpCommunicator(name, new_rank, n, world_ranks, options(), fds));
}

// ---- the transfer engine --------------------------------------------------------------------

bool TcpCommunicator::progress_send(const Op& op, Transfer& t) {
  const int fd = fds_[static_cast<size_t>(t.peer)];
  while (t.done < t.total()) {
    iovec iov[2];
    int n = 0;
    if (t.done < sizeof(FrameHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&t.header) + t.done, sizeof(FrameHeader) - t.done};
      if (t.bytes) iov[n++] = {t.data, t.bytes};
    } else {
      size_t off = t.done - sizeof(FrameHeader);
      iov[n++] = {t.data + off, t.bytes - off};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (k > 0) {
      t.done += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (t.done > 0) dirty_[static_cast<size_t>(t.peer)] = 1;
    int e = errno;
    fail_lost_peer(op,
                   str_cat("lost the connection to rank ", world_rank(t.peer), " while sending (",
                           errno_str(e), "): it exited, crashed or aborted"));
  }
  return true;
}

void TcpCommunicator::fail_abort_message(const Op& op, int peer, size_t bytes) {
  std::string reason(std::min(bytes, kMaxAbortReason), '\0');
  std::string err;
  const int fd = fds_[static_cast<size_t>(peer)];
  if (!io_full(fd, &reason[0], reason.size(), false, Clock::now() + std::chrono::seconds(1),
               &err)) {
    reason = "(reason not received)";
  }
  HP_COMM_FAIL(op, "rank ", world_rank(peer), " aborted: ", reason);
}

void TcpCommunicator::fail_lost_peer(const Op& op, const std::string& what) {
  // One failure fans out: peers of a rank that failed first see it abort, then see each other
  // close. An abort message already waiting on any link names the first failure: report it.
  for (size_t p = 0; p < fds_.size(); ++p) {
    if (fds_[p] < 0 || rx_partial_[p]) continue;  // only links at a message boundary
    FrameHeader h{};
    ssize_t k = ::recv(fds_[p], &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
    if (k != static_cast<ssize_t>(sizeof(h)) || h.magic != kFrameMagic || h.kind != kFrameAbort) {
      continue;
    }
    if (::recv(fds_[p], &h, sizeof(h), MSG_DONTWAIT) == static_cast<ssize_t>(sizeof(h))) {
      rx_partial_[p] = 1;
      fail_abort_message(op, static_cast<int>(p), h.bytes);
    }
  }
  HP_COMM_FAIL(op, what);
}

bool TcpCommunicator::progress_recv(const Op& op, Transfer& t) {
  const int fd = fds_[static_cast<size_t>(t.peer)];
  const int peer = world_rank(t.peer);
  while (t.done < t.total()) {
    char* dst;
    size_t want;
    if (t.done < sizeof(FrameHeader)) {
      dst = reinterpret_cast<char*>(&t.header) + t.done;
      want = sizeof(FrameHeader) - t.done;
    } else {
      dst = t.data + (t.done - sizeof(FrameHeader));
      want = t.total() - t.done;
    }
    ssize_t k = ::recv(fd, dst, want, 0);
    if (k == 0) {
      rx_partial_[static_cast<size_t>(t.peer)] = 1;  // the scan below must not read this link
      fail_lost_peer(op, str_cat("rank ", peer,
                                 " closed the connection: it exited, crashed, or destroyed its "
                                 "communicator"));
    }
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      int e = errno;
      rx_partial_[static_cast<size_t>(t.peer)] = 1;
      fail_lost_peer(op, str_cat("lost the connection to rank ", peer, " (", errno_str(e),
                                 "): it exited, crashed or aborted"));
    }
    const bool header_was_partial = t.done < sizeof(FrameHeader);
    t.done += static_cast<size_t>(k);
    rx_partial_[static_cast<size_t>(t.peer)] = t.done < t.total();
    if (header_was_partial && t.done >= sizeof(FrameHeader)) {
      const FrameHeader& h = t.header;
      if (h.magic != kFrameMagic) {
        HP_COMM_FAIL(op, "received a corrupt message from rank ", peer);
      }
      if (h.kind == kFrameAbort) fail_abort_message(op, t.peer, h.bytes);
      if (h.kind != kFrameData)
        HP_COMM_FAIL(op, "unknown message kind ", h.kind, " from rank ", peer);
      if (h.op != static_cast<uint16_t>(op.kind)) {
        HP_COMM_FAIL(op, "rank ", peer, " sent a message of ", op_name(static_cast<OpKind>(h.op)),
                     ": the ranks called different operations (or in a different order)");
      }
      if (h.bytes != t.bytes) {
        HP_COMM_FAIL(op, "rank ", peer, " sent ", h.bytes, " bytes where this rank expects ",
                     t.bytes, ": sizes or counts differ between the ranks");
      }
    }
  }
  return true;
}

void TcpCommunicator::run(const Op& op, std::vector<Transfer>& transfers) {
  const size_t n_ranks = static_cast<size_t>(size());
  std::vector<std::deque<size_t>> sendq(n_ranks), recvq(n_ranks);
  for (size_t i = 0; i < transfers.size(); ++i) {
    Transfer& t = transfers[i];
    HP_CHECK(t.peer >= 0 && t.peer < size() && t.peer != rank(), "transfer with rank ", t.peer);
    if (fds_[static_cast<size_t>(t.peer)] < 0) {
      HP_COMM_FAIL(op, "no connection to rank ", world_rank(t.peer), " (closed by abort)");
    }
    if (t.is_send) {
      t.header = FrameHeader{kFrameMagic, kFrameData, static_cast<uint16_t>(op.kind), t.bytes};
      sendq[static_cast<size_t>(t.peer)].push_back(i);
    } else {
      recvq[static_cast<size_t>(t.peer)].push_back(i);
    }
  }
  size_t pending = transfers.size();
  std::vector<pollfd> pfds;
  std::vector<int> pfd_peer;
  while (pending > 0) {
    // Progress whatever the sockets accept without waiting, then wait for the rest.
    for (size_t p = 0; p < n_ranks; ++p) {
      while (!sendq[p].empty() && progress_send(op, transfers[sendq[p].front()])) {
        sendq[p].pop_front();
        --pending;
      }
      while (!recvq[p].empty() && progress_recv(op, transfers[recvq[p].front()])) {
        recvq[p].pop_front();
        --pending;
      }
    }
    if (pending == 0) break;
    pfds.clear();
    pfd_peer.clear();
    for (size_t p = 0; p < n_ranks; ++p) {
      short ev = 0;
      if (!sendq[p].empty()) ev |= POLLOUT;
      if (!recvq[p].empty()) ev |= POLLIN;
      if (ev) {
        pfds.push_back(pollfd{fds_[p], ev, 0});
        pfd_peer.push_back(static_cast<int>(p));
      }
    }
    const int ms = ms_until(op.deadline);
    if (ms == 0) {
      std::vector<int> waiting;
      for (int p : pfd_peer) {
        waiting.push_back(p);
        for (size_t i : sendq[static_cast<size_t>(p)]) {
          if (transfers[i].done > 0) dirty_[static_cast<size_t>(p)] = 1;
        }
      }
      HP_COMM_TIMEOUT(op, waiting, true);
    }
    int n = ::poll(pfds.data(), pfds.size(), ms);
    if (n < 0 && errno != EINTR) {
      int e = errno;
      HP_COMM_FAIL(op, "poll failed: ", errno_str(e));
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents & POLLNVAL) {
        HP_COMM_FAIL(op, "the connection to rank ", world_rank(pfd_peer[i]), " is not open");
      }
    }
  }
}

void TcpCommunicator::do_all_to_all(const Op& op, const char* send,
                                    const std::vector<size_t>& send_bytes,
                                    const std::vector<size_t>& send_displs, char* recv,
                                    const std::vector<size_t>& recv_bytes,
                                    const std::vector<size_t>& recv_displs) {
  const size_t me = static_cast<size_t>(rank());
  if (send_bytes[me] != recv_bytes[me]) {
    HP_FAIL(ErrorKind::kInternal, op_name(op.kind), " on '", name(), "': rank ", rank(), " sends ",
            send_bytes[me], " bytes to itself but expects ", recv_bytes[me]);
  }
  std::memmove(recv + recv_displs[me], send + send_displs[me], send_bytes[me]);
  std::vector<Transfer> t;
  t.reserve(2 * fds_.size());
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    const size_t q = static_cast<size_t>(p);
    t.push_back(Transfer{p, true, const_cast<char*>(send) + send_displs[q], send_bytes[q]});
    t.push_back(Transfer{p, false, recv + recv_displs[q], recv_bytes[q]});
  }
  run(op, t);
}

void TcpCommunicator::do_all_gather(const Op& op, const char* send, size_t bytes, char* recv,
                                    const std::vector<size_t>& recv_bytes,
                                    const std::vector<size_t>& recv_displs) {
  const size_t me = static_cast<size_t>(rank());
  std::memmove(recv + recv_displs[me], send, bytes);
  std::vector<Transfer> t;
  t.reserve(2 * fds_.size());
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    const size_t q = static_cast<size_t>(p);
    t.push_back(Transfer{p, true, const_cast<char*>(send), bytes});
    t.push_back(Transfer{p, false, recv + recv_displs[q], recv_bytes[q]});
  }
  run(op, t);
}

void TcpCommunicator::do_broadcast(const Op& op, char* data, size_t bytes, int root) {
  std::vector<Transfer> t;
  if (rank() == root) {
    for (int p = 0; p < size(); ++p) {
      if (p != root) t.push_back(Transfer{p, true, data, bytes});
    }
  } else {
    t.push_back(Transfer{root, false, data, bytes});
  }
  run(op, t);
}

void TcpCommunicator::do_barrier(const Op& op) {
  std::vector<Transfer> t;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    t.push_back(Transfer{p, true, nullptr, 0});
    t.push_back(Transfer{p, false, nullptr, 0});
  }
  run(op, t);
}

void TcpCommunicator::do_p2p(const Op& op, const std::vector<P2p>& ops) {
  std::vector<Transfer> t;
  t.reserve(ops.size());
  for (const P2p& p : ops) t.push_back(Transfer{p.peer, p.is_send, p.data, p.bytes});
  run(op, t);
}

void TcpCommunicator::abort(const std::string& reason) noexcept {
  try {
    log_error("rank ", world_rank(), ": aborting (communicator '", name(), "'): ", reason);
    mark_broken(str_cat("aborted: ", reason));
  } catch (...) {
  }
  const size_t len = std::min(reason.size(), kMaxAbortReason);
  FrameHeader h{kFrameMagic, kFrameAbort, 0, len};
  for (size_t p = 0; p < fds_.size(); ++p) {
    int fd = fds_[p];
    if (fd < 0) continue;
    if (!dirty_[p]) {
      iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(reason.data()), len}};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = 2;
      (void)::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    // Unread input would turn close() into a reset that can discard the abort message at the
    // peer: drain it, then send FIN after the message.
    char scratch[65536];
    for (int i = 0; i < 1024 && ::recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT) > 0; ++i) {
    }
    ::shutdown(fd, SHUT_WR);
  }
  close_all();
}

}  // namespace hp
