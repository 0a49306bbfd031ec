// libFuzzer harness of the config parser: the input is an INI file given as --config to
// parse_train_options (the entry point of `hotpath train|eval|bench`), and what parses is then
// checked by validate_train_options for one and for two ranks.
#include <cstdint>
#include <string>
#include <vector>

#include "launch/options.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hp::fuzz::quiet_logs();
  const hp::fuzz::ScratchFile file(data, size);
  hp::fuzz::expect_clean([&] {
    hp::TrainOptions o;
    if (!hp::parse_train_options({"--config", file.path()}, "train", o)) return;
    hp::validate_train_options(o, 1);
    hp::validate_train_options(o, 2);
  });
  return 0;
}
