# Runs the layering checker on the fixture tree and fails unless it rejects exactly the planted
# wrong includes, each named by file:line, and lets the allowed ones pass.
#
#   cmake -DHP_CHECKER=<check_layering.cmake> -DHP_FIXTURE=<fixture tree> -P expect_rejected.cmake

execute_process(COMMAND ${CMAKE_COMMAND} -DHP_ROOT=${HP_FIXTURE} -P ${HP_CHECKER}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
message(STATUS "checker output:\n${all}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the checker accepted a tree with upward includes")
endif()

set(expected
    "framework/core/uses_model.h:3: framework/core includes \"framework/model/model.h\""
    "framework/checkpoint/uses_mpi.h:5: framework/checkpoint includes <mpi.h>"
    "framework/model/climbs_out.h:3: \"../core/error.h\" climbs out of its folder"
    "optim/uses_launch.h:5: optim includes \"launch/trainer.h\" of launch"
    "framework/stray.h:1: not in a known layer")
foreach(e IN LISTS expected)
  string(FIND "${all}" "${e}" at)
  if(at LESS 0)
    message(FATAL_ERROR "the checker's output lacks: ${e}")
  endif()
endforeach()
foreach(allowed "uses_data.h" "parallel/uses_model.h" "optim/uses_launch.h:3:" "<hdf5.h>")
  string(FIND "${all}" "${allowed}" at)
  if(NOT at LESS 0)
    message(FATAL_ERROR "the checker rejected an allowed include: ${allowed}")
  endif()
endforeach()
string(FIND "${all}" "5 violation(s) of the dependency rule" at)
if(at LESS 0)
  message(FATAL_ERROR "the checker did not count 5 violations")
endif()
