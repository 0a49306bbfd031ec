// Shared main for the test executables: MPI is initialised once (several tests use MPI-IO or
// communicators) and finalised after the run.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
