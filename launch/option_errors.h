// The text of a Boost.Program_options error, safe for any input.
//
// Boost's what() substitutes its placeholders (%value%, %option%, ...) until none is left: a
// value or key from the user's text that itself contains a placeholder (`lr = %value%x`) makes
// it loop forever. option_error_text() substitutes each placeholder once, in one pass over the
// template, so the user's text is never rescanned.
#pragma once

#include <boost/program_options/errors.hpp>
#include <string>

namespace hp {

std::string option_error_text(const boost::program_options::error& e);

}  // namespace hp
