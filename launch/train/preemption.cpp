#include "launch/train/preemption.h"

#include <csignal>
#include <vector>

namespace hp {
namespace {

volatile std::sig_atomic_t g_preempt = 0;  // the signal received (0: none)

extern "C" void on_preemption_signal(int signo) { g_preempt = signo; }

sigset_t preemption_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void install_preemption_handlers() {
  const sigset_t set = preemption_signals();
  sigprocmask(SIG_BLOCK, &set, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_preemption_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking calls resume; the flag is read at the step boundary
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

void unblock_preemption_signals() {
  const sigset_t set = preemption_signals();
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
}

void restore_default_signal_actions() {
  const sigset_t set = preemption_signals();
  sigprocmask(SIG_BLOCK, &set, nullptr);
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  const int received = g_preempt;
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
  if (received != 0) std::raise(received);
}

bool preemption_requested() { return g_preempt != 0; }

bool preemption_agreed(const RankContext& ctx) { return any_rank(ctx, preemption_requested()); }

}  // namespace hp
