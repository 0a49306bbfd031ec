// Entry point of the hotpath executable: subcommand dispatch, top-level error handling.
#pragma once

namespace hp {

// Runs `hotpath <subcommand> ...`; returns the process exit code. Never throws.
int run_cli(int argc, char** argv);

}  // namespace hp
