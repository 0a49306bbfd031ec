// HOTPATH_FAULT=KIND:RANK:STEP: one parser for every kind, errors that name the variable.
#include "launch/train/fault_injection.h"

#include <gtest/gtest.h>

#include <string>

#include "framework/core/error.h"

namespace hp {
namespace {

std::string parse_error(const std::string& text) {
  try {
    parse_fault_spec(text);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(FaultSpec, ParsesStepKinds) {
  const FaultSpec t = parse_fault_spec("throw:1:3");
  EXPECT_EQ(t.kind, FaultKind::kThrow);
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.step, 3);
  EXPECT_EQ(parse_fault_spec("kill:0:12").kind, FaultKind::kKill);
  EXPECT_EQ(parse_fault_spec("hang:2:1").kind, FaultKind::kHang);
}

TEST(FaultSpec, ParsesEverySavePoint) {
  for (const char* point : {"begin", "data", "close", "rename"}) {
    const FaultSpec f = parse_fault_spec(std::string("kill-save-") + point + ":1:4");
    EXPECT_EQ(f.kind, FaultKind::kKillInSave);
    EXPECT_EQ(f.save_point, point);
    EXPECT_EQ(f.rank, 1);
    EXPECT_EQ(f.step, 4);
  }
}

TEST(FaultSpec, RejectsMalformedValuesNamingTheVariable) {
  for (const char* bad : {"throw", "throw:1", "explode:1:2", "kill-save-middle:0:1", "kill:x:1",
                          "kill:1:2x", "kill::1"}) {
    const std::string m = parse_error(bad);
    EXPECT_NE(m.find("HOTPATH_FAULT='"), std::string::npos) << bad << ": " << m;
    EXPECT_NE(m.find("KIND:RANK:STEP"), std::string::npos) << bad << ": " << m;
  }
}

}  // namespace
}  // namespace hp
