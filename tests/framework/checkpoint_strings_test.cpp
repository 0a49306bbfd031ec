// Checkpoint string attributes: stored fixed-length, so their text lies inside the object
// header under HDF5's metadata checksum, and read back exactly, whatever they hold.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "framework/checkpoint/checkpoint.h"

namespace hp {
namespace {

TEST(CheckpointStrings, StoredFixedLengthAndReadBackExactly) {
  char path[] = "/tmp/hp_ckpt_strings_XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::vector<std::pair<std::string, std::string>> attrs = {
      {"empty", ""},
      {"one", "x"},
      {"config", "d_model = 64\n# comment\nlr = 3e-4\n"},
      {"placeholders", "%value% %option% 100%"},
      {"utf8", "Gr\xc3\xbc\xc3\x9f\x65 \xe2\x86\x92 \xf0\x9f\x99\x82"},
      {"long", std::string(100000, 'a')},
  };
  {
    CheckpointWriter w(path, nullptr);
    w.set_attr("format", std::string(kCheckpointFormat));
    w.set_attr("format_version", kCheckpointVersion);
    for (const auto& [name, value] : attrs) w.set_attr(name, value);
    w.close();
  }
  {
    const hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    for (const auto& [name, value] : attrs) {
      const hid_t a = H5Aopen(f, name.c_str(), H5P_DEFAULT);
      ASSERT_GE(a, 0) << name;
      const hid_t t = H5Aget_type(a);
      EXPECT_EQ(H5Tis_variable_str(t), 0) << name << " is a variable-length string";
      H5Tclose(t);
      H5Aclose(a);
    }
    H5Fclose(f);
  }
  const CheckpointReader r(path);
  for (const auto& [name, value] : attrs) EXPECT_EQ(r.string_attr(name), value) << name;
  ::unlink(path);
}

}  // namespace
}  // namespace hp
