#include "framework/core/hdf5_util.h"

namespace hp {
namespace {

// H5Ewalk2 callback: keeps the innermost (most specific) entry of the error stack.
herr_t innermost_error(unsigned n, const H5E_error2_t* e, void* data) {
  if (n == 0) {
    char minor[160] = {};
    H5Eget_msg(e->min_num, nullptr, minor, sizeof minor);
    *static_cast<std::string*>(data) =
        str_cat(e->func_name ? e->func_name : "?", ": ", e->desc ? e->desc : "", " (", minor, ")");
  }
  return 0;
}

}  // namespace

std::recursive_mutex& h5_mutex() {
  static std::recursive_mutex mu;
  return mu;
}

void h5_skip_exit_handler() {
  H5Lock lock;
  H5dont_atexit();
}

std::string h5_error_text() {
  std::string s;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_error, &s);
  return s.empty() ? std::string("no HDF5 error message") : s;
}

}  // namespace hp
