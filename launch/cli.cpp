#include "launch/cli.h"

#include <cstdio>

namespace hp {
int run_cli(int argc, char** argv) {
  std::puts("hotpath " HOTPATH_VERSION);
  return 0;
}
}  // namespace hp
