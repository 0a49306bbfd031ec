# Finds every external dependency once, as imported targets the project links against.

find_package(MPI REQUIRED COMPONENTS C CXX)
# The project calls MPI's C API only. Without the deprecated C++ bindings every file that includes
# <mpi.h> needs just libmpi, which parallel HDF5 already links (its own headers skip the bindings
# the same way), so a target that includes <mpi.h> without linking parallel/ still links.
add_compile_definitions(OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)

# The parallel HDF5 build (Debian: libhdf5-openmpi-dev) provides collective MPI-IO writes.
set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "hotpath needs the parallel (MPI) build of HDF5; on Debian install "
                      "libhdf5-openmpi-dev (found: ${HDF5_C_LIBRARIES})")
endif()
add_library(hotpath_hdf5 INTERFACE)
target_include_directories(hotpath_hdf5 SYSTEM INTERFACE ${HDF5_C_INCLUDE_DIRS})
target_link_libraries(hotpath_hdf5 INTERFACE ${HDF5_C_LIBRARIES} MPI::MPI_C)
target_compile_definitions(hotpath_hdf5 INTERFACE ${HDF5_C_DEFINITIONS})

find_package(Boost 1.74 REQUIRED COMPONENTS program_options)

# Every JSON hotpath writes or reads (metrics, benchmark results).
find_package(nlohmann_json 3 REQUIRED)

# CPU BLAS for the reference backend's matmul. The OpenMP build of OpenBLAS runs its GEMMs in
# the same thread team as the backend's own OpenMP loops; the pthreads build would add a second
# set of spinning threads competing for the same cores. Any CBLAS works as a fallback.
find_path(CBLAS_INCLUDE_DIR NAMES cblas.h
          PATHS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/aarch64-linux-gnu/openblas-openmp
          NO_DEFAULT_PATH)
find_library(CBLAS_LIBRARY NAMES openblas
             PATHS /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp
             NO_DEFAULT_PATH)
find_path(CBLAS_INCLUDE_DIR NAMES cblas.h PATH_SUFFIXES openblas)
find_library(CBLAS_LIBRARY NAMES openblas cblas blas)
message(STATUS "CBLAS: ${CBLAS_LIBRARY}")
if(NOT CBLAS_INCLUDE_DIR OR NOT CBLAS_LIBRARY)
  message(FATAL_ERROR "no CBLAS found; on Debian install libopenblas-openmp-dev")
endif()
add_library(hotpath_cblas INTERFACE)
target_include_directories(hotpath_cblas SYSTEM INTERFACE ${CBLAS_INCLUDE_DIR})
target_link_libraries(hotpath_cblas INTERFACE ${CBLAS_LIBRARY})

find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)

if(HOTPATH_TESTS)
  find_package(GTest REQUIRED)
endif()

if(HOTPATH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90 100)
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  find_package(NCCL REQUIRED)
endif()
