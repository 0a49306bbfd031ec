# Sanitizer and fuzzing builds (the `asan` preset; docs/testing.md).
#
#   HOTPATH_SANITIZE  every C/C++ file compiled and linked with AddressSanitizer and
#                     UndefinedBehaviorSanitizer; any undefined behaviour aborts
#                     (-fno-sanitize-recover), so a finding fails the test that hit it.
#   HOTPATH_FUZZ      also the libFuzzer harnesses of tests/fuzz (clang only). Every library
#                     gets libFuzzer's coverage instrumentation (-fsanitize=fuzzer-no-link), and
#                     the harnesses link the fuzzing driver. Implies HOTPATH_SANITIZE.
#
# External libraries (MPI, HDF5, OpenBLAS, Boost) are not instrumented: their own memory errors
# are not seen, but every access hotpath's code makes to what they return is.
option(HOTPATH_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
option(HOTPATH_FUZZ "Build the libFuzzer harnesses (tests/fuzz; clang; implies HOTPATH_SANITIZE)"
       OFF)
set(HOTPATH_FUZZ_SECONDS 60 CACHE STRING "Seconds each fuzzer runs as a CTest test (label fuzz)")

if(HOTPATH_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "HOTPATH_FUZZ needs clang (libFuzzer); configure with the asan preset or "
                        "-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang")
  endif()
  set(HOTPATH_SANITIZE ON CACHE BOOL "" FORCE)
endif()

if(HOTPATH_SANITIZE)
  if(HOTPATH_CUDA)
    message(FATAL_ERROR "HOTPATH_SANITIZE is for the CPU build; the CUDA backend is checked with "
                        "compute-sanitizer (the gpu.sanitize.* cases, tests/gpu/gpu_cases.cmake)")
  endif()
  set(hp_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined
                        -fno-omit-frame-pointer)
  foreach(flag ${hp_sanitize_flags})
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:${flag}>)
    add_link_options(${flag})
  endforeach()
  if(HOTPATH_FUZZ)
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>)
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # At -O1 clang does not vectorize the `omp simd` loops and says so for each; not a problem.
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-pass-failed>)
  endif()
endif()
