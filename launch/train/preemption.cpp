#include "launch/train/preemption.h"

#include <csignal>
#include <vector>

namespace hp {
namespace {

volatile std::sig_atomic_t g_preempt = 0;

extern "C" void on_preemption_signal(int) { g_preempt = 1; }

}  // namespace

void install_preemption_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_preemption_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking calls resume; the flag is read at the step boundary
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool preemption_requested() { return g_preempt != 0; }

bool preemption_agreed(const RankContext& ctx) { return any_rank(ctx, preemption_requested()); }

}  // namespace hp
