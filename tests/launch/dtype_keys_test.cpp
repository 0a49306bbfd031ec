// Every key that takes a dtype spells it fp32, fp64 or bf16. The spellings f32 and f64 are
// refused with a message that names the spelling to write instead.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "framework/core/error.h"
#include "launch/options.h"

namespace hp {
namespace {

std::vector<std::string> model_args() {
  return {"--vocab_size=16", "--d_model=32",  "--n_layers=2", "--n_heads=2",
          "--n_kv_heads=1",  "--head_dim=16", "--ffn_dim=64"};
}

TrainOptions parse(const std::vector<std::string>& extra) {
  std::vector<std::string> args = model_args();
  args.insert(args.end(), extra.begin(), extra.end());
  TrainOptions o;
  EXPECT_TRUE(parse_train_options(args, "train", o));
  return o;
}

std::string error_of(const std::vector<std::string>& extra) {
  try {
    parse(extra);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(DTypeKeys, DefaultsAreFp32) {
  const TrainOptions o = parse({});
  EXPECT_EQ(o.device.cpu_dtype, DType::kF32);
  EXPECT_EQ(o.optimizer.grad_reduce_dtype, DType::kF32);
}

TEST(DTypeKeys, AcceptFp32Fp64Bf16) {
  EXPECT_EQ(parse({"--cpu_dtype=fp32"}).device.cpu_dtype, DType::kF32);
  EXPECT_EQ(parse({"--cpu_dtype=fp64"}).device.cpu_dtype, DType::kF64);
  EXPECT_EQ(parse({"--grad_reduce_dtype=fp32"}).optimizer.grad_reduce_dtype, DType::kF32);
  EXPECT_EQ(parse({"--grad_reduce_dtype=bf16"}).optimizer.grad_reduce_dtype, DType::kBF16);
}

TEST(DTypeKeys, OldSpellingsNameTheNewOne) {
  EXPECT_NE(error_of({"--cpu_dtype=f32"}).find("'cpu_dtype': 'f32' is spelled 'fp32'"),
            std::string::npos);
  EXPECT_NE(error_of({"--cpu_dtype=f64"}).find("'cpu_dtype': 'f64' is spelled 'fp64'"),
            std::string::npos);
  EXPECT_NE(
      error_of({"--grad_reduce_dtype=f32"}).find("'grad_reduce_dtype': 'f32' is spelled 'fp32'"),
      std::string::npos);
}

TEST(DTypeKeys, ValuesTheKeyDoesNotTakeListTheOnesItDoes) {
  // fp64 is a dtype, but not one gradients travel in; f64 is not pointed at fp64 here either.
  for (const char* v : {"--grad_reduce_dtype=fp64", "--grad_reduce_dtype=f64"})
    EXPECT_NE(error_of({v}).find("'grad_reduce_dtype': must be fp32 or bf16"), std::string::npos)
        << v;
  EXPECT_NE(error_of({"--cpu_dtype=bf16"}).find("'cpu_dtype': must be fp32 or fp64"),
            std::string::npos);
}

}  // namespace
}  // namespace hp
