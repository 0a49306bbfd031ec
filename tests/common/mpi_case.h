// HP_MPI_TEST(Suite, Name, ranks...): a GoogleTest case that needs a launch of several ranks.
//
// It is an ordinary TEST(Suite, Name); the rank counts after the name are for the build:
// tests/CMakeLists.txt reads them from this line and registers the case once per count as
// `Suite.Name/npN`, run under `${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} N ...` with
// --gtest_filter=Suite.Name and the label `mpi`; the single-process run of the executable leaves
// these cases out. Keep the whole macro call on one line.
#pragma once

#include <gtest/gtest.h>

#define HP_MPI_TEST(suite, name, ...) TEST(suite, name)
