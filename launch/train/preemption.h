// Preemption: SIGUSR1 or SIGTERM asks the run to stop at the next step boundary, where every
// rank agrees, saves a checkpoint and exits with kRequeueExitCode. The handlers are installed
// first thing in main, so a signal that arrives during start-up (before the options are read,
// while the ranks meet, while the model is built) is kept too: the run then stops before its
// first step, with nothing to save, and the same exit status.
#pragma once

#include "launch/train/rank_context.h"

namespace hp {

// Exit status of a run that stopped for preemption after saving a checkpoint (EX_TEMPFAIL): the
// job should be requeued and resumed with --resume=auto.
constexpr int kRequeueExitCode = 75;

// Blocks SIGUSR1 and SIGTERM and installs handlers that only set a flag (async-signal-safe).
// A blocked signal stays pending; unblock_preemption_signals() delivers it to the handler.
void install_preemption_handlers();
void unblock_preemption_signals();
// For commands that are not training runs: SIGUSR1 and SIGTERM end the process again (default
// action); one that arrived since install_preemption_handlers() is raised again now.
void restore_default_signal_actions();
// This process has received SIGUSR1 or SIGTERM.
bool preemption_requested();
// Collective over the world: true on every rank when any rank has received a preemption signal.
bool preemption_agreed(const RankContext& ctx);

}  // namespace hp
