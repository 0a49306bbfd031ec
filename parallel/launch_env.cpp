#include "parallel/launch_env.h"

#include <arpa/inet.h>
#include <mpi.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "parallel/mpi_communicator.h"
#include "parallel/store_communicator.h"

namespace hp {
namespace {

// Reads launcher variables with errors that name them.
class EnvReader {
 public:
  EnvReader(const EnvLookup& env, const char* method) : env_(env), method_(method) {}

  const char* raw(const char* name) const { return env_(name); }
  bool has(const char* name) const { return env_(name) != nullptr; }

  int integer(const char* name) const {
    const char* v = env_(name);
    HP_CHECK(v != nullptr, name, " unset");
    errno = 0;
    char* end = nullptr;
    long x = std::strtol(v, &end, 10);
    if (!std::isdigit(static_cast<unsigned char>(v[0])) || *end != '\0' || errno == ERANGE ||
        x > INT_MAX) {
      HP_USER_ERROR(ErrorKind::kConfig, "launch environment (", method_, "): ", name, "='", v,
                    "' is not a non-negative integer");
    }
    return static_cast<int>(x);
  }

  // `name`, or the first of the alternatives that is set; error naming all of them otherwise.
  int required(const char* name, const char* why, const char* alt = nullptr) const {
    if (has(name)) return integer(name);
    if (alt && has(alt)) return integer(alt);
    HP_USER_ERROR(ErrorKind::kConfig, "launch environment (", method_, "): ", why, " but ", name,
                  alt ? str_cat(" (or ", alt, ")") : std::string(), " is not set");
  }

  int optional(const char* name, int fallback) const {
    return has(name) ? integer(name) : fallback;
  }

 private:
  const EnvLookup& env_;
  const char* method_;
};

void validate(const LaunchInfo& info, const char* rank_var, const char* world_var,
              const char* local_var, const char* local_world_var) {
  auto fail = [&](const std::string& what) {
    HP_USER_ERROR(ErrorKind::kConfig, "launch environment (", info.method, "): ", what);
  };
  if (info.world < 1) fail(str_cat(world_var, "=", info.world, " must be at least 1"));
  if (info.rank >= info.world) {
    fail(str_cat(rank_var, "=", info.rank, " must be less than ", world_var, "=", info.world));
  }
  if (info.local_world > info.world) {
    fail(str_cat(local_world_var, "=", info.local_world, " exceeds ", world_var, "=", info.world));
  }
  if (info.local_world > 0 && info.local_rank >= info.local_world) {
    fail(str_cat(local_var, "=", info.local_rank, " must be less than ", local_world_var, "=",
                 info.local_world));
  }
}

// ---- file bootstrap ---------------------------------------------------------------------------
// PATH only publishes where rank 0 serves the job's TcpStore: the messages themselves go over TCP,
// because shared file systems such as NFS may hide a new file from other hosts for many seconds
// (cached lookups of missing names), which a rendezvous tolerates once but a step cannot.

// The host rank 0 advertises: HOTPATH_RENDEZVOUS_HOST, else the first non-loopback IPv4 address
// of this host's name.
std::string advertised_host() {
  if (const char* h = std::getenv("HOTPATH_RENDEZVOUS_HOST")) {
    if (*h) return h;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string best = "127.0.0.1";
  if (getaddrinfo(local_hostname().c_str(), nullptr, &hints, &res) == 0) {
    for (addrinfo* a = res; a; a = a->ai_next) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
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

// PATH's first line, "HOST:PORT RUN"; "" while PATH is absent or not completely written.
std::string read_address(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line) || f.eof()) return "";  // no newline yet: not ours to read
  return line;
}

// RUN tells this job's store from another one that happens to serve at the same address later.
bool split_address(const std::string& line, std::string* host, int* port, std::string* run) {
  const size_t space = line.find(' ');
  if (space == std::string::npos) return false;
  *run = line.substr(space + 1);
  const std::string addr = line.substr(0, space);
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  char* end = nullptr;
  const long p = std::strtol(addr.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535) return false;
  *host = addr.substr(0, colon);
  *port = static_cast<int>(p);
  return true;
}

std::shared_ptr<Communicator> file_world(const LaunchInfo& info, const std::string& path,
                                         const CommOptions& options) {
  using Clock = std::chrono::steady_clock;
  if (info.rank == 0) {
    auto store = TcpStore::serve(0, options.timeout);
    std::random_device rd;
    const std::string run = str_cat(std::hex, rd(), rd(), "-", std::dec, ::getpid());
    store->set("run", Store::Bytes(run.begin(), run.end()));
    const std::string tmp = str_cat(path, ".tmp.", run);
    {
      std::ofstream f(tmp);
      f << advertised_host() << ":" << store->port() << " " << run << "\n";
      if (!f.flush()) {
        HP_USER_ERROR(ErrorKind::kUser, "rank 0: bootstrap file:", path, ": cannot write ", tmp,
                      ": give a path on a writable file system that every rank sees");
      }
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      HP_USER_ERROR(ErrorKind::kUser, "rank 0: bootstrap file:", path,
                    ": cannot create it: ", std::strerror(e));
    }
    try {
      auto world = StoreCommunicator::create_world(store, 0, info.world, options);
      ::unlink(path.c_str());
      return world;
    } catch (...) {
      ::unlink(path.c_str());
      throw;
    }
  }
  // The address may be stale (an earlier job's rank 0 died during its rendezvous): a failed
  // connection, or a PATH that changes while this rank waits for rank 0, means read it again.
  const auto deadline = Clock::now() + options.timeout;
  PollBackoff backoff;
  std::string addr;
  for (;;) {
    addr = read_address(path);
    std::string host, run;
    int port = 0;
    if (split_address(addr, &host, &port, &run)) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::shared_ptr<TcpStore> store;
      try {
        store = TcpStore::connect(
            host, port, info.rank,
            std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(1000)));
        Store::Bytes theirs;
        if (!store->try_get("run", &theirs) || std::string(theirs.begin(), theirs.end()) != run) {
          store.reset();  // another job's store
        }
      } catch (const Error&) {
        store.reset();  // nobody serves there (yet); read PATH again
      }
      if (store) {
        CommOptions rest = options;
        rest.timeout = std::max(left, std::chrono::milliseconds(1));
        auto world = StoreCommunicator::create_world(store, info.rank, info.world, rest, [&] {
          const std::string now = read_address(path);
          return !now.empty() && now != addr;
        });
        if (world) return world;
        continue;  // rank 0 of a newer run rewrote PATH
      }
    }
    if (Clock::now() >= deadline) {
      HP_FAIL(ErrorKind::kComm, "rank ", info.rank, ": rendezvous (file:", path,
              ") timed out after ", options.timeout.count() / 1000.0, " s: ",
              addr.empty() ? path + " never appeared (rank 0 writes it when it starts)"
                           : str_cat("no store of this run at ", addr.substr(0, addr.find(' ')),
                                     ", the address in ", path),
              "; is rank 0 running with the same file: path?");
    }
    backoff.sleep();
  }
}

}  // namespace

std::string LaunchInfo::describe() const {
  return str_cat("rank ", rank, " of ", world, " (local ", local_rank,
                 local_world > 0 ? str_cat(" of ", local_world) : std::string(), ") via ", method);
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id) {
  // Items "N" or "N(xM)", comma-separated.
  if (node_id < 0) return 0;
  int node = 0;
  size_t i = 0;
  const std::string& s = tasks_per_node;
  while (i < s.size()) {
    size_t j = i;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    if (j == i) return 0;
    int tasks = std::atoi(s.substr(i, j - i).c_str());
    int repeat = 1;
    if (j < s.size() && s[j] == '(') {
      if (j + 1 >= s.size() || s[j + 1] != 'x') return 0;
      size_t k = j + 2;
      size_t m = k;
      while (m < s.size() && std::isdigit(static_cast<unsigned char>(s[m]))) ++m;
      if (m == k || m >= s.size() || s[m] != ')') return 0;
      repeat = std::atoi(s.substr(k, m - k).c_str());
      j = m + 1;
    }
    if (node_id < node + repeat) return tasks;
    node += repeat;
    if (j < s.size()) {
      if (s[j] != ',') return 0;
      ++j;
    }
    i = j;
  }
  return 0;
}

LaunchInfo detect_launch() {
  return detect_launch([](const char* name) -> const char* { return std::getenv(name); });
}

LaunchInfo detect_launch(const EnvLookup& env) {
  LaunchInfo info;
  // Open MPI's singleton start (MPI_Init without a launcher) sets PMIx variables of a world of
  // one; it says nothing about how the process was launched.
  const char* ess = env("OMPI_MCA_ess");
  const bool singleton = ess && std::strcmp(ess, "singleton") == 0;

  if (!singleton && env("OMPI_COMM_WORLD_RANK")) {
    info.method = "mpirun";
    info.use_mpi = true;
    EnvReader e(env, "mpirun");
    const char* why = "OMPI_COMM_WORLD_RANK is set";
    info.rank = e.integer("OMPI_COMM_WORLD_RANK");
    info.world = e.required("OMPI_COMM_WORLD_SIZE", why);
    info.local_rank = e.required("OMPI_COMM_WORLD_LOCAL_RANK", why);
    info.local_world = e.optional("OMPI_COMM_WORLD_LOCAL_SIZE", 0);
    validate(info, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
    return info;
  }
  if (!singleton && env("PMIX_RANK") && env("SLURM_PROCID")) {
    info.method = "srun-pmix";
    info.use_mpi = true;
    EnvReader e(env, "srun-pmix");
    const char* why = "PMIX_RANK and SLURM_PROCID are set";
    info.rank = e.integer("PMIX_RANK");
    int procid = e.integer("SLURM_PROCID");
    if (procid != info.rank) {
      HP_USER_ERROR(ErrorKind::kConfig, "launch environment (srun-pmix): PMIX_RANK=", info.rank,
                    " differs from SLURM_PROCID=", procid);
    }
    info.world = e.required("SLURM_NTASKS", why, "SLURM_NPROCS");
    info.local_rank = e.required("SLURM_LOCALID", why);
    const char* tpn = env("SLURM_TASKS_PER_NODE");
    if (tpn && env("SLURM_NODEID")) {
      info.local_world = slurm_tasks_on_node(tpn, e.integer("SLURM_NODEID"));
    }
    validate(info, "PMIX_RANK", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");
    return info;
  }
  if (env("RANK") || env("WORLD_SIZE")) {
    info.method = "env";
    EnvReader e(env, "env");
    const char* why = env("RANK") ? "RANK is set" : "WORLD_SIZE is set";
    info.rank = e.required("RANK", why);
    info.world = e.required("WORLD_SIZE", why);
    info.local_rank = e.required("LOCAL_RANK", why);
    info.local_world = e.optional("LOCAL_WORLD_SIZE", 0);
    validate(info, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    return info;
  }
  if (env("SLURM_PROCID")) {
    info.method = "slurm-env";
    EnvReader e(env, "slurm-env");
    const char* why = "SLURM_PROCID is set";
    info.rank = e.integer("SLURM_PROCID");
    info.world = e.required("SLURM_NTASKS", why, "SLURM_NPROCS");
    info.local_rank = e.required("SLURM_LOCALID", why);
    const char* tpn = env("SLURM_TASKS_PER_NODE");
    if (tpn && env("SLURM_NODEID")) {
      info.local_world = slurm_tasks_on_node(tpn, e.integer("SLURM_NODEID"));
    }
    validate(info, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");
    return info;
  }
  info.local_world = 1;
  return info;
}

std::string Bootstrap::str() const {
  switch (kind) {
    case Kind::kMpi:
      return "mpi";
    case Kind::kFile:
      return "file:" + path;
    case Kind::kTcp:
      return str_cat("tcp:", host, ":", port);
    case Kind::kSingle:
      return "single";
  }
  return "?";
}

Bootstrap parse_bootstrap(const std::string& spec) {
  const char* valid =
      "expected mpi, file:PATH (a file on a file system every rank sees) or "
      "tcp:HOST:PORT (rank 0's host and a free port)";
  Bootstrap b;
  if (spec == "mpi") {
    b.kind = Bootstrap::Kind::kMpi;
    return b;
  }
  if (spec.rfind("file:", 0) == 0) {
    b.kind = Bootstrap::Kind::kFile;
    b.path = spec.substr(5);
    if (b.path.empty()) {
      HP_USER_ERROR(ErrorKind::kUser, "bootstrap '", spec, "' has no path: ", valid);
    }
    return b;
  }
  if (spec.rfind("tcp:", 0) == 0) {
    b.kind = Bootstrap::Kind::kTcp;
    std::string rest = spec.substr(4);
    size_t colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      HP_USER_ERROR(ErrorKind::kUser, "bootstrap '", spec, "' needs a host and a port: ", valid);
    }
    b.host = rest.substr(0, colon);
    std::string port = rest.substr(colon + 1);
    errno = 0;
    char* end = nullptr;
    long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || errno == ERANGE || p < 1 || p > 65535) {
      HP_USER_ERROR(ErrorKind::kUser, "bootstrap '", spec, "': port '", port,
                    "' is not an integer in 1..65535");
    }
    b.port = static_cast<int>(p);
    return b;
  }
  HP_USER_ERROR(ErrorKind::kUser, "unknown bootstrap '", spec, "': ", valid);
}

Bootstrap default_bootstrap(const LaunchInfo& info) {
  Bootstrap b;
  if (info.use_mpi) {
    b.kind = Bootstrap::Kind::kMpi;
  } else if (info.world == 1) {
    b.kind = Bootstrap::Kind::kSingle;
  } else {
    HP_USER_ERROR(ErrorKind::kUser, info.describe(),
                  " was started without MPI, so the ranks need a meeting point: give a bootstrap, "
                  "file:PATH (a file on a file system every rank sees) or tcp:HOST:PORT (rank "
                  "0's host and a free port)");
  }
  return b;
}

Bootstrap choose_bootstrap(const LaunchInfo& info, const std::optional<Bootstrap>& given,
                           bool cpu_backend) {
  if (!cpu_backend || info.world == 1) return given ? *given : default_bootstrap(info);
  const Bootstrap b = !given && info.use_mpi ? default_bootstrap(info)
                      : !given               ? Bootstrap{}
                                             : *given;
  if (b.kind != Bootstrap::Kind::kMpi) {
    HP_USER_ERROR(ErrorKind::kUser, info.describe(),
                  ": the cpu backend moves tensors between ranks over MPI",
                  !given ? std::string(", and this launch has none")
                         : str_cat(", which --bootstrap=", given->str(),
                                         " does not give (file: and tcp: carry only the NCCL ids "
                                         "of GPU runs)"),
                  ": launch with mpirun (mpirun -np ", info.world,
                  " hotpath ...) or srun --mpi=pmix, or train on GPUs (device=cuda)");
  }
  return b;
}

std::shared_ptr<Communicator> create_world(const LaunchInfo& info, const Bootstrap& bootstrap,
                                           const CommOptions& options) {
  switch (bootstrap.kind) {
    case Bootstrap::Kind::kSingle:
      if (info.world != 1) {
        HP_USER_ERROR(ErrorKind::kUser, "bootstrap 'single' is for one process; this is ",
                      info.describe());
      }
      return StoreCommunicator::single(options);
    case Bootstrap::Kind::kMpi: {
      int init = 0, fin = 0;
      MPI_Initialized(&init);
      MPI_Finalized(&fin);
      if (!init || fin) {
        if (!info.use_mpi && info.world > 1) {
          HP_USER_ERROR(ErrorKind::kUser,
                        "bootstrap 'mpi' needs an MPI launcher (mpirun, or srun "
                        "--mpi=pmix); ",
                        info.describe(),
                        " was not started by one: use "
                        "file:PATH or tcp:HOST:PORT");
        }
        HP_FAIL(ErrorKind::kMpi,
                "bootstrap 'mpi': MPI is not initialised (create an MpiSession "
                "before create_world)");
      }
      auto world = MpiCommunicator::create(MPI_COMM_WORLD, "world", options);
      if (world->size() != info.world || world->rank() != info.rank) {
        HP_USER_ERROR(ErrorKind::kUser, "bootstrap 'mpi': MPI says rank ", world->rank(), " of ",
                      world->size(), " but the launch environment says ", info.describe(),
                      info.use_mpi ? std::string()
                                   : std::string("; without an MPI launcher every process is its "
                                                 "own MPI world: use srun --mpi=pmix or mpirun, or "
                                                 "a file:PATH or tcp:HOST:PORT bootstrap"));
      }
      return world;
    }
    case Bootstrap::Kind::kFile:
      if (info.world == 1) return StoreCommunicator::single(options);
      return file_world(info, bootstrap.path, options);
    case Bootstrap::Kind::kTcp: {
      if (info.world == 1) return StoreCommunicator::single(options);
      std::shared_ptr<Store> store;
      if (info.rank == 0) {
        store = TcpStore::serve(bootstrap.port, options.timeout);
      } else {
        store = TcpStore::connect(bootstrap.host, bootstrap.port, info.rank, options.timeout);
      }
      return StoreCommunicator::create_world(store, info.rank, info.world, options);
    }
  }
  HP_FAIL(ErrorKind::kInternal, "unknown bootstrap kind");
}

std::vector<uint8_t> share_blob(Communicator& comm, const std::vector<uint8_t>& blob, int root) {
  const bool is_root = comm.rank() == root;
  Tensor len = Tensor::host_from(
      std::vector<int64_t>{is_root ? static_cast<int64_t>(blob.size()) : 0}, DType::kI64);
  comm.broadcast(len, root);
  const int64_t n = len.data<int64_t>()[0];
  Tensor buf = Tensor::host({std::max<int64_t>(1, (n + 7) / 8)}, DType::kI64);
  if (is_root && n > 0) std::memcpy(buf.raw(), blob.data(), blob.size());
  comm.broadcast(buf, root);
  const uint8_t* p = static_cast<const uint8_t*>(buf.raw());
  return std::vector<uint8_t>(p, p + n);
}

}  // namespace hp
