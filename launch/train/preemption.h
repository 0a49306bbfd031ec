// Preemption: SIGUSR1 or SIGTERM asks the run to stop at the next step boundary, where every
// rank agrees, saves a checkpoint and exits with kRequeueExitCode.
#pragma once

#include "launch/train/rank_context.h"

namespace hp {

// Exit status of a run that stopped for preemption after saving a checkpoint (EX_TEMPFAIL): the
// job should be requeued and resumed with --resume=auto.
constexpr int kRequeueExitCode = 75;

// Installs SIGUSR1 and SIGTERM handlers that only set a flag (async-signal-safe).
void install_preemption_handlers();
// This process has received SIGUSR1 or SIGTERM.
bool preemption_requested();
// Collective over the world: true on every rank when any rank has received a preemption signal.
bool preemption_agreed(const RankContext& ctx);

}  // namespace hp
