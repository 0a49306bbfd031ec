// HDF5 helpers shared by the token files and the checkpoints: checked calls, quiet error
// printing, and identifiers closed by their owner.
#pragma once

#include <hdf5.h>

#include <mutex>
#include <string>

#include "framework/core/error.h"

namespace hp {

// The most specific message on HDF5's error stack; call right after the failing call.
std::string h5_error_text();

// Keeps HDF5 from closing itself at process exit. A file whose close failed (disk full while
// flushing its metadata) stays open inside HDF5 1.10, and its exit handler then crashes or loops
// trying to close it again; every file hotpath writes is closed (or abandoned and removed)
// explicitly, so the exit handler has nothing to do. Call once, before any other HDF5 call.
void h5_skip_exit_handler();

// Evaluates an HDF5 call once and yields its result; a negative result (a failed herr_t or
// hid_t) throws Error(kHdf5) with the statement, file:line, `where` (the file and the dataset or
// attribute) and HDF5's own message.
#define H5_CHECK(stmt, where)                                                                      \
  ([&]() {                                                                                         \
    auto hp_h5_rc_ = (stmt);                                                                       \
    if (hp_h5_rc_ < 0)                                                                             \
      HP_FAIL(::hp::ErrorKind::kHdf5, #stmt, " failed on ", (where), ": ", ::hp::h5_error_text()); \
    return hp_h5_rc_;                                                                              \
  }())

// The HDF5 library hotpath links is not built thread-safe: every HDF5 call of the process runs
// under this one lock (recursive, so a holder may call helpers that take it again). A
// background checkpoint writer and the training thread's data loader then never call into the
// library at the same time. Take it before H5Quiet and before any identifier is opened, release
// it after the last one is closed.
std::recursive_mutex& h5_mutex();
class H5Lock {
 public:
  H5Lock() : lock_(h5_mutex()) {}
  H5Lock(const H5Lock&) = delete;
  H5Lock& operator=(const H5Lock&) = delete;

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

// Switches HDF5's automatic error printing off for its lifetime (our exceptions report).
class H5Quiet {
 public:
  H5Quiet() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~H5Quiet() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  H5Quiet(const H5Quiet&) = delete;
  H5Quiet& operator=(const H5Quiet&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// An HDF5 identifier closed by its own close function when it goes out of scope.
class H5Handle {
 public:
  H5Handle() = default;
  H5Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~H5Handle() { reset(); }
  H5Handle(H5Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  H5Handle& operator=(H5Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = -1;
    }
    return *this;
  }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now; returns the close function's status (0 when nothing was open).
  herr_t reset() {
    herr_t rc = 0;
    if (id_ >= 0 && close_ != nullptr) rc = close_(id_);
    id_ = -1;
    return rc;
  }
  hid_t release() {
    hid_t id = id_;
    id_ = -1;
    return id;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

}  // namespace hp
