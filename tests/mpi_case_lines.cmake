# hp_mpi_case_lines(OUT SRC): the lines of SRC that open a GoogleTest case, TEST( or
# HP_MPI_TEST( at the start of a line, for hp_mpi_cases (tests/CMakeLists.txt) to read. The rank
# counts of a multi-rank case are read from its HP_MPI_TEST line alone, so a call wrapped over
# two lines, or not at the start of one, would quietly become a single-process case: any
# HP_MPI_TEST( outside a comment that HP_MPI_TEST_LINE cannot read stops the configuration,
# naming the file and the line.
#
# As a script, `cmake -DSRC=FILE -P mpi_case_lines.cmake` runs the same check on FILE.
set(HP_MPI_TEST_LINE "^HP_MPI_TEST\\(([A-Za-z0-9_]+), *([A-Za-z0-9_]+), *([0-9][0-9, ]*)\\)")

function(hp_mpi_case_lines out src)
  file(STRINGS ${src} lines REGEX "^(HP_MPI_TEST|TEST)\\(")
  file(STRINGS ${src} uses REGEX "HP_MPI_TEST\\(")
  foreach(use ${uses})
    # A line with a ';' arrives in pieces: only the piece holding the call is checked.
    if(NOT use MATCHES "HP_MPI_TEST\\(" OR use MATCHES "^[ \t]*//")
      continue()
    endif()
    if(NOT use MATCHES "${HP_MPI_TEST_LINE}")
      message(FATAL_ERROR "${src}: cannot read the rank counts of '${use}': write the whole "
                          "HP_MPI_TEST(Suite, Name, ranks...) call on one line, at its start "
                          "(tests/common/mpi_case.h)")
    endif()
  endforeach()
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE AND DEFINED SRC)
  hp_mpi_case_lines(lines ${SRC})
  list(LENGTH lines n)
  message(STATUS "${SRC}: ${n} case lines")
endif()
