// Shared main for the test executables: MPI is initialised once (several tests use MPI-IO or
// communicators), at the thread level the program asks for (MPI_THREAD_MULTIPLE: a background
// checkpoint writer runs collectives next to the training thread), and finalised after the run.
#include <gtest/gtest.h>
#include <mpi.h>

// Under AddressSanitizer (the asan preset), what Open MPI allocates while it starts and stops
// is not checked for leaks: it keeps part of its state until the process ends, some of it in
// components it has unloaded by then, whose allocations LeakSanitizer can neither attribute nor
// suppress by name. Everything the tests allocate between the two is checked.
#if defined(__SANITIZE_ADDRESS__)
#define HP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HP_ASAN 1
#endif
#endif
#ifdef HP_ASAN
#include <sanitizer/lsan_interface.h>
#define HP_LSAN_IGNORE(stmt) \
  do {                       \
    __lsan_disable();        \
    stmt;                    \
    __lsan_enable();         \
  } while (0)
#else
#define HP_LSAN_IGNORE(stmt) stmt
#endif

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int provided = 0;
  HP_LSAN_IGNORE(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  int rc = RUN_ALL_TESTS();
  HP_LSAN_IGNORE(MPI_Finalize());
  return rc;
}
