#include "parallel/link_arbiter.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <new>
#include <sstream>
#include <thread>

#include "framework/core/error.h"

namespace hp {

using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxRanks = 64;
constexpr int kRing = 64;  // grants of one (rank, direction) that may be outstanding at once
constexpr uint64_t kMagic = 0x68706c616e653031ull;

static_assert(std::atomic<int64_t>::is_always_lock_free, "shared-memory atomics need lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory atomics need lock-free");

}  // namespace

// Plain fields of a Link change only under its lock; the lock's acquire/release orders them
// between processes as between threads. Counters read without the lock are atomics.
struct NodeLinkArbiter::Shared {
  struct alignas(64) Link {
    std::atomic<uint32_t> lock;
    int32_t n = 0;
    int32_t members[kMaxRanks];
    int32_t inflight = 0;
    int32_t rr_next[2] = {0, 0};  // per direction: position in members to try first
    int64_t seq = 0;              // grants made on this link
  };
  struct alignas(64) Rank {
    std::atomic<int64_t> requested[2];
    std::atomic<int64_t> granted[2];
    std::atomic<int64_t> grant_seq[2][kRing];  // of grant k at [k % kRing]
    std::atomic<int64_t> bytes;                // released, both directions
  };
  uint64_t magic = 0;
  int32_t n_ranks = 0;
  Link links[kMaxRanks];
  Rank ranks[kMaxRanks];
};

namespace {

using Shared = NodeLinkArbiter::Shared;

class LinkLock {
 public:
  explicit LinkLock(Shared::Link& l) : l_(l) {
    while (l_.lock.exchange(1, std::memory_order_acquire) != 0) {
      while (l_.lock.load(std::memory_order_relaxed) != 0) std::this_thread::yield();
    }
  }
  ~LinkLock() { l_.lock.store(0, std::memory_order_release); }

 private:
  Shared::Link& l_;
};

// Hands out grants while the link has capacity: reloads first, round-robin within a direction.
// Called with the link's lock held.
void schedule(Shared& s, Shared::Link& l, int inflight_limit) {
  while (l.inflight < inflight_limit) {
    bool made = false;
    for (int d = 0; d < 2 && !made; ++d) {
      for (int i = 0; i < l.n; ++i) {
        const int pos = (l.rr_next[d] + i) % l.n;
        Shared::Rank& r = s.ranks[l.members[pos]];
        const int64_t g = r.granted[d].load(std::memory_order_relaxed);
        if (r.requested[d].load(std::memory_order_acquire) <= g) continue;
        r.grant_seq[d][(g + 1) % kRing].store(++l.seq, std::memory_order_relaxed);
        r.granted[d].store(g + 1, std::memory_order_release);
        l.inflight += 1;
        l.rr_next[d] = (pos + 1) % l.n;
        made = true;
        break;
      }
    }
    if (!made) return;
  }
}

std::string shm_error(const char* what, const std::string& name) {
  return str_cat(what, " '", name, "': ", std::strerror(errno));
}

}  // namespace

void LinkOptions::validate() const {
  if (chunk_mib < 1 || chunk_mib > 4096) {
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'link_chunk_mib': must be in [1, 4096], got ",
                  chunk_mib);
  }
  if (inflight < 1 || inflight > kRing) {
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'link_inflight': must be in [1, ", kRing,
                  "], got ", inflight);
  }
  if (!pcie_groups.empty() && pcie_groups != "auto") {
    // Rank numbers are checked against the node's size when the arbiter is built.
    for (char c : pcie_groups) {
      if (!(c == ',' || c == ';' || c == ' ' || (c >= '0' && c <= '9'))) {
        HP_USER_ERROR(ErrorKind::kConfig, "config key 'pcie_groups': '", pcie_groups,
                      "' is not \"auto\" or a list like \"0,1;2,3\" (node ranks, ',' within a "
                      "link, ';' between links)");
      }
    }
    // A node of the largest rank named + 1 ranks: its errors hold on any node that has that
    // rank; a rank beyond the node's size is found when the arbiter is built.
    int largest = 0;
    int64_t number = -1;
    for (char c : pcie_groups + ",") {
      if (c >= '0' && c <= '9') {
        number = std::min<int64_t>((number < 0 ? 0 : number) * 10 + (c - '0'), kMaxRanks);
      } else {
        if (number >= 0) largest = std::max<int>(largest, static_cast<int>(number));
        number = -1;
      }
    }
    parse_pcie_groups(pcie_groups, largest + 1);
  }
}

std::vector<std::vector<int>> parse_pcie_groups(const std::string& text, int n_ranks) {
  std::vector<std::vector<int>> links;
  if (text.find_first_not_of(' ') == std::string::npos) {
    links.emplace_back();
    for (int r = 0; r < n_ranks; ++r) links.back().push_back(r);
    return links;
  }
  auto bad = [&](const std::string& why) {
    HP_USER_ERROR(ErrorKind::kConfig, "config key 'pcie_groups': '", text, "' ", why, " (node of ",
                  n_ranks, " ranks; e.g. \"0,1;2,3\")");
  };
  std::vector<int> seen(n_ranks, 0);
  std::stringstream groups(text);
  std::string group;
  while (std::getline(groups, group, ';')) {
    std::vector<int> link;
    std::stringstream members(group);
    std::string item;
    while (std::getline(members, item, ',')) {
      const size_t a = item.find_first_not_of(' '), b = item.find_last_not_of(' ');
      if (a == std::string::npos) bad("has an empty entry");
      const std::string num = item.substr(a, b - a + 1);
      if (num.find_first_not_of("0123456789") != std::string::npos || num.size() > 6) {
        bad("has '" + num + "', not a rank number");
      }
      const int r = std::stoi(num);
      if (r >= n_ranks) bad("names rank " + num + ", outside the node");
      if (seen[r]++) bad("names rank " + num + " twice");
      link.push_back(r);
    }
    if (link.empty()) bad("has an empty link");
    links.push_back(link);
  }
  for (int r = 0; r < n_ranks; ++r) {
    if (!seen[r]) bad("leaves out rank " + std::to_string(r));
  }
  return links;
}

double jain_fairness(const std::vector<double>& x) {
  double sum = 0, sq = 0;
  for (double v : x) {
    sum += v;
    sq += v * v;
  }
  if (x.empty() || sq == 0) return 1.0;
  return sum * sum / (static_cast<double>(x.size()) * sq);
}

NodeLinkArbiter::NodeLinkArbiter(Communicator& node, const LinkOptions& options)
    : rank_(node.rank()),
      inflight_(options.inflight),
      chunk_bytes_(options.chunk_bytes()),
      timeout_(options.timeout) {
  options.validate();
  const int n = node.size();
  if (n > kMaxRanks) {
    HP_USER_ERROR(ErrorKind::kConfig, "link_arbiter=on supports at most ", kMaxRanks,
                  " ranks per node, this node has ", n);
  }
  const std::vector<std::vector<int>> links = parse_pcie_groups(options.pcie_groups, n);

  // Node rank 0 names the segment; the name is unique per job and creation (pid, clock).
  Tensor key = Tensor::host({2}, DType::kI64);
  key.data<int64_t>()[0] = static_cast<int64_t>(getpid());
  key.data<int64_t>()[1] = Clock::now().time_since_epoch().count();
  node.broadcast(key, 0);
  const std::string name =
      str_cat("/hotpath_link_", key.data<int64_t>()[0], "_", key.data<int64_t>()[1]);
  shared_bytes_ = sizeof(Shared);

  int fd = -1;
  if (rank_ == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    HP_CHECK(fd >= 0, shm_error("shm_open (create)", name));
    HP_CHECK(ftruncate(fd, static_cast<off_t>(shared_bytes_)) == 0, shm_error("ftruncate", name));
  }
  // Create before anyone opens; on failure the other ranks would throw at shm_open.
  node.barrier();
  if (rank_ != 0) {
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    HP_CHECK(fd >= 0, shm_error("shm_open", name));
  }
  void* p = mmap(nullptr, shared_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  HP_CHECK(p != MAP_FAILED, shm_error("mmap", name));
  shared_ = static_cast<Shared*>(p);
  if (rank_ == 0) {
    Shared* s = new (p) Shared();
    s->n_ranks = n;
    for (size_t i = 0; i < links.size(); ++i) {
      Shared::Link& l = s->links[i];
      l.lock.store(0);
      l.n = static_cast<int32_t>(links[i].size());
      for (size_t j = 0; j < links[i].size(); ++j) l.members[j] = links[i][j];
    }
    for (int r = 0; r < n; ++r) {
      Shared::Rank& k = s->ranks[r];
      for (int d = 0; d < 2; ++d) {
        k.requested[d].store(0);
        k.granted[d].store(0);
        for (auto& g : k.grant_seq[d]) g.store(0);
      }
      k.bytes.store(0);
    }
    s->magic = kMagic;
  }
  // Every rank has mapped the segment and rank 0 filled it: the name is no longer needed.
  node.barrier();
  if (rank_ == 0) shm_unlink(name.c_str());
  HP_CHECK(shared_->magic == kMagic && shared_->n_ranks == n, "link arbiter segment '", name,
           "' not initialised");
  for (size_t i = 0; i < links.size(); ++i) {
    for (int r : links[i]) {
      if (r == rank_) {
        link_ = static_cast<int>(i);
        link_ranks_ = links[i];
      }
    }
  }
}

NodeLinkArbiter::~NodeLinkArbiter() {
  if (shared_) munmap(shared_, shared_bytes_);
}

LinkTicket NodeLinkArbiter::request(CopyDirection dir, int64_t bytes) {
  HP_CHECK(bytes > 0 && bytes <= chunk_bytes_, "copy chunk of ", bytes, " bytes outside [1, ",
           chunk_bytes_, "]");
  const int d = static_cast<int>(dir);
  Shared::Rank& me = shared_->ranks[rank_];
  Shared::Link& l = shared_->links[link_];
  LinkTicket t;
  t.dir = dir;
  t.bytes = bytes;
  t.requested_at = Clock::now();
  {
    LinkLock lock(l);
    // Only this rank increments its counters, under the link lock (threads of this rank too).
    t.index = me.requested[d].load(std::memory_order_relaxed) + 1;
    HP_CHECK(t.index - me.granted[d].load(std::memory_order_relaxed) < kRing, "more than ", kRing,
             " ", copy_direction_name(dir), " chunks requested at once");
    me.requested[d].store(t.index, std::memory_order_release);
    schedule(*shared_, l, inflight_);
  }
  recorder_.on_request(t);
  granted(t);
  return t;
}

bool NodeLinkArbiter::granted(LinkTicket& t) {
  if (t.grant_seq > 0) return true;
  const int d = static_cast<int>(t.dir);
  Shared::Rank& me = shared_->ranks[rank_];
  if (me.granted[d].load(std::memory_order_acquire) < t.index) return false;
  t.grant_seq = me.grant_seq[d][t.index % kRing].load(std::memory_order_relaxed);
  t.granted_at = Clock::now();
  recorder_.on_grant(t);
  return true;
}

void NodeLinkArbiter::wait(LinkTicket& t) {
  const Clock::time_point deadline = t.requested_at + timeout_;
  // Short sleeps: a grant is seen within ~50 us without holding a core, which matters when
  // ranks outnumber cores.
  while (!granted(t)) {
    if (Clock::now() > deadline) {
      HP_FAIL(ErrorKind::kComm, "rank ", rank_, " of node: link arbiter ",
              copy_direction_name(t.dir), " grant not received after ", timeout_.count(),
              " ms (a rank on the same link stopped releasing)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NodeLinkArbiter::release(LinkTicket& t) {
  HP_CHECK(t.grant_seq > 0, "releasing a link ticket that was not granted");
  Shared::Link& l = shared_->links[link_];
  {
    LinkLock lock(l);
    l.inflight -= 1;
    schedule(*shared_, l, inflight_);
  }
  shared_->ranks[rank_].bytes.fetch_add(t.bytes, std::memory_order_relaxed);
  recorder_.on_release(t);
}

void NodeLinkArbiter::begin_step() {
  recorder_.reset();
  link_bytes_at_step_ = link_bytes();
}

LinkArbiterStats NodeLinkArbiter::stats() const {
  LinkArbiterStats s = recorder_.get();
  s.link_ranks = link_ranks_;
  s.link_bytes = link_bytes();
  std::vector<double> share;
  for (size_t i = 0; i < s.link_bytes.size(); ++i) {
    s.link_bytes[i] -= i < link_bytes_at_step_.size() ? link_bytes_at_step_[i] : 0;
    share.push_back(static_cast<double>(s.link_bytes[i]));
  }
  s.link_jain = jain_fairness(share);
  return s;
}

std::vector<int64_t> NodeLinkArbiter::link_bytes() const {
  std::vector<int64_t> out;
  for (int r : link_ranks_) out.push_back(shared_->ranks[r].bytes.load());
  return out;
}

int64_t NodeLinkArbiter::link_pending(CopyDirection dir) const {
  const int d = static_cast<int>(dir);
  int64_t n = 0;
  for (int r : link_ranks_) {
    n += shared_->ranks[r].requested[d].load() - shared_->ranks[r].granted[d].load();
  }
  return n;
}

std::string host_link_of_pci_device(const std::string& sysfs_devices, const std::string& bus_id) {
  if (bus_id.empty()) return "";
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // CUDA reports an 8-digit PCI domain ("00000000:1B:00.0"); sysfs names use 4.
  if (id.size() > 12 && id.find(':') == 8 && id.compare(0, 4, "0000") == 0) id = id.substr(4);
  std::error_code ec;
  const std::filesystem::path dev =
      std::filesystem::canonical(std::filesystem::path(sysfs_devices) / id, ec);
  if (ec) return "";
  // .../devices/pci0000:17/0000:17:01.0/0000:18:00.0/.../0000:1b:00.0: the component after the
  // host bridge ("pciDDDD:BB") is the root port.
  std::string bridge;
  for (const auto& part : dev) {
    const std::string s = part.string();
    if (!bridge.empty()) return bridge + "/" + s;
    if (s.rfind("pci", 0) == 0) bridge = s;
  }
  return "";
}

std::string pcie_groups_from_link_ids(const std::vector<std::string>& ids) {
  for (const std::string& id : ids)
    if (id.empty()) return "";
  std::vector<std::string> links;
  std::vector<std::vector<int>> members;
  for (size_t r = 0; r < ids.size(); ++r) {
    auto it = std::find(links.begin(), links.end(), ids[r]);
    if (it == links.end()) {
      links.push_back(ids[r]);
      members.emplace_back();
      it = links.end() - 1;
    }
    members[static_cast<size_t>(it - links.begin())].push_back(static_cast<int>(r));
  }
  std::string out;
  for (size_t l = 0; l < members.size(); ++l) {
    if (l) out += ';';
    for (size_t i = 0; i < members[l].size(); ++i) {
      if (i) out += ',';
      out += std::to_string(members[l][i]);
    }
  }
  return out;
}

namespace {
// Every node rank's link_id, in node-rank order (collective over `node`).
std::vector<std::string> gather_link_ids(Communicator& node, const std::string& mine) {
  constexpr int64_t kMax = 256;
  std::vector<int32_t> chars(kMax, 0);
  for (size_t i = 0; i < mine.size() && i + 1 < static_cast<size_t>(kMax); ++i)
    chars[i] = static_cast<unsigned char>(mine[i]);
  Tensor in = Tensor::host_from(chars, DType::kI32);
  Tensor all = Tensor::host({node.size() * kMax}, DType::kI32);
  node.all_gather(in, all);
  std::vector<std::string> ids(static_cast<size_t>(node.size()));
  const int32_t* p = all.data<int32_t>();
  for (int r = 0; r < node.size(); ++r)
    for (int64_t i = 0; i < kMax && p[r * kMax + i] != 0; ++i)
      ids[static_cast<size_t>(r)] += static_cast<char>(p[r * kMax + i]);
  return ids;
}
}  // namespace

std::string resolve_pcie_groups(Communicator& node, const LinkOptions& options) {
  if (options.pcie_groups != "auto") return options.pcie_groups;
  return node.size() > 1 ? pcie_groups_from_link_ids(gather_link_ids(node, options.link_id))
                         : std::string();
}

std::unique_ptr<LinkArbiter> make_link_arbiter(Communicator& node, const LinkOptions& options) {
  options.validate();
  LinkOptions o = options;
  if (o.enabled) o.pcie_groups = resolve_pcie_groups(node, o);
  // A node of one rank needs no coordination, but its pcie_groups must still name the node.
  if (o.enabled) parse_pcie_groups(o.pcie_groups, node.size());
  if (!o.enabled || node.size() == 1) {
    return std::make_unique<LocalLinkArbiter>(o.chunk_bytes());
  }
  return std::make_unique<NodeLinkArbiter>(node, o);
}

}  // namespace hp
