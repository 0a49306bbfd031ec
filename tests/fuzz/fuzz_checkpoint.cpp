// libFuzzer harness of the checkpoint reader: the input is one file, opened with
// CheckpointReader; its attributes are read, and every dataset's rows are read (whole, in the
// stored type and as f64, and as a sub-range) and verified, as loading and `inspect` do.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

constexpr int64_t kMaxBytes = int64_t{8} << 20;  // bounded work per input

void read_attrs(const hp::CheckpointReader& r) {
  for (const char* s : {"format", "hotpath_version", "config", "layout"}) {
    if (r.has_attr(s)) hp::fuzz::expect_clean([&] { (void)r.string_attr(s); });
  }
  for (const char* s : {"format_version", "step", "world", "dp", "ep"}) {
    if (r.has_attr(s)) hp::fuzz::expect_clean([&] { (void)r.int_attr(s); });
  }
  for (const char* s : {"shape", "ranks"}) {
    if (r.has_attr(s)) hp::fuzz::expect_clean([&] { (void)r.ints_attr(s); });
  }
}

void read_dataset(const hp::CheckpointReader& r, const hp::DatasetInfo& d) {
  HP_FUZZ_REQUIRE(!d.shape.empty());
  for (int64_t n : d.shape) HP_FUZZ_REQUIRE(n >= 0);
  const int64_t rows = d.shape[0];
  if (rows == 0) return;
  int64_t row_elems = 1;
  for (size_t k = 1; k < d.shape.size(); ++k) {
    if (d.shape[k] > 0 && row_elems > kMaxBytes / 8 / d.shape[k]) return;
    row_elems *= d.shape[k];
  }
  if (row_elems == 0 || rows > kMaxBytes / 8 / row_elems) return;
  const hp::DType as = d.dtype == hp::DType::kI64 ? hp::DType::kI64 : hp::DType::kF64;
  std::vector<double> out(static_cast<size_t>(rows * row_elems));
  hp::fuzz::expect_clean([&] { r.read_rows(d.name, hp::RowRange{0, rows}, as, out.data()); });
  if (rows > 1)
    hp::fuzz::expect_clean([&] {
      r.read_rows(d.name, hp::RowRange{rows / 2, rows - rows / 2}, as, out.data());
    });
  if (d.dtype == hp::DType::kF32) {
    std::vector<float> f(static_cast<size_t>(rows * row_elems));
    hp::fuzz::expect_clean([&] {
      r.read_rows(d.name, hp::RowRange{0, rows}, hp::DType::kF32, f.data());
    });
  }
  if (d.dtype == hp::DType::kI64 && d.shape.size() == 1)
    hp::fuzz::expect_clean([&] { (void)r.read_i64(d.name); });
  hp::fuzz::expect_clean([&] { (void)r.verify(d.name); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hp::fuzz::quiet_logs();
  if (!hp::fuzz::checksummed_hdf5(data, size)) return 0;
  const hp::fuzz::ScratchFile file(data, size);
  hp::fuzz::expect_clean([&] {
    const hp::CheckpointReader r(file.path());
    read_attrs(r);
    std::vector<hp::DatasetInfo> all;
    hp::fuzz::expect_clean([&] { all = r.datasets(); });
    for (const hp::DatasetInfo& d : all) {
      HP_FUZZ_REQUIRE(r.has_dataset(d.name));
      hp::fuzz::expect_clean([&] { (void)r.info(d.name); });
      read_dataset(r, d);
    }
    hp::fuzz::expect_clean([&] { (void)r.info("/no/such/dataset"); });
  });
  return 0;
}
