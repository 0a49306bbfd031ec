# hotpath_layering: runs cmake/check_layering.cmake over the source tree whenever a source of a
# layer changes. Every library of the project depends on it, so an include that runs upward
# (framework/core including framework/model, optim including launch, ...) fails the build before
# anything compiles, naming the file, the line and the rule.
#
# With tests, two CTest tests (label unit) check the checker: the source tree passes, and a fixture
# tree (tests/layering/fixture) with wrong includes is rejected with those files named.

set(HP_LAYERING_SCRIPT ${PROJECT_SOURCE_DIR}/cmake/check_layering.cmake)
set(HP_LAYERING_STAMP ${CMAKE_BINARY_DIR}/layering.stamp)

file(GLOB_RECURSE HP_LAYERED_SOURCES CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/framework/*.h ${PROJECT_SOURCE_DIR}/framework/*.hpp
     ${PROJECT_SOURCE_DIR}/framework/*.cpp ${PROJECT_SOURCE_DIR}/framework/*.cc
     ${PROJECT_SOURCE_DIR}/framework/*.cu ${PROJECT_SOURCE_DIR}/framework/*.cuh
     ${PROJECT_SOURCE_DIR}/parallel/*.h ${PROJECT_SOURCE_DIR}/parallel/*.hpp
     ${PROJECT_SOURCE_DIR}/parallel/*.cpp ${PROJECT_SOURCE_DIR}/parallel/*.cc
     ${PROJECT_SOURCE_DIR}/parallel/*.cu ${PROJECT_SOURCE_DIR}/parallel/*.cuh
     ${PROJECT_SOURCE_DIR}/optim/*.h ${PROJECT_SOURCE_DIR}/optim/*.hpp
     ${PROJECT_SOURCE_DIR}/optim/*.cpp ${PROJECT_SOURCE_DIR}/optim/*.cc
     ${PROJECT_SOURCE_DIR}/optim/*.cu ${PROJECT_SOURCE_DIR}/optim/*.cuh
     ${PROJECT_SOURCE_DIR}/launch/*.h ${PROJECT_SOURCE_DIR}/launch/*.hpp
     ${PROJECT_SOURCE_DIR}/launch/*.cpp ${PROJECT_SOURCE_DIR}/launch/*.cc
     ${PROJECT_SOURCE_DIR}/launch/*.cu ${PROJECT_SOURCE_DIR}/launch/*.cuh)

add_custom_command(
  OUTPUT ${HP_LAYERING_STAMP}
  COMMAND ${CMAKE_COMMAND} -DHP_ROOT=${PROJECT_SOURCE_DIR} -DHP_STAMP=${HP_LAYERING_STAMP}
          -P ${HP_LAYERING_SCRIPT}
  DEPENDS ${HP_LAYERING_SCRIPT} ${HP_LAYERED_SOURCES}
  COMMENT "Checking #include directives against the dependency rule"
  VERBATIM)
add_custom_target(hotpath_layering DEPENDS ${HP_LAYERING_STAMP})

if(HOTPATH_TESTS)
  enable_testing()
  add_test(NAME layering.source_tree
           COMMAND ${CMAKE_COMMAND} -DHP_ROOT=${PROJECT_SOURCE_DIR} -P ${HP_LAYERING_SCRIPT})
  add_test(NAME layering.rejects_upward_includes
           COMMAND ${CMAKE_COMMAND} -DHP_CHECKER=${HP_LAYERING_SCRIPT}
                   -DHP_FIXTURE=${PROJECT_SOURCE_DIR}/tests/layering/fixture
                   -P ${PROJECT_SOURCE_DIR}/tests/layering/expect_rejected.cmake)
  set_tests_properties(layering.source_tree layering.rejects_upward_includes
                       PROPERTIES LABELS unit TIMEOUT 120)
endif()
