// libFuzzer harness of the safetensors reader: the input is a .safetensors file, opened as
// import-hf opens every shard (SafetensorsFile: header length, JSON, duplicate names, dtypes,
// shapes against byte ranges, offsets tiling the data section), and every floating-point tensor
// it accepts is then converted to fp32 (the NaN/inf check). An accepted header must describe
// byte ranges inside the file, which the conversion reads.
#include <cstdint>
#include <string>
#include <vector>

#include "launch/hf/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hp::fuzz::quiet_logs();
  const hp::fuzz::ScratchFile file(data, size);
  hp::fuzz::expect_clean([&] {
    const hp::SafetensorsFile f(file.path());
    for (const auto& kv : f.entries()) {
      const hp::SafetensorsEntry& e = kv.second;
      HP_FUZZ_REQUIRE(e.begin >= 0 && e.begin <= e.end);
      HP_FUZZ_REQUIRE(static_cast<uint64_t>(e.end) <= size);
      if (e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16") {
        try {
          const std::vector<float> v = hp::safetensors_to_f32(kv.first, e, f.data(e));
          HP_FUZZ_REQUIRE(static_cast<int64_t>(v.size()) == hp::shape_numel(e.shape));
        } catch (const hp::UserError& err) {
          hp::fuzz::note(err.what());
        }
      }
    }
  });
  // The same bytes through the in-memory parser: the same verdict.
  hp::fuzz::expect_clean([&] {
    const hp::SafetensorsHeader h = hp::parse_safetensors_header(data, size, "<input>");
    HP_FUZZ_REQUIRE(h.data_offset <= size);
    uint64_t covered = 0;
    for (const auto& kv : h.entries)
      covered += static_cast<uint64_t>(kv.second.end - kv.second.begin);
    HP_FUZZ_REQUIRE(covered == size - h.data_offset);
  });
  return 0;
}
