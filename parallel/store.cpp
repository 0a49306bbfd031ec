#include "parallel/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "framework/core/error.h"

namespace hp {
namespace {

std::string errno_text(int e) { return str_cat(std::strerror(e), " (errno ", e, ")"); }

std::string seconds_text(std::chrono::milliseconds t) {
  return t.count() % 1000 == 0 ? str_cat(t.count() / 1000, " s") : str_cat(t.count(), " ms");
}

// ---- wire format of the TcpStore --------------------------------------------------------
// Request: op (1 byte), argument count (u32), then each argument as u64 length + bytes.
// Response: u64 length + bytes (try_get: a found byte, then the value; check: one byte per key).
enum Op : uint8_t { kHello = 1, kSet, kGet, kCheck, kErase, kBye };

bool io_all(int fd, void* data, size_t n, bool write) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool send_bytes(int fd, const void* data, uint64_t n) {
  return io_all(fd, &n, sizeof(n), true) &&
         (n == 0 || io_all(fd, const_cast<void*>(data), n, true));
}

bool recv_bytes(int fd, Store::Bytes* out) {
  uint64_t n = 0;
  // A frame is a key or a value: anything much larger than the largest value is no client of
  // this protocol, and the connection is dropped.
  if (!io_all(fd, &n, sizeof(n), false) || n > Store::kMaxValueBytes + 4096) return false;
  out->resize(n);
  return n == 0 || io_all(fd, out->data(), n, false);
}

// connect() that gives up at `deadline` (an unreachable host would block for minutes); errno says
// why on failure. Leaves `fd` blocking.
bool connect_until(int fd, const sockaddr_in& addr,
                   std::chrono::steady_clock::time_point deadline) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  if (rc != 0 && errno == EINPROGRESS) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLOUT, 0};
    rc = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 1)));
    if (rc == 0) {
      errno = ETIMEDOUT;
      return false;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (rc < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return false;
    if (err != 0) {
      errno = err;
      return false;
    }
    rc = 0;
  }
  if (rc != 0) return false;
  ::fcntl(fd, F_SETFL, flags);
  return true;
}

std::string as_string(const Store::Bytes& b) { return std::string(b.begin(), b.end()); }
Store::Bytes as_bytes(const std::string& s) { return Store::Bytes(s.begin(), s.end()); }

}  // namespace

// ---- Store --------------------------------------------------------------------------------

void PollBackoff::sleep() {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
  ms_ = std::min(ms_ * 2, 16);
}

void Store::check_value_size(const std::string& key, size_t bytes) const {
  if (bytes <= kMaxValueBytes) return;
  HP_FAIL(ErrorKind::kInternal, "rank ", rank_, ": store ", where_, ": value of key '", key,
          "' is ", bytes, " bytes, over the store's bound of ", kMaxValueBytes,
          " bytes: the store carries control messages, never tensors (tensors move over NCCL or "
          "MPI)");
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  PollBackoff backoff;
  for (;;) {
    const std::vector<bool> have = check(keys);
    std::string missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!have[i]) missing += str_cat(missing.empty() ? "" : ", ", "'", keys[i], "'");
    }
    if (missing.empty()) return;
    if (Clock::now() >= deadline) {
      HP_FAIL(ErrorKind::kComm, "rank ", rank_, ": store (", where_, ") timed out after ",
              seconds_text(timeout), " waiting for key",
              missing.find(',') == std::string::npos ? " " : "s ", missing);
    }
    backoff.sleep();
  }
}

Store::Bytes Store::get(const std::string& key, std::chrono::milliseconds timeout) {
  Bytes v;
  if (try_get(key, &v)) return v;
  wait({key}, timeout);
  HP_CHECK(try_get(key, &v), "store key '", key, "' vanished between wait and read");
  return v;
}

// ---- FileStore ----------------------------------------------------------------------------

FileStore::FileStore(std::string dir, int rank) : Store(rank, "file:" + dir), dir_(std::move(dir)) {
  while (!dir_.empty() && dir_.back() == '/') dir_.pop_back();
  // mkdir -p
  for (size_t i = 1; i <= dir_.size(); ++i) {
    if (i < dir_.size() && dir_[i] != '/') continue;
    const std::string part = dir_.substr(0, i);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      HP_FAIL(ErrorKind::kIo, "rank ", rank, ": store directory ", dir_, ": cannot create ", part,
              ": ", errno_text(errno));
    }
  }
  if (::access(dir_.c_str(), W_OK | X_OK) != 0) {
    HP_FAIL(ErrorKind::kIo, "rank ", rank, ": store directory ", dir_,
            " is not writable: ", errno_text(errno));
  }
}

std::string FileStore::path_of(const std::string& key) const {
  HP_CHECK(!key.empty(), "empty store key");
  // Keys become one file name each: letters, digits, '-', '_' and inner '.' stay, everything
  // else (the '/' of namespaces) becomes %XX. Temporary files start with '.', keys never do.
  std::string name;
  for (size_t i = 0; i < key.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (std::isalnum(c) || c == '-' || c == '_' || (c == '.' && i > 0)) {
      name += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789ABCDEF";
      name += '%';
      name += hex[c >> 4];
      name += hex[c & 15];
    }
  }
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const Bytes& value) {
  check_value_size(key, value.size());
  const std::string path = path_of(key);
  // Unique among the ranks of every host: a random tag drawn once per process, and a counter.
  static const uint64_t tag = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ ::getpid();
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = str_cat(dir_, "/.tmp.", std::hex, tag, ".", counter++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    HP_FAIL(ErrorKind::kIo, "rank ", rank(), ": store: cannot create ", tmp, ": ",
            errno_text(errno));
  const char* p = reinterpret_cast<const char*>(value.data());
  size_t left = value.size();
  bool ok = true;
  while (ok && left > 0) {
    ssize_t k = ::write(fd, p, left);
    if (k < 0 && errno == EINTR) continue;
    ok = k > 0;
    if (ok) {
      p += k;
      left -= static_cast<size_t>(k);
    }
  }
  const int err = errno;
  if (::close(fd) != 0 && ok) ok = false;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = ok ? errno : err;
    ::unlink(tmp.c_str());
    HP_FAIL(ErrorKind::kIo, "rank ", rank(), ": store: cannot write key '", key, "' to ", path,
            ": ", errno_text(e));
  }
}

bool FileStore::try_get(const std::string& key, Bytes* value) {
  const std::string path = path_of(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return false;
    HP_FAIL(ErrorKind::kIo, "rank ", rank(), ": store: cannot read key '", key, "' from ", path,
            ": ", errno_text(errno));
  }
  Bytes out;
  char buf[65536];
  for (;;) {
    ssize_t k = ::read(fd, buf, sizeof(buf));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int e = errno;
      ::close(fd);
      HP_FAIL(ErrorKind::kIo, "rank ", rank(), ": store: cannot read ", path, ": ", errno_text(e));
    }
    if (k == 0) break;
    out.insert(out.end(), buf, buf + k);
  }
  ::close(fd);
  *value = std::move(out);
  return true;
}

std::vector<bool> FileStore::check(const std::vector<std::string>& keys) {
  std::vector<bool> have(keys.size());
  struct stat st;
  for (size_t i = 0; i < keys.size(); ++i) have[i] = ::stat(path_of(keys[i]).c_str(), &st) == 0;
  return have;
}

void FileStore::erase(const std::string& key) { ::unlink(path_of(key).c_str()); }

// ---- TcpStore -----------------------------------------------------------------------------

// Rank 0's table and the thread that serves it.
struct TcpStore::Server {
  struct Client {
    int fd = -1;
    int rank = -1;  // from kHello
  };

  std::mutex mu;  // guards kv
  std::map<std::string, Bytes> kv;
  int listen_fd = -1;
  std::chrono::milliseconds linger{0};
  std::atomic<bool> stop{false};
  std::thread thread;

  void set_lost(int rank) {
    std::lock_guard<std::mutex> lk(mu);
    if (kv.count(kLostKey)) return;
    kv[kLostKey] = as_bytes(str_cat("rank ", rank,
                                    " closed the connection to the store without leaving (it "
                                    "exited, crashed or aborted)"));
  }

  // Serves one request of `c`; false when the client is gone (left or lost).
  bool serve_one(Client& c) {
    uint8_t op = 0;
    uint32_t n = 0;
    if (!io_all(c.fd, &op, 1, false)) {
      if (c.rank > 0) set_lost(c.rank);
      return false;
    }
    if (op == kBye) return false;
    std::vector<Bytes> args;
    bool ok = io_all(c.fd, &n, sizeof(n), false) && n < (1u << 20);
    for (uint32_t i = 0; ok && i < n; ++i) {
      args.emplace_back();
      ok = recv_bytes(c.fd, &args.back());
    }
    if (!ok) {
      if (c.rank > 0) set_lost(c.rank);
      return false;
    }
    Bytes reply;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (op == kHello && n == 1) {
        c.rank = std::atoi(as_string(args[0]).c_str());
      } else if (op == kSet && n == 2) {
        kv[as_string(args[0])] = std::move(args[1]);
      } else if (op == kGet && n == 1) {
        auto it = kv.find(as_string(args[0]));
        reply.push_back(it != kv.end());
        if (it != kv.end()) reply.insert(reply.end(), it->second.begin(), it->second.end());
      } else if (op == kCheck) {
        for (const Bytes& k : args) reply.push_back(kv.count(as_string(k)) != 0);
      } else if (op == kErase && n == 1) {
        kv.erase(as_string(args[0]));
      } else {
        return false;  // not a hotpath store client
      }
    }
    return send_bytes(c.fd, reply.data(), reply.size());
  }

  void loop() {
    std::vector<Client> clients;
    Clock::time_point stop_at{};
    for (;;) {
      if (stop) {
        if (stop_at == Clock::time_point{}) stop_at = Clock::now() + linger;
        if (clients.empty() || Clock::now() >= stop_at) break;
      }
      std::vector<pollfd> fds;
      fds.push_back({listen_fd, POLLIN, 0});
      for (const Client& c : clients) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 50) < 0 && errno != EINTR) break;
      std::vector<Client> kept;
      for (size_t i = 0; i < clients.size(); ++i) {
        if (fds[i + 1].revents == 0 || serve_one(clients[i])) {
          kept.push_back(clients[i]);
        } else {
          ::close(clients[i].fd);
        }
      }
      clients.swap(kept);
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          // A client that stalls mid-request must not stall the others forever.
          timeval tv{30, 0};
          setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
          clients.push_back({fd, -1});
        }
      }
    }
    for (const Client& c : clients) ::close(c.fd);
  }
};

TcpStore::TcpStore(int rank, std::string where, int port)
    : Store(rank, std::move(where)), port_(port) {}

std::shared_ptr<TcpStore> TcpStore::serve(int port, std::chrono::milliseconds linger) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) HP_FAIL(ErrorKind::kComm, "rank 0: store: socket: ", errno_text(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 1024) != 0) {
    const int e = errno;
    ::close(fd);
    HP_USER_ERROR(ErrorKind::kUser, "rank 0: the store cannot listen on port ", port, ": ",
                  errno_text(e), "; pick a free port in tcp:HOST:PORT");
  }
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int bound = ntohs(a.sin_port);
  std::shared_ptr<TcpStore> s(new TcpStore(0, str_cat("tcp:*:", bound), bound));
  s->server_ = std::make_unique<Server>();
  s->server_->listen_fd = fd;
  s->server_->linger = linger;
  Server* srv = s->server_.get();
  s->server_->thread = std::thread([srv] { srv->loop(); });
  return s;
}

std::shared_ptr<TcpStore> TcpStore::connect(const std::string& host, int port, int rank,
                                            std::chrono::milliseconds timeout) {
  const std::string where = str_cat("tcp:", host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    HP_USER_ERROR(ErrorKind::kUser, "rank ", rank, ": store ", where, ": cannot resolve host '",
                  host, "': ", gai_strerror(rc), "; give rank 0's host name or address");
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));

  const auto deadline = Clock::now() + timeout;
  PollBackoff backoff;
  std::string last;
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) HP_FAIL(ErrorKind::kComm, "rank ", rank, ": store: socket: ", errno_text(errno));
    if (connect_until(fd, addr, deadline)) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      const auto ms = std::max<int64_t>(timeout.count(), 1000);
      timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>(ms % 1000 * 1000)};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      std::shared_ptr<TcpStore> s(new TcpStore(rank, where, port));
      s->fd_ = fd;
      const Bytes r = as_bytes(std::to_string(rank));
      std::lock_guard<std::mutex> lk(s->mu_);
      s->call(kHello, {&r});
      return s;
    }
    last = errno_text(errno);
    ::close(fd);
    if (Clock::now() >= deadline) {
      HP_FAIL(ErrorKind::kComm, "rank ", rank, ": store ", where, ": no server after ",
              seconds_text(timeout), " (last attempt: ", last,
              "); is rank 0 running with the same tcp:HOST:PORT?");
    }
    backoff.sleep();
  }
}

void TcpStore::linger(std::chrono::milliseconds bound) {
  if (!server_ || !server_->thread.joinable()) return;
  server_->linger = std::min(server_->linger, bound);
  server_->stop = true;
  server_->thread.join();
}

TcpStore::~TcpStore() {
  if (server_) {
    server_->stop = true;
    if (server_->thread.joinable()) server_->thread.join();
    ::close(server_->listen_fd);
  }
  if (fd_ >= 0) {
    const uint8_t bye = kBye;
    (void)::send(fd_, &bye, 1, MSG_NOSIGNAL);
    ::close(fd_);
  }
}

TcpStore::Bytes TcpStore::call(uint8_t op, const std::vector<const Bytes*>& args) {
  const uint32_t n = static_cast<uint32_t>(args.size());
  bool ok = io_all(fd_, &op, 1, true) && io_all(fd_, const_cast<uint32_t*>(&n), sizeof(n), true);
  for (const Bytes* a : args) ok = ok && send_bytes(fd_, a->data(), a->size());
  Bytes reply;
  if (!ok || !recv_bytes(fd_, &reply)) {
    HP_FAIL(ErrorKind::kComm, "rank ", rank(), ": store ", where(),
            ": lost the connection to the store on rank 0 (", errno_text(errno),
            "): it exited, crashed or aborted");
  }
  return reply;
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  check_value_size(key, value.size());
  if (server_) {
    std::lock_guard<std::mutex> lk(server_->mu);
    server_->kv[key] = value;
    return;
  }
  const Bytes k = as_bytes(key);
  std::lock_guard<std::mutex> lk(mu_);
  call(kSet, {&k, &value});
}

bool TcpStore::try_get(const std::string& key, Bytes* value) {
  if (server_) {
    std::lock_guard<std::mutex> lk(server_->mu);
    auto it = server_->kv.find(key);
    if (it == server_->kv.end()) return false;
    *value = it->second;
    return true;
  }
  const Bytes k = as_bytes(key);
  Bytes r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    r = call(kGet, {&k});
  }
  if (r.empty() || r[0] == 0) return false;
  value->assign(r.begin() + 1, r.end());
  return true;
}

std::vector<bool> TcpStore::check(const std::vector<std::string>& keys) {
  std::vector<bool> have(keys.size());
  if (server_) {
    std::lock_guard<std::mutex> lk(server_->mu);
    for (size_t i = 0; i < keys.size(); ++i) have[i] = server_->kv.count(keys[i]) != 0;
    return have;
  }
  std::vector<Bytes> ks;
  for (const std::string& k : keys) ks.push_back(as_bytes(k));
  std::vector<const Bytes*> args;
  for (const Bytes& k : ks) args.push_back(&k);
  Bytes r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    r = call(kCheck, args);
  }
  for (size_t i = 0; i < keys.size() && i < r.size(); ++i) have[i] = r[i] != 0;
  return have;
}

void TcpStore::erase(const std::string& key) {
  if (server_) {
    std::lock_guard<std::mutex> lk(server_->mu);
    server_->kv.erase(key);
    return;
  }
  const Bytes k = as_bytes(key);
  std::lock_guard<std::mutex> lk(mu_);
  call(kErase, {&k});
}

// ---- HashStore ----------------------------------------------------------------------------

std::shared_ptr<HashStore> HashStore::handle(int rank) const {
  auto h = std::make_shared<HashStore>(rank);
  h->table_ = table_;
  return h;
}

void HashStore::set(const std::string& key, const Bytes& value) {
  check_value_size(key, value.size());
  std::lock_guard<std::mutex> lk(table_->mu);
  table_->kv[key] = value;
}

bool HashStore::try_get(const std::string& key, Bytes* value) {
  std::lock_guard<std::mutex> lk(table_->mu);
  auto it = table_->kv.find(key);
  if (it == table_->kv.end()) return false;
  *value = it->second;
  return true;
}

std::vector<bool> HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lk(table_->mu);
  std::vector<bool> have(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) have[i] = table_->kv.count(keys[i]) != 0;
  return have;
}

void HashStore::erase(const std::string& key) {
  std::lock_guard<std::mutex> lk(table_->mu);
  table_->kv.erase(key);
}

}  // namespace hp
