// Option errors whose value or key holds one of Boost's own placeholders (%value%, %option%):
// the message is produced and names them literally (Boost's what() would loop forever).
#include "launch/option_errors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "framework/core/error.h"
#include "launch/options.h"

namespace hp {
namespace {

// The UserError message of parsing a config file of `text`.
std::string config_error(const std::string& text) {
  char path[] = "/tmp/hp_option_errors_XXXXXX";
  const int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << text;
  std::string msg;
  try {
    TrainOptions o;
    parse_train_options({"--config", path}, "train", o);
  } catch (const UserError& e) {
    msg = e.what();
  }
  ::unlink(path);
  return msg;
}

TEST(OptionErrors, PlaceholdersInTheUsersTextAreQuotedNotExpanded) {
  std::string msg = config_error("lr = %value%x\n");
  EXPECT_NE(msg.find("'%value%x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lr"), std::string::npos) << msg;
  msg = config_error("vocab_size = 9%canonical_option%\n");
  EXPECT_NE(msg.find("9%canonical_option%"), std::string::npos) << msg;
  msg = config_error("%option% = 1\n");
  EXPECT_NE(msg.find("%option%"), std::string::npos) << msg;
}

TEST(OptionErrors, OrdinaryMessagesMatchBoosts) {
  namespace po = boost::program_options;
  const po::invalid_option_value e("abc");
  EXPECT_EQ(option_error_text(e), std::string(e.what()));
  po::validation_error v(po::validation_error::invalid_option_value, "lr", "x");
  EXPECT_EQ(option_error_text(v), std::string(v.what()));
  const po::unknown_option u("bogus");
  EXPECT_EQ(option_error_text(u), std::string(u.what()));
}

}  // namespace
}  // namespace hp
