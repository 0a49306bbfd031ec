# Writes the GPU bundle's CTestTestfile.cmake: every GPU case, with paths found when ctest reads
# the file, so the bundle runs wherever the repository is unpacked. Run by
# launch/scripts/gpu_bundle.sh:
#
#   cmake -DGPU_TESTS=build/cuda/bin/gpu_tests -DOUT=.gpu/ctest/CTestTestfile.cmake \
#         -P tests/gpu/bundle_ctest.cmake
#
# The cases: each GoogleTest case GPU_TESTS lists (DISABLED_ ones left out; the suites of
# HP_GPU_MPI_SUITES on 2 ranks under mpirun as Suite.Name/np2, as the build tree names them), and
# tests/gpu/gpu_cases.cmake. In the written file the bundle is the directory above it and the
# repository root the one above that (HP_SOURCE_DIR in the environment names another root).
if(NOT GPU_TESTS OR NOT OUT)
  message(FATAL_ERROR "bundle_ctest.cmake: give -DGPU_TESTS=<the gpu_tests program> "
                      "-DOUT=<bundle>/ctest/CTestTestfile.cmake")
endif()
if(NOT EXISTS "${GPU_TESTS}")
  message(FATAL_ERROR "bundle_ctest.cmake: GPU_TESTS=${GPU_TESTS} does not exist (build the "
                      "cuda preset's gpu_tests target)")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/gpu_settings.cmake)

# Arguments as the written file spells them: quoted, with the ${HP_...} references of the paths
# left for ctest to expand.
function(hp_bundle_quote out)
  set(q "")
  foreach(a ${ARGN})
    string(REPLACE "\\" "\\\\" a "${a}")
    string(REPLACE "\"" "\\\"" a "${a}")
    string(APPEND q " \"${a}\"")
  endforeach()
  set(${out} "${q}" PARENT_SCOPE)
endfunction()

set(HP_BUNDLE_ENV HP_GPU_BUILD=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive OMPI_ALLOW_RUN_AS_ROOT=1
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    OMPI_MCA_mpi_yield_when_idle=1)
set_property(GLOBAL PROPERTY hp_bundle_text "")
function(hp_bundle_write text)
  set_property(GLOBAL APPEND_STRING PROPERTY hp_bundle_text "${text}\n")
endfunction()

function(hp_gpu_add name labels gpus timeout setup requires)
  hp_bundle_quote(cmd ${ARGN})
  hp_bundle_write("add_test(\"${name}\"${cmd})")
  set(props "LABELS \"${labels}\" PROCESSORS ${gpus} TIMEOUT ${timeout} SKIP_RETURN_CODE 77")
  string(APPEND props " WORKING_DIRECTORY \"\${HP_BUNDLE}/work\" ENVIRONMENT \"${HP_BUNDLE_ENV}\"")
  if(setup)
    string(APPEND props " FIXTURES_SETUP \"${setup}\"")
  endif()
  if(requires)
    string(APPEND props " FIXTURES_REQUIRED \"${requires}\"")
  endif()
  hp_bundle_write("set_tests_properties(\"${name}\" PROPERTIES ${props})")
endfunction()

function(hp_gpu_mpi out n)
  set(${out} mpirun -np ${n} --oversubscribe --bind-to none PARENT_SCOPE)
endfunction()

set(HP_GPU_HOTPATH "\${HP_BUNDLE}/bin/hotpath")
set(HP_GPU_TESTS "\${HP_BUNDLE}/bin/gpu_tests")
set(HP_GPU_CMP "\${HP_BUNDLE}/bin/hp_hf_compare")
set(HP_GPU_SRC "\${HP_ROOT}")
set(HP_GPU_WORK "\${HP_BUNDLE}/work")
set(HP_GPU_PYTHON python3)
set(HP_GPU_BUILD 1)

# ---- gpu_tests' GoogleTest cases ----------------------------------------------------------------
execute_process(COMMAND ${GPU_TESTS} --gtest_list_tests OUTPUT_VARIABLE listing
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bundle_ctest.cmake: '${GPU_TESTS} --gtest_list_tests' failed (${rc}): ${err}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suite "")
set(n_cases 0)
foreach(line ${lines})
  string(REGEX REPLACE " *#.*$" "" line "${line}")
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.$")
    set(suite ${CMAKE_MATCH_1})
  elseif(line MATCHES "^  ([A-Za-z0-9_/]+)$" AND suite)
    set(case ${suite}.${CMAKE_MATCH_1})
    if(case MATCHES "DISABLED_")
      continue()
    endif()
    math(EXPR n_cases "${n_cases} + 1")
    if(suite MATCHES "^(${HP_GPU_MPI_SUITES})$")
      hp_gpu_mpi(prefix 2)
      hp_gpu_add(${case}/np2 "gpu;mpi" 2 180 "" ""
                 bash ${HP_GPU_SRC}/tests/gpu/gpu_case.sh 2 -- ${prefix} ${HP_GPU_TESTS}
                 --gtest_filter=${case} --gtest_color=no)
    else()
      hp_gpu_add(${case} gpu 1 600 "" "" ${HP_GPU_TESTS} --gtest_filter=${case} --gtest_color=no)
      # GoogleTest's skip (no CUDA device), as gtest_discover_tests marks it in the build tree.
      hp_bundle_write("set_tests_properties(\"${case}\" PROPERTIES SKIP_REGULAR_EXPRESSION \"\\\\[  SKIPPED \\\\]\")")
    endif()
  endif()
endforeach()
if(n_cases EQUAL 0)
  message(FATAL_ERROR "bundle_ctest.cmake: ${GPU_TESTS} lists no test case")
endif()

# ---- the other GPU cases ------------------------------------------------------------------------
include(${CMAKE_CURRENT_LIST_DIR}/gpu_cases.cmake)

get_property(body GLOBAL PROPERTY hp_bundle_text)
file(WRITE ${OUT}.tmp
"# The GPU cases of hotpath, written by launch/scripts/gpu_bundle.sh (tests/gpu/bundle_ctest.cmake).
# From the repository root: source .gpu/env.sh && .gpu/run_gpu_tests.sh
# ctest reads this file from its own directory: the bundle is the one above, the repository root
# (tests/, examples/) the one above that, or HP_SOURCE_DIR.
file(REAL_PATH \"..\" HP_BUNDLE)
file(REAL_PATH \"../..\" HP_ROOT)
if(DEFINED ENV{HP_SOURCE_DIR})
  file(REAL_PATH \"\$ENV{HP_SOURCE_DIR}\" HP_ROOT)
endif()
file(MAKE_DIRECTORY \"\${HP_BUNDLE}/work\")
${body}")
file(RENAME ${OUT}.tmp ${OUT})
message(STATUS "bundle_ctest.cmake: ${n_cases} gpu_tests cases and the cases of gpu_cases.cmake in ${OUT}")
